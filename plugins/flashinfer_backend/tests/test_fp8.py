"""fp8 KV caches in attn-flashinfer without flashinfer (CPU): what the wrappers are planned with and
given (ragged pass inputs, paged `run` scales), and that the capabilities accept fp8 under either q
dtype. The kernels themselves: test_gpu.py's fp8 checks (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from attn_core.contract.context import BackendContext
from attn_core.contract.layer import AttentionLayer
from attn_core.memory import MHATokenToKVPool, kv_scales
from attn_flashinfer.fp8 import cache_run_kwargs, ragged_inputs, ragged_kv_dtype
from attn_flashinfer.spec import CAPABILITIES
from attn_flashinfer.steps import Dims, check_context

FP8 = torch.float8_e4m3fn


def test_ragged_wrapper_is_planned_in_the_query_dtype_over_fp8():
    assert ragged_kv_dtype(Dims(32, 8, 128, torch.bfloat16, FP8)) == torch.bfloat16
    assert ragged_kv_dtype(Dims(32, 8, 128, torch.float16, FP8)) == torch.float16
    assert ragged_kv_dtype(Dims(32, 8, 128, torch.bfloat16, torch.bfloat16)) == torch.bfloat16


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_ragged_inputs_are_what_the_pool_stores(q_dtype):
    """The ragged pass sees exactly the values the pool's set_kv_buffer stores, dequantized."""
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(5, 2, 16, generator=gen) * 3).to(q_dtype), torch.randn(5, 2, 16, generator=gen).to(q_dtype)
    pool = MHATokenToKVPool(16, 1, FP8, head_num=2, head_dim=16, layer_num=1)
    layer = AttentionLayer(0, 4, 2, 16, k_scale=0.02, v_scale=0.5)
    loc = torch.tensor([2, 3, 7, 8, 9])
    pool.set_kv_buffer(layer, loc, k, v, layer.k_scale, layer.v_scale)
    scales = kv_scales(layer, pool)
    rk, rv = ragged_inputs(k, v, FP8, scales, q_dtype)
    assert rk.dtype == q_dtype and rv.dtype == q_dtype
    want_k = (pool.get_key_buffer(0)[loc].double() * 0.02).to(q_dtype)
    want_v = (pool.get_value_buffer(0)[loc].double() * 0.5).to(q_dtype)
    assert torch.equal(rk, want_k) and torch.equal(rv, want_v)
    same_k, same_v = ragged_inputs(k, v, torch.bfloat16, (1.0, 1.0), q_dtype)
    assert same_k is k and same_v is v
    assert ragged_inputs(None, None, FP8, scales, q_dtype) == (None, None)


def test_paged_run_gets_the_layer_scales():
    assert cache_run_kwargs((1.0, 1.0)) == {}
    assert cache_run_kwargs((0.02, 0.5)) == {"k_scale": 0.02, "v_scale": 0.5}
    assert cache_run_kwargs((0.25, 1.0)) == {"k_scale": 0.25, "v_scale": 1.0}


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_fp8_cache_is_declared_under_both_q_dtypes(q_dtype):
    ctx = BackendContext(device="cuda", dtype=q_dtype, kv_dtype=FP8, num_q_heads=8, num_kv_heads=2, head_dim=128)
    assert CAPABILITIES.mismatches(ctx.requirements(), layout_only=True) == []
    other = BackendContext(
        device="cuda", dtype=q_dtype, kv_dtype=torch.float8_e5m2, num_q_heads=8, num_kv_heads=2, head_dim=128
    )
    assert any("KV dtype float8_e5m2" in r for r in CAPABILITIES.mismatches(other.requirements(), layout_only=True))


def test_fp8_at_head_dim_64_is_refused_at_construction():
    from attn_core.contract.errors import UnsupportedFeatureError

    def ctx(head_dim):
        return BackendContext(
            device="cuda", dtype=torch.bfloat16, kv_dtype=FP8, num_q_heads=8, num_kv_heads=2, head_dim=head_dim
        )

    with pytest.raises(UnsupportedFeatureError, match="head_dim 64"):
        check_context(ctx(64), "flashinfer")
    check_context(ctx(128), "flashinfer")
    check_context(ctx(256), "flashinfer")
    check_context(
        BackendContext(device="cuda", dtype=torch.bfloat16, num_q_heads=8, num_kv_heads=2, head_dim=64), "flashinfer"
    )
