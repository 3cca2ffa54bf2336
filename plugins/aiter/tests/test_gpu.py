"""On an AMD GPU with AITER (ROCm torch, `pip install 'attn-aiter[rocm]'`): each real operator against the
emulation it was written from, on the same inputs, then attn-core's conformance kit on the real backend.
Marked `gpu`; everywhere else every test skips with the probe's reason. None of this has run yet: no AMD
GPU was available to this project."""

from __future__ import annotations

import pytest
import torch
from attn_aiter.spec import SPEC

from attn_core.testing import ConformanceSuite

REASON = SPEC.probe()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"aiter: {REASON}")]


def _close(a, b, tol=2e-2):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12)) < tol


def _csr(lens, page, gen, dev):
    """Shuffled pages for sequences of `lens` tokens: (indptr in pages, page ids, last page lens), int32."""
    npages = [-(-n // page) for n in lens]
    ids = (torch.randperm(sum(npages) + 4, generator=gen)[: sum(npages)] + 1).to(torch.int32)
    indptr = torch.tensor([0, *torch.tensor(npages).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([n - (m - 1) * page for n, m in zip(lens, npages)], dtype=torch.int32)
    return indptr.to(dev), ids.to(dev), last.to(dev), sum(npages) + 5


def test_paged_attention_ragged_matches_the_emulation():
    import aiter
    from attn_aiter.testing import emulated_ops as emu

    gen, dev = torch.Generator().manual_seed(0), "cuda"
    lens, page, hq, hkv, d = [300, 17, 1, 520], 16, 8, 2, 128
    indptr, ids, last, npages = _csr(lens, page, gen, dev)
    kc = torch.randn(npages, page, hkv, d, generator=gen).bfloat16().to(dev)
    vc = torch.randn(npages, page, hkv, d, generator=gen).bfloat16().to(dev)
    q = torch.randn(len(lens), hq, d, generator=gen).bfloat16().to(dev)
    parts = -(-max(lens) // 256)
    ws = torch.empty(emu.pa_workspace_bytes(len(lens), hq, parts, d, 2), dtype=torch.uint8, device=dev)
    one = torch.ones(1, device=dev)
    outs = []
    for fn in (aiter.paged_attention_ragged, emu.paged_attention_ragged):
        out = torch.full_like(q, float("nan"))
        fn(out, ws, q, kc, vc, 0.09, indptr, ids, last, page, parts, None, "auto", "NHD", 0.0, one, one, None, 256)
        outs.append(out)
    assert _close(outs[0], outs[1])


def test_flash_attn_varlen_matches_the_emulation():
    import aiter
    from attn_aiter.testing import emulated_ops as emu

    gen, dev = torch.Generator().manual_seed(1), "cuda"
    qlens, klens = [7, 1, 33], [40, 1, 33]
    q = torch.randn(sum(qlens), 8, 128, generator=gen).bfloat16().to(dev)
    k = torch.randn(sum(klens), 2, 128, generator=gen).bfloat16().to(dev)
    v = torch.randn(sum(klens), 2, 128, generator=gen).bfloat16().to(dev)
    cq = torch.tensor([0, 7, 8, 41], dtype=torch.int32, device=dev)
    ck = torch.tensor([0, 40, 41, 74], dtype=torch.int32, device=dev)
    real = aiter.flash_attn_varlen_func(q, k, v, cq, ck, 33, 40, softmax_scale=0.08, causal=True)
    emul = emu.flash_attn_varlen_func(q, k, v, cq, ck, 33, 40, softmax_scale=0.08, causal=True)
    assert _close(real, emul)


@pytest.mark.parametrize("qlen", [1, 3, 100])
def test_mla_kernels_match_the_emulation(qlen):
    from aiter import mla
    from attn_aiter.testing import emulated_ops as emu

    gen, dev = torch.Generator().manual_seed(qlen), "cuda"
    klens, heads = [qlen + 50, qlen, qlen + 700], 16
    slots = sum(klens) + 8
    cache = torch.randn(slots, 1, 1, 576, generator=gen).bfloat16().to(dev)
    ids = (torch.randperm(slots - 1, generator=gen)[: sum(klens)] + 1).to(torch.int32).to(dev)
    kv = torch.tensor([0, *torch.tensor(klens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    qo = torch.arange(0, 4 * qlen, qlen, dtype=torch.int32, device=dev)
    last = torch.ones(3, dtype=torch.int32, device=dev)
    q = torch.randn(3 * qlen, heads, 576, generator=gen).bfloat16().to(dev)
    real_fn = mla.mla_decode_fwd if qlen <= 4 else mla.mla_prefill_fwd
    emul_fn = emu.make_mla_decode_fwd(True) if qlen <= 4 else emu.mla_prefill_fwd
    outs = []
    for fn in (real_fn, emul_fn):
        o = torch.full((3 * qlen, heads, 512), float("nan"), dtype=torch.bfloat16, device=dev)
        fn(q, cache, o, qo, kv, ids, last, qlen, sm_scale=0.04)
        outs.append(o)
    assert _close(outs[0], outs[1])


class TestConformanceOnAMD(ConformanceSuite):
    backend = "aiter"
    device = "cuda"
    quick = True
