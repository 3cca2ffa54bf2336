"""Argument packing and scale folding for TRT-LLM's MLA decode, and the kernel choice by device. CPU only:
the vendor call itself is not made here."""

import math

import pytest
import torch

from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_trtllm_mla.args import QK_NOPE_HEAD_DIM, Scales, decode_kwargs, fold_scales
from attn_trtllm_mla.kernel import WORKSPACE_BYTES, kernel_for, new_workspace


@pytest.mark.parametrize(
    ("scaling", "q_scale", "k_scale", "bmm1", "bmm2"),
    [
        (0.0721, None, None, 0.0721, 1.0),
        (0.0721, None, 0.5, 0.03605, 0.5),
        (0.1, 2.0, 0.25, 0.05, 0.25),
        (192**-0.5, 1.0, 1.0, 192**-0.5, 1.0),
    ],
)
def test_fold_scales(scaling, q_scale, k_scale, bmm1, bmm2):
    s = fold_scales(scaling, q_scale, k_scale)
    assert math.isclose(s.bmm1, bmm1, rel_tol=1e-12) and math.isclose(s.bmm2, bmm2, rel_tol=1e-12)


def test_folded_scales_reproduce_a_dequantized_score():
    """The pool stores latent / k_scale; the kernel's bmm1 on the stored latent equals scaling * q.k."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(576, generator=g, dtype=torch.float64), torch.randn(576, generator=g, dtype=torch.float64)
    scaling, k_scale = 0.07, 0.37
    s = fold_scales(scaling, None, k_scale)
    assert math.isclose(float(q @ (k / k_scale)) * s.bmm1, float(q @ k) * scaling, rel_tol=1e-12)
    assert math.isclose(float((k / k_scale).sum()) * s.bmm2, float(k.sum()), rel_tol=1e-12)


def _inputs(bs=3, q_len=1, heads=8, page=32, pages=10):
    q = torch.randn(bs * q_len, heads, 576, dtype=torch.bfloat16)
    latent = torch.randn(pages * page, 1, 576, dtype=torch.bfloat16)
    table = torch.zeros(bs, 4, dtype=torch.int32)
    seq = torch.tensor([5, 40, 100][:bs], dtype=torch.int32)
    return q, latent, table, seq


@pytest.mark.parametrize("q_len", [1, 4])
def test_decode_kwargs_are_views_with_folded_scales(q_len):
    q, latent, table, seq = _inputs(q_len=q_len)
    ws = torch.zeros(16, dtype=torch.uint8)
    out = torch.empty(3, 8, 512, dtype=torch.bfloat16)
    kw = decode_kwargs(q, latent, 32, 512, 64, table, seq, 100, q_len, Scales(0.05, 0.5), ws, out)
    assert kw["query"].shape == (3, q_len, 8, 576) and kw["query"].data_ptr() == q.data_ptr()
    assert kw["kv_cache"].shape == (10, 32, 576) and kw["kv_cache"].data_ptr() == latent.data_ptr()
    assert kw["block_tables"] is table and kw["seq_lens"] is seq and kw["max_seq_len"] == 100
    assert (kw["bmm1_scale"], kw["bmm2_scale"]) == (0.05, 0.5) and kw["workspace_buffer"] is ws
    assert (kw["kv_lora_rank"], kw["qk_rope_head_dim"], kw["qk_nope_head_dim"]) == (512, 64, QK_NOPE_HEAD_DIM)
    assert kw["out"] is (out if q_len == 1 else None)  # FlashInfer 0.6.6 checks a given out as [bs, H, 512]


def test_decode_kwargs_refuse_bad_shapes_and_dtypes():
    q, latent, table, seq = _inputs()
    ws = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(InvalidArgumentError, match="3 requests x 2 queries"):
        decode_kwargs(q, latent, 32, 512, 64, table, seq, 100, 2, Scales(1.0, 1.0), ws, None)
    with pytest.raises(InvalidArgumentError, match="head dim 288"):
        decode_kwargs(q[..., :320], latent, 32, 256, 32, table, seq, 100, 1, Scales(1.0, 1.0), ws, None)
    with pytest.raises(UnsupportedFeatureError, match="bfloat16"):
        decode_kwargs(q.half(), latent, 32, 512, 64, table, seq, 100, 1, Scales(1.0, 1.0), ws, None)


@pytest.mark.parametrize(
    ("cc", "dtype", "want"),
    [
        ((10, 0), torch.bfloat16, "trtllm-gen"),
        ((10, 3), torch.bfloat16, "trtllm-gen"),
        ((12, 0), torch.bfloat16, None),
        ((9, 0), torch.bfloat16, None),
        ((10, 0), torch.float16, None),
    ],
)
def test_kernel_for(cc, dtype, want):
    assert kernel_for(cc, dtype) == want


def test_workspace_is_zeroed():
    ws = new_workspace(torch.device("cpu"))
    assert ws.numel() == WORKSPACE_BYTES and ws.dtype == torch.uint8 and not ws.any()
