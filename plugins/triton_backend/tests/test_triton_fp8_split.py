"""The fp8 decode kernel whose warps split the keys (`kernels/decode_fp8_split.py`, `DecodeConfig.key_warps`)
through `decode_attention`, against a float64 reference written out here on the dequantized cache (stored e4m3
value x scale): random request lengths (1, off-tile, several steps), pages of 1 and 16 slots in random order,
a pool whose other slots hold random bytes (NaN codes included), NaN-poisoned outputs and scratch, several
splits a request (then the merge launch) and one split (stage 1 writes the output); on a GPU (marked `gpu`)
the benchmark's tiles at head_dim 128 in bf16 and fp16."""

from __future__ import annotations

import math

import pytest
import torch
from triton_helpers import requires_interpreter

from attn_core.errors import InvalidArgumentError
from attn_core.ops.device_faults import DeviceFaultKind
from attn_core.testing.reference import fp8_kv_tolerance, relative_error
from attn_triton.kernels.decode import DecodeConfig, decode_attention

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.02, 0.03  # random normal K / V over these stay well inside e4m3's ±448


def fp8_pool(lens, hkv, d, page_size, gen):
    """Random normal K/V quantized to e4m3 (x / scale) in a pool of random bytes, pages in random order.
    Returns (k_buf, v_buf `[slots, hkv, d]` float8_e4m3fn, kv_indptr, kv_indices int32, per-request slots)."""
    pages = [-(-n // page_size) for n in lens]
    num_pages = sum(pages) + 2
    perm = torch.randperm(num_pages, generator=gen).tolist()
    k_buf, v_buf = (torch.randint(0, 256, (num_pages * page_size, hkv, d), generator=gen, dtype=torch.uint8).view(FP8) for _ in range(2))
    slots = []
    for n, p in zip(lens, pages):
        mine, perm = perm[:p], perm[p:]
        s = (torch.tensor(mine)[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:n]
        k_buf[s] = (torch.randn(n, hkv, d, generator=gen) / K_SCALE).to(FP8)
        v_buf[s] = (torch.randn(n, hkv, d, generator=gen) / V_SCALE).to(FP8)
        slots.append(s)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(lens).cumsum(0)
    return k_buf, v_buf, indptr, torch.cat(slots).to(torch.int32), slots


def reference(q, k_buf, v_buf, slots, sm_scale, window=None, cap=0.0, sinks=None):
    """float64 decode of each request's query over its keys (the last `window` with a window): K / V
    dequantized (e4m3 value x scale), q head h reads KV head h // (Hq / Hkv); a logit cap c maps a logit
    x to c * tanh(x / c); a sink joins the softmax denominator. Returns (out `[bs, Hq, d]`, natural-log
    LSE `[bs, Hq]`)."""
    bs, hq, d = q.shape
    group = hq // k_buf.shape[1]
    out = torch.empty(bs, hq, d, dtype=torch.float64)
    lse = torch.empty(bs, hq, dtype=torch.float64)
    for r, s in enumerate(slots):
        s = s[-window:] if window else s
        k = k_buf[s].double() * K_SCALE  # [n, hkv, d]
        v = v_buf[s].double() * V_SCALE
        for h in range(hq):
            x = (k[:, h // group] @ q[r, h].double()) * sm_scale
            if cap:
                x = cap * torch.tanh(x / cap)
            if sinks is not None:
                x = torch.cat([x, sinks[h : h + 1].double()])
            p = torch.softmax(x, 0)[: len(s)]
            out[r, h] = p @ v[:, h // group]
            lse[r, h] = torch.logsumexp(x, 0)
    return out, lse


def run(q, k_buf, v_buf, indptr, indices, cfg, max_splits, min_split_len, sm_scale, **kw):
    """decode_attention into NaN-poisoned o / lse / scratch; returns (o, lse, the fault buffer)."""
    bs, hq, d = q.shape
    dev = q.device
    o = torch.full((bs, hq, d), float("nan"), dtype=q.dtype, device=dev)
    lse = torch.full((bs, hq), float("nan"), device=dev)
    part_o = torch.full((bs, hq, max_splits, d), float("nan"), device=dev)
    part_lse = torch.full((bs, hq, max_splits), float("nan"), device=dev)
    fault = torch.zeros(8, dtype=torch.int32, device=dev)
    decode_attention(
        q, k_buf, v_buf, o, indptr, indices, max_splits, min_split_len, part_o, part_lse, fault, sm_scale=sm_scale, config=cfg,
        lse_out=lse, k_scale=K_SCALE, v_scale=V_SCALE, **kw,
    )  # fmt: skip
    if max_splits == 1:  # stage 1 wrote o itself: the scratch is not touched
        assert part_o.isnan().all() and part_lse.isnan().all()
    return o, lse, fault


#: the LSE's error: scores carry fp16 q (11 bits, `fp8_query`) times exact e4m3 keys, summed in float32
LSE_TOL = 2e-3


@requires_interpreter
@pytest.mark.parametrize("key_warps", [2, 4])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("max_splits", [1, 4])
@pytest.mark.parametrize("variant", ["plain", "window_cap_sinks"])
def test_key_split_matches_reference(key_warps, page_size, max_splits, variant):
    """Random lengths (1 and lengths off the W x 16-key step among them); with max_splits 4 and min_split_len 8
    requests take up to 4 splits (merged by the merge launch), with 1 stage 1 finishes the rows itself."""
    seed = key_warps * 100 + page_size * 10 + max_splits + (variant != "plain") * 1000
    gen = torch.Generator().manual_seed(seed)
    lens = [1, 16 * key_warps, *torch.randint(2, 150, (3,), generator=gen).tolist()]
    hq, hkv, d = 8, 2, 32
    k_buf, v_buf, indptr, indices, slots = fp8_pool(lens, hkv, d, page_size, gen)
    q = torch.randn(len(lens), hq, d, generator=gen).half()
    sm_scale = 1 / math.sqrt(d)
    extra = {} if variant == "plain" else dict(window=40, logit_cap=3.0, sinks=torch.randn(hq, generator=gen))
    cfg = DecodeConfig(block_n=16, block_h=16, num_warps=key_warps, num_stages=1, key_warps=key_warps)
    o, lse, fault = run(q, k_buf, v_buf, indptr, indices, cfg, max_splits, 8, sm_scale, **extra)
    assert not fault.any()
    ref_o, ref_lse = reference(q, k_buf, v_buf, slots, sm_scale, extra.get("window"), extra.get("logit_cap", 0.0), extra.get("sinks"))
    assert relative_error(o, ref_o) <= fp8_kv_tolerance(q.dtype), (lens, relative_error(o, ref_o))
    assert (lse.double() - ref_lse).abs().max() <= LSE_TOL, (lens, (lse.double() - ref_lse).abs().max())


@requires_interpreter
def test_key_split_slots_outside_the_pool():
    """A key whose slot lies outside the pool is masked out (not read) and recorded as a SLOT fault; the rest
    of the request is attended as if the key were absent. V read byte-wise (`fp8_v_words` False) here."""
    gen = torch.Generator().manual_seed(5)
    lens = [70, 9]
    k_buf, v_buf, indptr, indices, slots = fp8_pool(lens, 2, 32, 16, gen)
    indices[40] = k_buf.shape[0] + 3
    indices[75] = -1
    q = torch.randn(2, 8, 32, generator=gen).half()
    cfg = DecodeConfig(block_n=16, block_h=16, num_warps=2, num_stages=1, fp8_v_words=False, key_warps=2)
    o, lse, fault = run(q, k_buf, v_buf, indptr, indices, cfg, 2, 8, 0.2)
    assert fault[int(DeviceFaultKind.SLOT)] == 1 and fault.sum() == 1
    kept = [torch.cat([slots[0][:40], slots[0][41:]]), torch.cat([slots[1][:5], slots[1][6:]])]
    ref_o, ref_lse = reference(q, k_buf, v_buf, kept, 0.2)
    assert relative_error(o, ref_o) <= fp8_kv_tolerance(q.dtype)
    assert (lse.double() - ref_lse).abs().max() <= LSE_TOL


@pytest.mark.parametrize("key_warps, num_warps", [(3, 1), (2, 4), (-1, 1)])
def test_key_warps_must_be_a_power_of_two_multiple_of_num_warps(key_warps, num_warps):
    with pytest.raises(InvalidArgumentError, match="key_warps"):
        DecodeConfig(num_warps=num_warps, key_warps=key_warps)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tile", [(16, 4, 3), (16, 4, 5), (32, 2, 1)], ids=["16x4x3", "16x4x5", "32x2x1"])
@pytest.mark.parametrize("max_splits", [1, 4])
def test_key_split_on_the_gpu(tile, dtype, max_splits):
    """The tiles the benchmark sweeps (keys per warp, warps, stages), head_dim 128, GQA 32 / 8, page 16, on
    the GPU (the PTX byte moves, the batched dots' warp layout) against the float64 reference."""
    block_n, warps, stages = tile
    gen = torch.Generator().manual_seed(block_n + warps + stages + max_splits)
    lens = [1, 700, 64 * warps, *torch.randint(2, 2000, (5,), generator=gen).tolist()]
    k_buf, v_buf, indptr, indices, slots = fp8_pool(lens, 8, 128, 16, gen)
    q = torch.randn(len(lens), 32, 128, generator=gen).to(dtype)
    cfg = DecodeConfig(block_n=block_n, block_h=16, num_warps=warps, num_stages=stages, key_warps=warps)
    cuda = [t.cuda() for t in (q, k_buf, v_buf, indptr, indices)]
    o, lse, fault = run(*cuda, cfg, max_splits, 256, 128**-0.5)
    ref_o, ref_lse = reference(q, k_buf, v_buf, slots, 128**-0.5)
    assert not fault.any()
    assert relative_error(o.cpu(), ref_o) <= fp8_kv_tolerance(dtype), relative_error(o.cpu(), ref_o)
    assert (lse.cpu().double() - ref_lse).abs().max() <= LSE_TOL
