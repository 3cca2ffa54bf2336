"""Split-KV decode ("flash decoding") over a paged KV pool addressed by CSR kv_indptr / kv_indices.

Stage 1 (grid `[bs, kv_heads * head_blocks, max_splits]`): program (r, hb, s) takes request r's keys
in split s of its `split_count(kv_len)` splits (a function of the request's own length computed on the
device, so nothing here syncs with the host), and attends with the block of q heads that share one KV
head (GQA/MQA: every K/V tile is read once for the whole group). It writes the split's normalized
partial output and base-2 LSE.
Stage 2 (grid `[bs, num_q_heads]`) merges the splits by their LSEs, adds the sink, applies v_scale,
and writes the output (and the natural-log LSE). A launch with max_splits 1 (every request one split:
the batch alone fills the GPU) has no stage 2: stage 1 finishes its rows with the merge's arithmetic
for one split (`one_split_result`), bit for bit what stage 2 would write, and writes the output itself.

Splits of request r cover [lo, kv_len) in equal BLOCK_N-aligned chunks, where lo = kv_len - window for
sliding-window layers; the split layout depends only on the request's own length, and stage 2 sums
splits in a fixed order, which makes deterministic mode batch-invariant.

A program takes its whole BLOCK_N-key tiles first with no per-key masks, then the tail (a partial tile)
with them (`decode_tile`).

Bounds: kv_indptr entries are clamped into [0, len(kv_indices)] (KEY_OFFSETS) and a slot outside
[0, slots of k_buf) is not read (the key is masked out; SLOT: an unmasked tile reads slot 0 in its place,
and the program then redoes its keys with masked steps); both are recorded in the fault buffer
(`attn_core.ops.device_faults`), so no index read from the metadata can make the kernel read outside its
buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from attn_core.contract.errors import InvalidArgumentError
from attn_core.discovery.probes import triton_interpreter_enabled
from attn_core.memory.fp8 import is_fp8
from attn_triton.kernels.common import (
    FAULT_KEY_OFFSETS,
    FAULT_SLOT,
    LN2_K,
    LOG2E_K,
    e4m3_as_f16,
    e4m3_words_as_f16,
    finalize,
    fp8_query,
    fp8_unit_scales,
    kv_rows,
    load_slots,
    offset_range,
    paged_strides,
    score_scales,
    softmax_step,
    tile_logits,
    whole_tile_slots,
)


@dataclass(frozen=True)
class DecodeConfig:
    """Tile sizes of stage 1: BLOCK_N keys per step, at most BLOCK_H q heads per program."""

    block_n: int = 64
    block_h: int = 16
    num_warps: int = 4
    num_stages: int = 2
    #: fp8 cache: read V as int32 words (`e4m3_words_as_f16`) when its layout allows (`fits_words`)
    fp8_v_words: bool = True


@triton.jit
def split_count(kv_len, min_split_len, max_splits):
    """Splits of a request with kv_len keys: clamp(ceil(kv_len / min_split_len), 1, max_splits)."""
    return tl.minimum(tl.maximum(tl.cdiv(kv_len, min_split_len), 1), max_splits)


@triton.jit
def split_range(kv_len, lo, s, n_split, BLOCK_N: tl.constexpr):
    """Keys [s_lo, s_hi) of split s of a request's n_split splits over its keys [lo, kv_len): BLOCK_N-aligned
    shares, the last one shorter (the layout `merge_splits` and the MLA kernels rely on). Example: kv_len
    1000, lo 0, 3 splits, BLOCK_N 64: a share is ceil(334 / 64) * 64 = 384 keys, so split 0 takes [0, 384),
    1 [384, 768) and 2 [768, 1000)."""
    per = tl.cdiv(tl.cdiv(kv_len - lo, n_split), BLOCK_N) * BLOCK_N
    s_lo = lo + s * per
    return s_lo, tl.minimum(s_lo + per, kv_len)


@triton.jit
def _decode_split_kernel(
    Q,
    K,
    V,
    KV_INDPTR,
    KV_INDICES,
    num_indices,
    num_slots,
    FAULT,
    min_split_len,
    max_splits,
    PART_O,
    PART_LSE,
    SINKS,
    OUT,
    LSE,
    qk_scale,
    cap_scale,
    v_scale,
    window,
    num_q_heads,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    stride_eb,
    GROUP: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DPE: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SHARE_KV: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_PTX: tl.constexpr,
    V_WORDS: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_SINK: tl.constexpr,
    STORE_LSE: tl.constexpr,
    stride_kp,
    stride_vp,
    PAGE: tl.constexpr,
):
    r = tl.program_id(0)
    hb = tl.program_id(1)
    s = tl.program_id(2)
    kv_beg, kv_len, clamped = offset_range(KV_INDPTR, r, num_indices)
    if (hb == 0) & (s == 0):
        tl.store(FAULT + FAULT_KEY_OFFSETS, 1, mask=clamped)
    n_split = split_count(kv_len, min_split_len, max_splits)
    if s >= n_split:
        return
    kv_head, heads, h_ok = program_heads(hb, num_q_heads, GROUP, HEAD_BLOCKS, BLOCK_H)

    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(kv_len - window, 0)
    s_lo, s_hi = split_range(kv_len, lo, s, n_split, BLOCK_N)

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    q_row = Q + r.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_row + offs_d[None, :], mask=h_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    offs_dpe = tl.arange(0, BLOCK_DPE if BLOCK_DPE > 0 else 16)  # unread without a rope part (BLOCK_DPE 0)
    if BLOCK_DPE > 0:
        q_pe = tl.load(q_row + D + offs_dpe[None, :], mask=h_ok[:, None] & (offs_dpe[None, :] < DPE), other=0.0)
    else:
        q_pe = q
    if KV_FP8:  # fp16 dots on K/V tiles moved bit for bit (`e4m3_as_f16`); q's factor leaves with the scores
        q, q_pe, q_unscale = fp8_query(q, q_pe, BLOCK_DPE > 0)
        qk_scale = qk_scale * q_unscale
    k_head = K + kv_head * stride_kh
    v_head = V + kv_head * stride_vh

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    bad_slots = offs_n < 0
    # whole tiles first, with no per-key masks (`decode_tile`); a slot outside the pool there is not read (slot 0
    # is, in its place) and sends the program back over its range with masked steps, which leave that key out
    full_hi = tl.where(num_slots > 0, s_lo + (s_hi - s_lo) // BLOCK_N * BLOCK_N, s_lo)
    for start in range(s_lo, full_hi, BLOCK_N):
        m_i, l_i, acc, bad_slots = decode_tile(
            q,
            q_pe,
            m_i,
            l_i,
            acc,
            bad_slots,
            start,
            s_hi,
            offs_n,
            offs_d,
            offs_dpe,
            offs_dv,
            k_head,
            v_head,
            KV_INDICES,
            kv_beg,
            num_slots,
            qk_scale,
            cap_scale,
            stride_ks,
            stride_vs,
            stride_kp,
            stride_vp,
            BLOCK_N,
            D,
            BLOCK_DPE,
            DPE,
            DV,
            BLOCK_DV,
            SHARE_KV,
            LOGIT_CAP,
            DOT_PREC,
            KV_FP8,
            FP8_PTX,
            V_WORDS,
            False,
            PAGE,
        )
    redo = tl.max(bad_slots.to(tl.int32), 0) > 0
    if redo | (full_hi < s_hi):  # a tail (or a redo): skipped whole, not a loop of no steps, on the common path
        m_i = tl.where(redo, float("-inf"), m_i)
        l_i = tl.where(redo, 0.0, l_i)
        acc = tl.where(redo, 0.0, acc)
        for start in range(tl.where(redo, s_lo, full_hi), s_hi, BLOCK_N):
            m_i, l_i, acc, bad_slots = decode_tile(
                q,
                q_pe,
                m_i,
                l_i,
                acc,
                bad_slots,
                start,
                s_hi,
                offs_n,
                offs_d,
                offs_dpe,
                offs_dv,
                k_head,
                v_head,
                KV_INDICES,
                kv_beg,
                num_slots,
                qk_scale,
                cap_scale,
                stride_ks,
                stride_vs,
                stride_kp,
                stride_vp,
                BLOCK_N,
                D,
                BLOCK_DPE,
                DPE,
                DV,
                BLOCK_DV,
                SHARE_KV,
                LOGIT_CAP,
                DOT_PREC,
                KV_FP8,
                FP8_PTX,
                V_WORDS,
                True,
                PAGE,
            )

    tl.store(FAULT + FAULT_SLOT + offs_n * 0, 1, mask=bad_slots)  # one address: a flag, no reduction
    out, lse2 = finalize(m_i, l_i, acc)
    store_split_result(
        out,
        lse2,
        r,
        s,
        heads,
        h_ok,
        offs_dv,
        PART_O,
        PART_LSE,
        SINKS,
        OUT,
        LSE,
        v_scale,
        stride_pb,
        stride_ph,
        stride_ps,
        stride_lb,
        stride_lh,
        stride_ob,
        stride_oh,
        stride_eb,
        DV,
        SPLIT,
        HAS_SINK,
        STORE_LSE,
    )


@triton.jit
def decode_tile(
    q,
    q_pe,
    m_i,
    l_i,
    acc,
    bad_slots,
    start,
    s_hi,
    offs_n,
    offs_d,
    offs_dpe,
    offs_dv,
    k_head,
    v_head,
    KV_INDICES,
    kv_beg,
    num_slots,
    qk_scale,
    cap_scale,
    stride_ks,
    stride_vs,
    stride_kp,
    stride_vp,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    DPE: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SHARE_KV: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_PTX: tl.constexpr,
    V_WORDS: tl.constexpr,
    MASKED: tl.constexpr,
    PAGE: tl.constexpr,
):
    """One step of stage 1 over keys [start, start + BLOCK_N) of the program's range: the online-softmax
    state (m_i, l_i `[M]`, acc `[M, BLOCK_DV]`) taken further by that tile, and `bad_slots` `[BLOCK_N]` or-ed
    with the keys whose slot lies outside [0, num_slots). MASKED: keys at or past s_hi and bad slots are
    left out of the scores (-inf), as a partial tile needs. Not MASKED (a whole tile, start + BLOCK_N <=
    s_hi, and num_slots > 0): no score is masked, so no per-key mask moves from the loads' layout to the
    scores' (the masked step's layout conversions cost 6 barriers and ~20 % of the instructions of an fp8
    step as compiled for sm_90); a bad slot is still never read (slot 0 is read in its place), and the
    caller must redo the range MASKED, from a fresh state, when `bad_slots` comes back set. K/V rows sit at
    `kv_rows(slot, PAGE, stride_kp / stride_vp, stride_ks / stride_vs)` (`common.paged_strides`)."""
    n = start + offs_n
    if MASKED:
        n_ok = n < s_hi
        slot, n_ok, bad_slots = load_slots(KV_INDICES, kv_beg, n, n_ok, num_slots, bad_slots)
    else:  # slot 0 in place of a slot outside the pool (the redo leaves that key out); n_ok all true
        slot, bad_slots = whole_tile_slots(KV_INDICES, kv_beg, n, num_slots, bad_slots)
        n_ok = offs_n >= 0
    k_rows = kv_rows(slot, PAGE, stride_kp, stride_ks)[:, None]
    k = tl.load(k_head + k_rows + offs_d[None, :], mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    if KV_FP8:
        k = e4m3_as_f16(k, FP8_PTX)
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)
    if BLOCK_DPE > 0:
        pe_ok = n_ok[:, None] & (offs_dpe[None, :] < DPE)
        k_pe = tl.load(k_head + k_rows + D + offs_dpe[None, :], mask=pe_ok, other=0.0)
        if KV_FP8:
            k_pe = e4m3_as_f16(k_pe, FP8_PTX)
        qk += tl.dot(q_pe, tl.trans(k_pe.to(q.dtype)), input_precision=DOT_PREC)
    sc, s_scale = tile_logits(qk, qk_scale, cap_scale, LOGIT_CAP)
    if MASKED:
        sc = tl.where(n_ok[None, :], sc, float("-inf"))
    m_i, l_i, acc, p = softmax_step(m_i, l_i, acc, sc, s_scale, MASKED)
    if SHARE_KV:
        v = k
    else:
        if V_WORDS:  # fp8 V as int32 words (stride_vs in words): see `e4m3_words_as_f16`
            offs_w = tl.arange(0, BLOCK_DV // 4)
            v_ok = n_ok[:, None] & (offs_w[None, :] < DV // 4)
            vw = tl.load(
                v_head + kv_rows(slot, PAGE, stride_vp, stride_vs)[:, None] + offs_w[None, :], mask=v_ok, other=0
            )
            v = e4m3_words_as_f16(vw, BLOCK_N, BLOCK_DV, FP8_PTX)
        else:
            v_rows = kv_rows(slot, PAGE, stride_vp, stride_vs)[:, None]
            v = tl.load(v_head + v_rows + offs_dv[None, :], mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
            if KV_FP8:
                v = e4m3_as_f16(v, FP8_PTX)
    acc += tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
    return m_i, l_i, acc, bad_slots


@triton.jit
def program_heads(hb, num_q_heads, GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, BLOCK_H: tl.constexpr):
    """The q heads of a stage-1 program's head block hb (grid axis 1: KV head x HEAD_BLOCKS blocks of BLOCK_H
    heads of its GQA group): (its KV head, the heads `[BLOCK_H]`, which are real `[BLOCK_H]`). Example: GROUP
    4, HEAD_BLOCKS 1, BLOCK_H 16, hb 3 -> KV head 3, heads 12 .. 27, the first 4 real."""
    kv_head = hb // HEAD_BLOCKS
    in_group = (hb % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + in_group
    return kv_head, heads, (in_group < GROUP) & (heads < num_q_heads)


@triton.jit
def store_split_result(
    out,
    lse2,
    r,
    s,
    heads,
    h_ok,
    offs_dv,
    PART_O,
    PART_LSE,
    SINKS,
    OUT,
    LSE,
    v_scale,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    stride_eb,
    DV: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_SINK: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    """A stage-1 program's result for request r, split s, its `heads` `[M]` (real where `h_ok`): out `[M,
    BLOCK_DV]` normalized, lse2 `[M]` base 2. With SPLIT, into the merge's scratch (PART_O / PART_LSE); else
    the request's one split is final: `one_split_result` (sink, v_scale) into OUT and, with STORE_LSE, the
    natural-log LSE into LSE."""
    if SPLIT:
        po = PART_O + r.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + s * stride_ps + offs_dv[None, :]
        tl.store(po, out, mask=h_ok[:, None] & (offs_dv[None, :] < DV))
        tl.store(PART_LSE + r.to(tl.int64) * stride_lb + heads * stride_lh + s, lse2, mask=h_ok)
    else:
        out, lse_e = one_split_result(out, lse2, SINKS, heads, h_ok, v_scale, HAS_SINK)
        o_rows = OUT + r.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :]
        tl.store(o_rows, out.to(OUT.dtype.element_ty), mask=h_ok[:, None] & (offs_dv[None, :] < DV))
        if STORE_LSE:
            tl.store(LSE + r.to(tl.int64) * stride_eb + heads, lse_e, mask=h_ok)


@triton.jit
def one_split_result(out, lse2, SINKS, heads, h_ok, v_scale, HAS_SINK: tl.constexpr):
    """What `_decode_merge_kernel` computes for a request of one split, per row, in the same operations
    (so a request's output does not depend on whether its batch ran stage 2: batch invariance):
    out `[M, DV]` the split's normalized output, lse2 `[M]` its base-2 LSE; with HAS_SINK the rows' sinks
    (natural log) are read from SINKS at `heads` `[M]` where `h_ok`. Returns (the output times v_scale,
    float32; the natural-log LSE `[M]`). With no sink and a finite lse2 the weight is exp2(0) = 1 and the
    output out * v_scale. Shared by the decode kernel and both MLA kernels (the Hopper one calls it from
    Gluon)."""
    m = lse2
    sink2 = lse2
    if HAS_SINK:
        sink2 = tl.load(SINKS + heads, mask=h_ok, other=0.0) * LOG2E_K
        m = tl.maximum(m, sink2)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse2 - m_use)
    denom = w
    if HAS_SINK:
        denom += tl.exp2(sink2 - m_use)
    ok = denom > 0.0
    inv = tl.where(ok, v_scale / tl.where(ok, denom, 1.0), 0.0)
    lse_e = tl.where(ok, (m_use + tl.log2(tl.where(ok, denom, 1.0))) * LN2_K, float("-inf"))
    return (w[:, None] * out) * inv[:, None], lse_e


@triton.jit
def _decode_merge_kernel(
    PART_O,
    PART_LSE,
    KV_INDPTR,
    num_indices,
    min_split_len,
    max_splits,
    SINKS,
    OUT,
    LSE,
    v_scale,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    stride_eb,
    SPLITS_BLOCK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_SINK: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    _, kv_len, _ = offset_range(KV_INDPTR, r, num_indices)
    n_split = split_count(kv_len, min_split_len, max_splits)
    offs_s = tl.arange(0, SPLITS_BLOCK)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_ok = offs_s < n_split
    lse = tl.load(PART_LSE + r.to(tl.int64) * stride_lb + h * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINK:
        sink2 = tl.load(SINKS + h) * LOG2E_K
        m = tl.maximum(m, sink2)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_use)
    denom = tl.sum(w, 0)
    if HAS_SINK:
        denom += tl.exp2(sink2 - m_use)
    po = PART_O + r.to(tl.int64) * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_dv[None, :]
    parts = tl.load(po, mask=s_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    acc = tl.sum(w[:, None] * parts, 0)
    ok = denom > 0.0
    inv = tl.where(ok, v_scale / tl.where(ok, denom, 1.0), 0.0)
    tl.store(
        OUT + r.to(tl.int64) * stride_ob + h * stride_oh + offs_dv,
        (acc * inv).to(OUT.dtype.element_ty),
        mask=offs_dv < DV,
    )
    if STORE_LSE:
        lse_out = tl.where(ok, (m_use + tl.log2(tl.where(ok, denom, 1.0))) * LN2_K, float("-inf"))
        tl.store(LSE + r.to(tl.int64) * stride_eb + h, lse_out)


def fits_words(x: torch.Tensor) -> bool:
    """Whether a one-byte tensor `[slots, H, D]` can be read as int32 words: D, its row strides and its
    address multiples of 4, D contiguous. Example: a `[9, 2, 128]` uint8 pool → True; its `[..., :66]`
    slice → False."""
    return (
        x.stride(-1) == 1
        and x.shape[-1] % 4 == 0
        and all(s % 4 == 0 for s in x.stride()[:-1])
        and x.data_ptr() % 4 == 0
    )


def _pow2(x: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(int(x), 1)))


def head_block(group: int, config: DecodeConfig) -> int:
    """q heads per program: the whole GQA group, padded to 16 for the dot, up to config.block_h."""
    return min(config.block_h, _pow2(group))


def head_blocks(group: int, config: DecodeConfig) -> int:
    """Programs per KV head along the head axis (a group wider than BLOCK_H is cut into blocks)."""
    return triton.cdiv(group, head_block(group, config))


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    max_splits: int,
    min_split_len: int,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    fault: torch.Tensor,
    *,
    sm_scale: float,
    config: DecodeConfig,
    logit_cap: float = 0.0,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
    lse_out: Optional[torch.Tensor] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    d_rope: int = 0,
    share_kv: bool = False,
) -> None:
    """Decode attention of one query per request into `o` (and `lse_out`).

    q `[bs, Hq, D]`; k_buf `[slots, Hkv, D]`; v_buf `[slots, Hkv, Dv]` (ignored with `share_kv`, where V
    is the first Dv channels of K: absorbed MLA); o `[bs, Hq, Dv]`; kv_indptr `[bs+1]` int32,
    kv_indices int32 slots; request r takes clamp(ceil(kv_len / min_split_len), 1, max_splits) splits;
    part_o `[bs, Hq, max_splits, Dv]` and part_lse `[bs, Hq, max_splits]` float32 scratch (not written
    with max_splits 1: one launch then, stage 1 writes `o`); fault: the
    int32 fault buffer (`attn_core.ops.device_faults`); lse_out `[bs, Hq]` float32 natural log.
    The last `d_rope` channels of q/k form a second dot product (MLA's rope part).
    """
    bs, hq, d_total = q.shape
    if bs == 0:
        return
    check_split_shapes(bs, max_splits, kv_indptr, part_o, part_lse, o, lse_out)
    hkv = k_buf.shape[1]
    group = hq // hkv
    d = d_total - d_rope
    dv = o.shape[2]
    block_h = head_block(group, config)
    hblocks = head_blocks(group, config)
    # fp8 cache under fp16/bf16 q: the kernel reads raw bytes and dots fp16 tiles of value / 256
    # (`e4m3_as_f16`); under float32 q it converts fp8 to float32 (ieee dots, float32 accuracy)
    kv_fp8 = is_fp8(k_buf.dtype) and q.dtype != torch.float32
    if kv_fp8:
        k_scale, v_scale = fp8_unit_scales(k_scale, v_scale)
        k_buf, v_buf = k_buf.view(torch.uint8), (k_buf if share_kv else v_buf).view(torch.uint8)
    qk_scale, cap_scale = score_scales(sm_scale, logit_cap, k_scale)
    v = k_buf if share_kv else v_buf
    v_words = kv_fp8 and not share_kv and config.fp8_v_words and fits_words(v)
    if v_words:
        v = v.view(torch.int32)
    fp32 = q.dtype == torch.float32
    split = max_splits > 1  # else stage 1 writes o (and lse_out) itself: no merge launch
    num_slots, page, k_page, k_token = paged_strides(k_buf)
    _, _, v_page, v_token = paged_strides(v)
    args = (
        q,
        k_buf,
        v,
        kv_indptr,
        kv_indices,
        kv_indices.shape[0],
        num_slots,
        fault,
        min_split_len,
        max_splits,
        part_o,
        part_lse,
        sinks if sinks is not None else part_lse,
        o,
        lse_out if lse_out is not None else part_lse,
        qk_scale,
        cap_scale,
        float(v_scale),
        int(window or 0),
        hq,
        q.stride(0),
        q.stride(1),
        k_token,
        k_buf.stride(1),
        v_token,
        v.stride(1),
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        o.stride(0),
        o.stride(1),
        lse_out.stride(0) if lse_out is not None else 0,
    )
    consts = dict(
        GROUP=group,
        HEAD_BLOCKS=hblocks,
        BLOCK_H=block_h,
        BLOCK_N=config.block_n,
        D=d,
        BLOCK_D=_pow2(d),
        DV=dv,
        BLOCK_DV=_pow2(d) if share_kv else _pow2(dv),
        LOGIT_CAP=logit_cap > 0,
        HAS_WINDOW=window is not None,
        FP8_PTX=kv_fp8 and not triton_interpreter_enabled(),
        V_WORDS=v_words,
        SPLIT=split,
        HAS_SINK=sinks is not None,
        STORE_LSE=lse_out is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    grid = (bs, hkv * hblocks, max_splits)
    _decode_split_kernel[grid](
        *args,
        DPE=d_rope,
        BLOCK_DPE=_pow2(d_rope) if d_rope else 0,
        SHARE_KV=share_kv,
        DOT_PREC="ieee" if fp32 else "tf32",
        KV_FP8=kv_fp8,
        stride_kp=k_page,
        stride_vp=v_page,
        PAGE=page,
        **consts,
    )
    if split:
        merge_splits(
            part_o,
            part_lse,
            kv_indptr,
            kv_indices.shape[0],
            max_splits,
            min_split_len,
            o,
            sinks=sinks,
            lse_out=lse_out,
            v_scale=v_scale,
        )


def merge_splits(
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    kv_indptr: torch.Tensor,
    num_indices: int,
    max_splits: int,
    min_split_len: int,
    o: torch.Tensor,
    *,
    sinks: Optional[torch.Tensor] = None,
    lse_out: Optional[torch.Tensor] = None,
    v_scale: float = 1.0,
) -> None:
    """Stage 2 of split-KV decode (shared by `decode_attention` and the MLA kernel of `mla_decode`):
    merge each request's splits by their base-2 LSEs, join the sink, apply v_scale, write `o`.

    part_o `[bs, Hq, >= max_splits, Dv]` / part_lse `[bs, Hq, >= max_splits]` float32, as written by a
    stage 1 whose request r took `split_count(kv_len_r, min_split_len, max_splits)` splits, kv_len_r
    read from kv_indptr `[bs+1]` (clamped into [0, num_indices]); o `[bs, Hq, Dv]`; sinks `[Hq]` float32
    natural-log logits; lse_out `[bs, Hq]` float32 natural log.
    """
    bs, hq, dv = o.shape
    _decode_merge_kernel[(bs, hq)](
        part_o,
        part_lse,
        kv_indptr,
        num_indices,
        min_split_len,
        max_splits,
        sinks if sinks is not None else part_lse,
        o,
        lse_out if lse_out is not None else part_lse,
        float(v_scale),
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        o.stride(0),
        o.stride(1),
        lse_out.stride(0) if lse_out is not None else 0,
        SPLITS_BLOCK=triton.next_power_of_2(max_splits),
        DV=dv,
        BLOCK_DV=triton.next_power_of_2(dv),
        HAS_SINK=sinks is not None,
        STORE_LSE=lse_out is not None,
        num_warps=4 if dv >= 256 else 2,
    )


def check_split_shapes(
    bs: int,
    max_splits: int,
    kv_indptr: torch.Tensor,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    o: torch.Tensor,
    lse_out: Optional[torch.Tensor],
) -> None:
    """Host checks of what a split decode's grid reaches (shapes only: they hold for every replay of a
    graph): bs + 1 key offsets, scratch for bs x max_splits, one output row per request."""
    if kv_indptr.shape[0] < bs + 1:
        raise InvalidArgumentError("kv_indptr", f"at least bs + 1 = {bs + 1} offsets", kv_indptr.shape[0])
    if part_o.shape[0] < bs or part_lse.shape[0] < bs or part_o.shape[2] < max_splits or part_lse.shape[2] < max_splits:
        raise InvalidArgumentError(
            "part_o/part_lse", f"scratch for {bs} requests x {max_splits} splits", tuple(part_o.shape)
        )
    if o.shape[0] != bs or (lse_out is not None and lse_out.shape[0] != bs):
        raise InvalidArgumentError("o/lse_out", f"{bs} rows (one query per request)", o.shape[0])
