"""Kernel-level tests: decode with every split count 1..N and extend at block-unaligned lengths. Pools
are poisoned with NaN outside the slots a request owns, slots are in random order, and every result is
compared with the float64 oracle. (The index kernel is attn-core's: core/tests/test_kv_indices_triton.py.)"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton_helpers import paged_setup, requires_interpreter

from attn_core.testing.reference import reference_attention, relative_error, tolerance
from attn_triton.kernels.common import E4M3_AS_F16_UNIT, e4m3_as_f16, e4m3_words_as_f16

pytestmark = requires_interpreter


@pytest.mark.parametrize("splits", list(range(1, 9)))
@pytest.mark.parametrize("variant", ["plain", "window_cap_sinks"])
def test_decode_every_split_count(splits, variant):
    from attn_triton.kernels.decode import DecodeConfig, decode_attention

    gen = torch.Generator().manual_seed(splits)
    lens = [1, 17, 50, 33, 64]  # one-token, off-block and exact-block lengths (BLOCK_N 16)
    hq, hkv, d = 6, 2, 32
    dtype = torch.float32
    k_buf, v_buf, indptr, indices, ks, vs = paged_setup(lens, hkv, d, d, dtype, gen, page_size=16)
    bs = len(lens)
    q = torch.randn(bs, hq, d, generator=gen)
    window = 20 if variant != "plain" else None
    cap = 3.0 if variant != "plain" else 0.0
    sinks = torch.randn(hq, generator=gen) if variant != "plain" else None
    o = torch.full((bs, hq, d), float("nan"))
    lse = torch.full((bs, hq), float("nan"))
    part_o = torch.full((bs, hq, 8, d), float("nan"))
    part_lse = torch.full((bs, hq, 8), float("nan"))
    cfg = DecodeConfig(block_n=16, block_h=16, num_warps=1, num_stages=1)
    fault = torch.zeros(8, dtype=torch.int32)
    decode_attention(  # min_split_len 1: every request but the one-token one takes `splits` splits
        q,
        k_buf,
        v_buf,
        o,
        indptr,
        indices,
        splits,
        1,
        part_o,
        part_lse,
        fault,
        sm_scale=0.2,
        config=cfg,
        logit_cap=cap,
        window=window,
        sinks=sinks,
        lse_out=lse,
    )
    assert not fault.any()
    for r, n in enumerate(lens):
        ref_o, ref_lse = reference_attention(
            q[r : r + 1],
            ks[r],
            vs[r],
            q_positions=torch.tensor([n - 1]),
            scale=0.2,
            window=window,
            logit_cap=cap,
            sinks=sinks,
        )
        assert relative_error(o[r : r + 1], ref_o) <= tolerance(dtype), (r, n)
        assert relative_error(lse[r : r + 1], ref_lse) <= 1e-5, (r, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sinks_on", [False, True])
def test_decode_one_split_launch_equals_merged(dtype, sinks_on):
    """max_splits 1 runs stage 1 alone (it writes o and the LSE itself); a request of one split inside a
    launch of max_splits 4 goes through the merge launch. Both must write the same bits (batch
    invariance: a request's output does not depend on its batch's split grid), and match the oracle."""
    from attn_triton.kernels.decode import DecodeConfig, decode_attention

    gen = torch.Generator().manual_seed(7 + sinks_on)
    lens = [1, 23, 40, 64]  # min_split_len 64 below: every request takes one split either way
    hq, hkv, d = 8, 2, 32
    k_buf, v_buf, indptr, indices, ks, vs = paged_setup(lens, hkv, d, d, dtype, gen, page_size=16)
    bs = len(lens)
    q = torch.randn(bs, hq, d, generator=gen).to(dtype)
    sinks = torch.randn(hq, generator=gen) if sinks_on else None
    cfg = DecodeConfig(block_n=16, block_h=16, num_warps=1, num_stages=1)
    outs = []
    for max_splits in (1, 4):
        o = torch.full((bs, hq, d), float("nan"), dtype=dtype)
        lse = torch.full((bs, hq), float("nan"))
        part_o = torch.full((bs, hq, 4, d), float("nan"))
        part_lse = torch.full((bs, hq, 4), float("nan"))
        fault = torch.zeros(8, dtype=torch.int32)
        decode_attention(
            q,
            k_buf,
            v_buf,
            o,
            indptr,
            indices,
            max_splits,
            64,
            part_o,
            part_lse,
            fault,
            sm_scale=0.3,
            config=cfg,
            sinks=sinks,
            lse_out=lse,
            v_scale=0.5,
        )
        assert not fault.any()
        if max_splits == 1:  # the scratch is not touched
            assert part_o.isnan().all() and part_lse.isnan().all()
        outs.append((o, lse))
    (o1, lse1), (o4, lse4) = outs
    assert torch.equal(o1, o4) and torch.equal(lse1, lse4)
    for r, n in enumerate(lens):
        ref_o, ref_lse = reference_attention(
            q[r : r + 1].double(),
            ks[r].double(),
            vs[r].double(),
            q_positions=torch.tensor([n - 1]),
            scale=0.3,
            sinks=sinks,
        )
        assert relative_error(o1[r : r + 1], 0.5 * ref_o) <= tolerance(dtype), (r, n)
        assert relative_error(lse1[r : r + 1], ref_lse) <= 1e-5, (r, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("lazy", [0, 2])
def test_extend_unaligned_lengths(dtype, page_size, lazy):
    """q lengths and prefixes around BLOCK_M/BLOCK_N (16) and page boundaries, zero prefixes included;
    `lazy`: the accumulator rescaled only when a row's max grew by more than 2 (base 2)."""
    from attn_triton.kernels.extend import ExtendConfig, extend_attention

    gen = torch.Generator().manual_seed(page_size)
    shapes = [(0, 1), (0, 17), (15, 16), (33, 31), (64, 3), (1, 0)]  # (prefix, q_len)
    lens = [p + e for p, e in shapes]
    hq, hkv, d = 4, 1, 32
    k_buf, v_buf, indptr, indices, ks, vs = paged_setup(lens, hkv, d, d, dtype, gen, page_size)
    q_lens = [e for _, e in shapes]
    qo = torch.zeros(len(shapes) + 1, dtype=torch.int32)
    qo[1:] = torch.tensor(q_lens).cumsum(0)
    T = int(qo[-1])
    q = torch.randn(T, hq, d, generator=gen).to(dtype)
    o = torch.full((T, hq, d), float("nan"), dtype=dtype)
    cfg = ExtendConfig(block_m=16, block_n=16, num_warps=1, num_stages=1, lazy_rescale=lazy)
    fault = torch.zeros(8, dtype=torch.int32)
    extend_attention(q, k_buf, v_buf, o, qo, indptr, indices, max(q_lens), fault, sm_scale=0.3, config=cfg)
    assert not fault.any()
    for r, (p, e) in enumerate(shapes):
        if e == 0:
            continue
        rows = slice(int(qo[r]), int(qo[r + 1]))
        ref_o, _ = reference_attention(q[rows], ks[r], vs[r], q_positions=torch.arange(p, p + e), scale=0.3)
        assert relative_error(o[rows], ref_o) <= tolerance(dtype), (p, e)


