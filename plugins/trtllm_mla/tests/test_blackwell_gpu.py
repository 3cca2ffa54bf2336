"""GPU checks of `trtllm_mha` and `cutlass_mla` (marked `gpu`; each skips with its reason elsewhere). None of the
Blackwell parts has run: no Blackwell GPU was available to this project.

- any CUDA GPU that is not compute capability 10.x (the lent H100 / H200): both probes name the capability;
- wherever flashinfer / sgl-kernel import (no kernel launched): the installed functions' signatures accept
  exactly the keyword arguments the backends pack;
- on a Blackwell GPU (10.x): each real kernel against the float64 stand-in it was written from, on the same
  inputs, then attn-core's conformance kit on the real backends.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

from attn_core.testing import ConformanceSuite
from attn_trtllm_mla import mha_args
from attn_trtllm_mla.testing import blackwell_stand_ins as si

pytestmark = pytest.mark.gpu
CUDA = torch.cuda.is_available()
CC = torch.cuda.get_device_capability() if CUDA else None
BLACKWELL = CUDA and CC[0] == 10
HAS_FI = importlib.util.find_spec("flashinfer") is not None
HAS_SGL = importlib.util.find_spec("sgl_kernel") is not None


@pytest.mark.skipif(not CUDA or BLACKWELL, reason="needs a CUDA GPU other than compute capability 10.x")
def test_probes_name_the_capability():
    from attn_trtllm_mla.cutlass_spec import SPEC as CUTLASS
    from attn_trtllm_mla.mha_spec import SPEC as MHA

    want = f"needs compute capability 10.x, found {CC[0]}.{CC[1]}"
    assert MHA.probe() == want and CUTLASS.probe() == want


def _mha_kwargs(dev, q_len=2, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    page, hkv, d, lens = 32, 2, 128, [300, 7, 65]
    pages = sum(-(-n // page) for n in lens) + 4
    k = torch.randn(pages * page, hkv, d, generator=gen).to(dtype).to(dev)
    v = torch.randn(pages * page, hkv, d, generator=gen).to(dtype).to(dev)
    ids = (torch.randperm(pages - 1, generator=gen) + 1).to(torch.int32)
    table = torch.zeros(3, 10, dtype=torch.int32)
    start = 0
    for b, n in enumerate(lens):
        used = -(-n // page)
        table[b, :used] = ids[start : start + used]
        start += used
    q = torch.randn(3 * q_len, 8, d, generator=gen).to(dtype).to(dev)
    kv = (mha_args.hnd_view(k, page), mha_args.hnd_view(v, page))
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    decode = mha_args.decode_kwargs(
        q,
        kv,
        torch.zeros(mha_args.WORKSPACE_BYTES, dtype=torch.uint8, device=dev),
        table.to(dev),
        seq,
        max_seq_len=320,
        scales=(0.08, 1.0),
        window=-1,
        q_len=q_len,
        sinks=None,
    )
    cq = torch.tensor([0, q_len, 2 * q_len, 3 * q_len], dtype=torch.int32, device=dev)
    ck = torch.tensor([0, 300, 307, 372], dtype=torch.int32, device=dev)
    context = mha_args.context_kwargs(
        q,
        kv,
        decode["workspace_buffer"],
        table.to(dev),
        seq,
        cum_seq_lens_q=cq,
        cum_seq_lens_kv=ck,
        max_q_len=q_len,
        max_kv_len=320,
        scales=(0.08, 1.0),
        window=-1,
        sinks=None,
    )
    return decode, context


@pytest.mark.skipif(not (CUDA and HAS_FI), reason="needs CUDA and flashinfer-python")
def test_flashinfer_signatures_accept_the_packed_arguments():
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache
    from flashinfer.prefill import trtllm_batch_context_with_kv_cache

    decode, context = _mha_kwargs("cuda")
    inspect.signature(trtllm_batch_decode_with_kv_cache).bind(**decode)
    inspect.signature(trtllm_batch_context_with_kv_cache).bind(**context)


@pytest.mark.skipif(not (CUDA and HAS_SGL), reason="needs CUDA and sgl-kernel")
def test_sgl_kernel_signatures_accept_the_arguments():
    from sgl_kernel import cutlass_mla_decode, cutlass_mla_get_workspace_size

    names = (
        "q_nope",
        "q_pe",
        "kv_c_and_k_pe_cache",
        "seq_lens",
        "page_table",
        "workspace",
        "sm_scale",
        "num_kv_splits",
    )
    inspect.signature(cutlass_mla_decode).bind(**{n: None for n in names})
    inspect.signature(cutlass_mla_get_workspace_size).bind(1, 1, num_kv_splits=1)


@pytest.mark.skipif(
    not (BLACKWELL and HAS_FI), reason="needs a Blackwell GPU (compute capability 10.x) and flashinfer-python"
)
@pytest.mark.parametrize("kernel", ["decode", "context"])
def test_trtllm_mha_kernels_match_the_stand_in(kernel):
    from attn_trtllm_mla import mha_kernels

    decode, context = _mha_kwargs("cuda")
    kw = decode if kernel == "decode" else context
    real = getattr(mha_kernels, kernel)(kw)
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    cpu["kv_cache"] = tuple(x.cpu() for x in kw["kv_cache"])  # contiguous HND copies of the views
    cpu["workspace_buffer"] = torch.zeros(8, dtype=torch.uint8)
    want = (si.trtllm_decode if kernel == "decode" else si.trtllm_context)(cpu)
    assert float((real.cpu().double() - want.double()).norm() / want.double().norm()) < 2e-2


@pytest.mark.skipif(
    not (BLACKWELL and HAS_SGL), reason="needs a Blackwell GPU (compute capability 10.x) and sgl-kernel"
)
def test_cutlass_mla_kernel_matches_the_stand_in():
    from attn_trtllm_mla import cutlass_kernels

    gen = torch.Generator().manual_seed(1)
    lens, h = [300, 5], 16
    cache = torch.randn(8, 128, 576, generator=gen).bfloat16()
    table = torch.tensor([[3, 1, 6], [2, 0, 0]], dtype=torch.int32)
    q = torch.randn(2, h, 576, generator=gen).bfloat16()
    seq = torch.tensor(lens, dtype=torch.int32)
    ws = torch.empty(cutlass_kernels.workspace_size(3 * 128, 2), dtype=torch.uint8, device="cuda")
    real = cutlass_kernels.decode(
        q[..., :512].cuda(), q[..., 512:].cuda(), cache.cuda(), seq.cuda(), table.cuda(), ws, 0.04
    )
    want = si.cutlass_mla_decode(
        q[..., :512],
        q[..., 512:],
        cache,
        seq,
        table,
        torch.empty(si.cutlass_mla_get_workspace_size(384, 2), dtype=torch.uint8),
        0.04,
    )
    assert float((real.cpu().double() - want.double()).norm() / want.double().norm()) < 2e-2


class TestTrtllmMHAOnBlackwell(ConformanceSuite):
    backend = "trtllm_mha"
    device = "cuda"
    quick = True


class TestCutlassMLAOnBlackwell(ConformanceSuite):
    backend = "cutlass_mla"
    device = "cuda"
    quick = True
