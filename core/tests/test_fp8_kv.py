"""fp8 (float8_e4m3fn) KV caches in the core pools: quantization against a float64 reference written
from e4m3's definition, saturation, scale validation, untouched slots, and the pools' other writers."""

from __future__ import annotations

import math

import pytest
import torch

from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.layer import AttentionLayer
from attn_core.memory import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    SlidingWindowAllocator,
    SlidingWindowKVPool,
    kv_scales,
)
from attn_core.memory.fp8 import dequantize_kv, e4m3_error_bound, quantize_kv

FP8 = torch.float8_e4m3fn


def e4m3_values() -> list[float]:
    """Every finite non-negative float8_e4m3fn value, from the format's definition (bias 7, 3 mantissa
    bits, exponent field 15 with mantissa 7 is NaN), independent of torch's cast."""
    vals = [m / 8 * 2.0**-6 for m in range(8)]  # subnormals (exponent field 0)
    for e in range(1, 16):
        for m in range(8):
            if e == 15 and m == 7:
                continue
            vals.append((1 + m / 8) * 2.0 ** (e - 7))
    return vals


E4M3 = torch.tensor(e4m3_values(), dtype=torch.float64)


def nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the e4m3 grid, saturating at ±448, in float64 (the reference)."""
    a = x.double().abs().clamp(max=448.0)
    d = (a[..., None] - E4M3).abs()
    best = d.min(dim=-1, keepdim=True).values
    ties = d == best
    idx = torch.arange(E4M3.numel())
    # among tied neighbours prefer the even mantissa (an even index in the ascending grid)
    cand = torch.where(ties, idx, E4M3.numel() * 4)
    even = torch.where(ties & (idx % 2 == 0), idx, E4M3.numel() * 4)
    pick = torch.where(even.min(-1).values < E4M3.numel(), even.min(-1).values, cand.min(-1).values)
    return torch.copysign(E4M3[pick], x.double())


def test_reference_grid_matches_the_format():
    assert E4M3.numel() == 127 and E4M3.max() == 448.0 and E4M3[1] == 2.0**-9
    assert torch.equal(torch.tensor(e4m3_values()).to(FP8).double(), E4M3)


@pytest.mark.parametrize("scale", [None, 0.37, 4.0])
def test_quantize_matches_float64_reference_and_bound(scale):
    gen = torch.Generator().manual_seed(1)
    s = 1.0 if scale is None else scale
    x = (
        torch.randn(4000, generator=gen, dtype=torch.float64)
        * torch.exp2(torch.randint(-12, 9, (4000,), generator=gen)).double()
    )
    x = x.float()
    q = quantize_kv(x, FP8, scale)
    assert q.dtype == FP8
    want = nearest_e4m3(x.double() / s)
    assert torch.equal(q.double(), want), "cast is not round-to-nearest with saturation"
    back = dequantize_kv(q, scale, torch.float64)
    inside = x.double().abs() / s <= 448.0
    err = (back - x.double()).abs()
    assert bool((err[inside] <= e4m3_error_bound(x, scale)[inside] * (1 + 1e-12)).all())
    rel = err[inside & (x.double().abs() / s >= 2**-6)] / x.double().abs()[inside & (x.double().abs() / s >= 2**-6)]
    assert float(rel.max()) <= 2.0**-4 and float(rel.max()) > 2.0**-5  # the bound is reached, not loose


def test_saturation_and_nan():
    x = torch.tensor([449.0, 1e6, -1e6, float("inf"), float("-inf"), float("nan"), 464.0])
    q = quantize_kv(x, FP8).double()
    assert q[:5].tolist() == [448.0, 448.0, -448.0, 448.0, -448.0]
    assert math.isnan(q[5]) and q[6] == 448.0
    assert quantize_kv(torch.tensor([900.0]), FP8, 2.0).double().item() == 448.0  # 450 saturates too


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True, "2"])
def test_bad_scale_is_refused_before_any_write(bad):
    pool = MHATokenToKVPool(16, 1, FP8, head_num=2, head_dim=4, layer_num=1)
    pool.k_buffer[0].fill_(0x7F)  # NaN bytes
    before = pool.k_buffer[0].clone(), pool.v_buffer[0].clone()
    k = torch.randn(2, 2, 4)
    with pytest.raises(InvalidArgumentError, match="v_scale"):
        pool.set_kv_buffer(0, torch.tensor([1, 2]), k, k, k_scale=1.0, v_scale=bad)
    with pytest.raises(InvalidArgumentError, match="k_scale"):
        pool.set_kv_buffer(0, torch.tensor([1, 2]), k, k, k_scale=bad, v_scale=1.0)
    assert torch.equal(pool.k_buffer[0], before[0]) and torch.equal(pool.v_buffer[0], before[1])


@pytest.mark.parametrize("layout,page", [("NHD", 1), ("HND", 4)])
def test_mha_pool_stores_quantized_and_leaves_other_slots(layout, page):
    gen = torch.Generator().manual_seed(2)
    pool = MHATokenToKVPool(16, page, FP8, head_num=2, head_dim=8, layer_num=2, v_head_dim=4, kv_layout=layout)
    assert pool.k_buffer[0].dtype == torch.uint8 and pool.get_key_buffer(0).dtype == FP8
    for buf in pool.k_buffer + pool.v_buffer:
        buf.fill_(0x7F)  # e4m3fn NaN everywhere
    loc = torch.tensor([5, 9, 10])
    k, v = torch.randn(3, 2, 8, generator=gen) * 50, torch.randn(3, 2, 4, generator=gen)
    pool.set_kv_buffer(1, loc, k.reshape(3, 16), v, k_scale=0.25, v_scale=3.0)
    kb, vb = pool.get_key_buffer(1), pool.get_value_buffer(1)
    if layout == "HND":
        kb = kb.permute(0, 2, 1, 3).reshape(-1, 2, 8)
        vb = vb.permute(0, 2, 1, 3).reshape(-1, 2, 4)
    assert torch.equal(kb[loc].double(), nearest_e4m3(k.double() / 0.25))
    assert torch.equal(vb[loc].double(), nearest_e4m3(v.double() / 3.0))
    others = torch.ones(kb.shape[0], dtype=torch.bool)
    others[loc] = False
    assert bool(kb[others].double().isnan().all()) and bool(vb[others].double().isnan().all())
    assert bool((pool.k_buffer[0] == 0x7F).all())  # other layer untouched


def test_mla_pool_quantizes_latent_with_k_scale():
    pool = MLATokenToKVPool(32, 16, FP8, kv_lora_rank=8, qk_rope_head_dim=4, layer_num=1)
    pool.kv_buffer[0].fill_(0x7F)
    loc = torch.tensor([17, 40])
    nope, rope = torch.randn(2, 1, 8) * 10, torch.randn(2, 1, 4)
    pool.set_kv_buffer(0, loc, torch.cat([nope, rope], -1), None, k_scale=0.5, v_scale=7.0)
    assert torch.equal(pool.get_value_buffer(0)[loc].double(), nearest_e4m3(nope.double() / 0.5))
    assert torch.equal(pool.get_key_buffer(0)[loc][..., 8:].double(), nearest_e4m3(rope.double() / 0.5))
    assert int((pool.kv_buffer[0] != 0x7F).any(-1).any(-1).sum()) == 2
    layer = AttentionLayer(0, 4, 1, 12, v_head_dim=8, k_scale=0.5, v_scale=7.0)
    assert kv_scales(layer, pool) == (0.5, 0.5)  # the value is the latent: dequantized with k_scale


def test_kv_scales_names_the_bad_attribute():
    pool = MHATokenToKVPool(16, 1, FP8, head_num=1, head_dim=4, layer_num=1)
    assert kv_scales(AttentionLayer(0, 2, 1, 4), pool) == (1.0, 1.0)
    assert kv_scales(AttentionLayer(0, 2, 1, 4, k_scale=0.5, v_scale=2.0), pool) == (0.5, 2.0)
    with pytest.raises(InvalidArgumentError, match="layer.v_scale"):
        kv_scales(AttentionLayer(0, 2, 1, 4, v_scale=-1.0), pool)


def test_window_pool_quantizes_in_both_sub_pools():
    alloc = SlidingWindowAllocator(32, 32, 4, 1, "cpu")
    pool = SlidingWindowKVPool(alloc, FP8, 1, 4, 2, [0], "cpu")
    full = alloc.alloc(3)
    k = torch.randn(3, 1, 4) * 100
    for lid in (0, 1):
        pool.set_kv_buffer(lid, full, k, k, k_scale=0.5, v_scale=0.5)
        slots = pool.window_slots(full).long() if lid == 0 else full
        assert torch.equal(pool.get_key_buffer(lid)[slots].double(), nearest_e4m3(k.double() / 0.5))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_draft_kv_copies_move_fp8_bytes_exactly(layout):
    """The multi-step draft wrapper's page-aligned K/V copies carry an fp8 cache's bytes unchanged
    (NaN bytes included) and touch no other slot."""
    from attn_core.wrappers.multi_step_draft import _copy_kv_slots

    gen = torch.Generator().manual_seed(4)
    pool = MHATokenToKVPool(32, 4, FP8, head_num=2, head_dim=8, layer_num=2, kv_layout=layout)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    src, dst = torch.tensor([5, 6, 13]), torch.tensor([20, 21, 30])
    _copy_kv_slots(pool, dst, src)

    def rows(buf):
        return buf if layout == "NHD" else buf.permute(0, 2, 1, 3).reshape(-1, 2, 8)

    for b0, b1 in zip(before, pool.k_buffer + pool.v_buffer):
        r0, r1 = rows(b0), rows(b1)
        assert torch.equal(r1[dst], r0[src])
        keep = torch.ones(r0.shape[0], dtype=torch.bool)
        keep[dst] = False
        assert torch.equal(r1[keep], r0[keep])