@triton.jit
def _e4m3_as_f16_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, e4m3_as_f16(tl.load(X + offs), False))


def test_e4m3_as_f16_every_byte():
    """All 256 float8_e4m3fn codes (NaN codes aside) moved bit for bit into fp16 read as value / 256,
    compared with torch's own fp8 → float64 conversion."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.full((256,), float("nan"), dtype=torch.float16)
    _e4m3_as_f16_kernel[(1,)](codes, out, N=256)
    want = codes.view(torch.float8_e4m3fn).double()
    finite = want.isfinite()
    assert int(finite.sum()) == 254  # 0x7F and 0xFF are e4m3fn's NaNs
    assert torch.equal(out.double()[finite] * E4M3_AS_F16_UNIT, want[finite])


@triton.jit
def _e4m3_words_as_f16_kernel(X, Y, ROWS: tl.constexpr, COLS: tl.constexpr):
    r = tl.arange(0, ROWS)[:, None]
    w = tl.load(X + r * (COLS // 4) + tl.arange(0, COLS // 4)[None, :])
    tl.store(Y + r * COLS + tl.arange(0, COLS)[None, :], e4m3_words_as_f16(w, ROWS, COLS, False))


def test_e4m3_words_as_f16_every_byte():
    """The word-wise conversion (int32 words of 4 e4m3 bytes) keeps every byte's position and value:
    all 256 codes laid out as a [16, 16] byte tile read as [16, 4] words."""
    codes = torch.randperm(256, generator=torch.Generator().manual_seed(3)).to(torch.uint8).reshape(16, 16)
    out = torch.full((16, 16), float("nan"), dtype=torch.float16)
    _e4m3_words_as_f16_kernel[(1,)](codes.view(torch.int32), out, ROWS=16, COLS=16)
    want = codes.view(torch.float8_e4m3fn).double()
    finite = want.isfinite()
    assert int(finite.sum()) == 254
    assert torch.equal(out.double()[finite] * E4M3_AS_F16_UNIT, want[finite])
