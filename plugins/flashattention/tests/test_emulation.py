"""The FA4 stand-in (`attn_flashattention.testing.emulated_fa4`) against attn-core's independent float64
reference on random paged inputs (pages in random order, every row no sequence uses poisoned with NaN),
and its strict readings of what FA4 asserts or leaves to the caller."""

from __future__ import annotations

import random

import pytest
import torch

from attn_core.testing.reference import reference_attention, relative_error
from attn_flashattention.testing.emulated_fa4 import (
    EmulatedFa4Error,
    flash_attn_varlen_func,
    resolve_window,
    sm90_tile_n,
)


def _paged(rng: random.Random, gen: torch.Generator, lens: list[int], page: int, hkv: int, d: int, dtype):
    """K/V pages in random order for sequences of `lens` keys: (k_pages, v_pages, page_table, dense K/V per
    sequence). Rows no sequence uses hold NaN."""
    need = [max(1, -(-n // page)) for n in lens]
    num_pages = sum(need) + 3
    order = list(range(1, num_pages))
    rng.shuffle(order)
    k = torch.full((num_pages, page, hkv, d), float("nan"), dtype=dtype)
    v = torch.full((num_pages, page, hkv, d), float("nan"), dtype=dtype)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    dense = []
    for b, n in enumerate(lens):
        ids = [order.pop() for _ in range(need[b])]
        table[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        kb = torch.randn(n, hkv, d, generator=gen).to(dtype)
        vb = torch.randn(n, hkv, d, generator=gen).to(dtype)
        for p in range(n):
            k[ids[p // page], p % page] = kb[p]
            v[ids[p // page], p % page] = vb[p]
        dense.append((kb, vb))
    return k, v, table, dense


@pytest.mark.parametrize("seed", range(8))
def test_matches_the_reference_on_random_paged_batches(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dtype = rng.choice([torch.float16, torch.bfloat16])
    hkv = rng.choice([1, 2])
    hq = hkv * rng.choice([1, 2, 4])
    d = rng.choice([64, 128])
    page = rng.choice([1, 4, 16, 64])
    bs = rng.randint(1, 4)
    causal = rng.random() < 0.75
    window = rng.choice([None, 1, 5, 40]) if causal else None
    softcap = rng.choice([0.0, 1.5])
    sinks = torch.randn(hq, generator=gen) if rng.random() < 0.5 else None
    q_lens = [rng.randint(0, 9) for _ in range(bs)]
    lens = [q + rng.randint(0, 70) for q in q_lens]
    k, v, table, dense = _paged(rng, gen, lens, page, hkv, d, dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    scale = 0.9 / d**0.5
    kw = dict(cu_seqlens_q=cu, max_seqlen_q=max(q_lens + [1]), seqused_k=torch.tensor(lens, dtype=torch.int32))
    kw.update(page_table=table, softmax_scale=scale, causal=causal, learnable_sink=sinks, softcap=softcap)
    window_size = (None, None) if window is None else (window - 1, 0)
    out, lse = flash_attn_varlen_func(q, k, v, window_size=window_size, return_lse=True, **kw)
    assert (
        out.dtype == dtype
        and out.shape == (sum(q_lens), hq, d)
        and lse.shape == (hq, sum(q_lens))
        and lse.dtype == torch.float32
    )
    for b in range(bs):
        q0, q1 = int(cu[b]), int(cu[b + 1])
        if q0 == q1:
            continue
        kb, vb = dense[b]
        positions = torch.arange(lens[b] - q_lens[b], lens[b])
        ref_o, ref_lse = reference_attention(
            q[q0:q1],
            kb,
            vb,
            q_positions=positions,
            scale=scale,
            causal=causal,
            window=window,
            logit_cap=softcap,
            sinks=sinks,
        )
        assert relative_error(out[q0:q1], ref_o) < 2e-2, (b, relative_error(out[q0:q1], ref_o))
        assert relative_error(lse[:, q0:q1].T, ref_lse) < 1e-4


def test_window_resolution_and_tiles_follow_fa4():
    assert resolve_window(True, 3, None) == (False, True, 3, 0)
    assert resolve_window(True, None, None) == (True, False, None, None)
    assert resolve_window(False, -1, -1) == (False, False, None, None)
    assert resolve_window(False, None, 0) == (True, False, None, None)
    assert (
        sm90_tile_n(128, True, False) == 128
        and sm90_tile_n(256, False, True) == 64
        and sm90_tile_n(256, True, False) == 80
    )


def _inputs(page=16, dtype=torch.bfloat16, d=64):
    q = torch.randn(3, 2, d).to(dtype)
    k = torch.randn(4, page, 1, d).to(dtype)
    kw = dict(cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32), max_seqlen_q=3, causal=True)
    kw.update(seqused_k=torch.tensor([5], dtype=torch.int32), page_table=torch.tensor([[1, 2]], dtype=torch.int32))
    return q, k, k.clone(), kw


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_splits=2), "SplitKV"),
        (dict(cu_seqlens_k=torch.tensor([0, 5], dtype=torch.int32)), "cu_seqlens_k"),
        (dict(max_seqlen_q=2), "max_seqlen_q"),
        (dict(seqused_k=torch.tensor([40], dtype=torch.int32)), "outside its table row"),
        (
            dict(page_table=torch.tensor([[1, 9]], dtype=torch.int32), seqused_k=torch.tensor([20], dtype=torch.int32)),
            "outside the pool",
        ),
        (dict(page_table=torch.tensor([[1, 2]], dtype=torch.int64)), "int32"),
        (dict(cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32)), "total_q"),
        (dict(learnable_sink=torch.zeros(3)), "learnable_sink"),
        (dict(mask_mod=lambda *a: True), "mask_mod"),
    ],
)
def test_refuses_what_fa4_asserts_or_leaves_undefined(change, message):
    q, k, v, kw = _inputs()
    kw.update(change)
    with pytest.raises(EmulatedFa4Error, match=message):
        flash_attn_varlen_func(q, k, v, **kw)


def test_refuses_fp8_mixed_dtypes_and_whole_tile_pages():
    q, k, v, kw = _inputs()
    with pytest.raises(EmulatedFa4Error, match="SM100"):
        flash_attn_varlen_func(q, k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), **kw)
    with pytest.raises(EmulatedFa4Error, match="same dtype"):
        flash_attn_varlen_func(q.half(), k, v, **kw)
    q, k, v, kw = _inputs(page=128)
    with pytest.raises(EmulatedFa4Error, match="TMA"):
        flash_attn_varlen_func(q, k, v, **kw)


def test_a_query_without_keys_gets_zero_and_its_sink():
    q, k, v, kw = _inputs()
    kw.update(seqused_k=torch.tensor([0], dtype=torch.int32), causal=False)
    out, lse = flash_attn_varlen_func(q, k, v, return_lse=True, **kw)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all() and (lse < 0).all()
    sinks = torch.tensor([0.5, -1.0])
    out, lse = flash_attn_varlen_func(q, k, v, return_lse=True, learnable_sink=sinks, **kw)
    assert torch.equal(out, torch.zeros_like(out)) and torch.allclose(lse, sinks[:, None].expand(2, 3))
