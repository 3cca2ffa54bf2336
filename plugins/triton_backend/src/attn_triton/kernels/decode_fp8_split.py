"""Stage 1 of split-KV decode over an fp8 (e4m3) cache with the keys of a program split among its warps
(opt-in: `DecodeConfig.key_warps` = W > 0; `decode.decode_attention` picks it).

Why: the fp8 stage-1 kernel (`decode._decode_split_kernel` at `FP8_DECODE_CONFIG`) is latency-bound by
occupancy (docs/perf.md, "fp8 KV cache decode"): a program's warps all work on one key tile, so the bytes
an SM keeps in flight are bounded by the few programs that fit it. Here each warp streams its own key
tiles, so a program of W warps keeps W independent tiles (times the pipeline's stages) in flight, and
the head block's q is reused across all of them.

Layout: program (r, hb, s) is the one of `_decode_split_kernel`: request r, the block of BLOCK_H q heads
hb of one KV head, split s of the request's `split_count` splits (`split_range` over W * BLOCK_N-key
shares). A step covers W * BLOCK_N keys: their slots are read as one vector (`load_slots`) and viewed as
`[W, BLOCK_N]`, warp w taking keys w * BLOCK_N .. w * BLOCK_N + BLOCK_N - 1 of the step, i.e. key tiles
w, w + W, w + 2W, ... of the split. Every per-warp quantity carries a leading axis of size W, which
Triton's batched dots place one warp per index (num_warps = W):
- q `[W, BLOCK_H, D]`: the head block's fp16 q (`fp8_query`) broadcast to every warp;
- K `[W, BLOCK_N, D]` read as bytes through the warps' slots `[W, BLOCK_N]`, moved into fp16 (`e4m3_as_f16`);
  scores `[W, BLOCK_H, BLOCK_N]` = q x K^T (a batched dot);
- V `[W, BLOCK_N, DV]` read as int32 words (`e4m3_words_as_f16`) or bytes; acc `[W, BLOCK_H, DV]` += p x V;
- each warp keeps its own online-softmax state: m, l `[W, BLOCK_H]`, acc `[W, BLOCK_H, DV]`.
After the last step the W states are merged by their maxima (`merge_warp_states`) and the program writes
what `_decode_split_kernel` writes: with SPLIT the split's normalized output and base-2 LSE, else the
final output and natural-log LSE (`one_split_result`).

Pipelining: Triton's pipeliner counts the slot load as a load of its own, so K / V (loaded through the
slots) are issued (num_stages - 1) // 2 steps ahead: 3 stages keep one step's tiles in flight, 5 two.
As compiled for sm_90 (Triton 3.9), 16-key tiles stay within the registers (4 warps, 3 stages: 210 a
thread); 32-key tiles hold twice the K and V operands per warp and spill from 2 stages on.

Supported: MHA/GQA over an fp8 cache with fp16/bf16 q, sliding window, logit cap, sinks, LSE output;
slots outside the pool are masked and recorded in the fault buffer as in `_decode_split_kernel`. Routed
to `_decode_split_kernel` by `decode_attention`: absorbed MLA (`share_kv`), a rope part (`d_rope` > 0),
float32 q and 16-bit caches.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attn_triton.kernels.common import (
    FAULT_KEY_OFFSETS,
    FAULT_SLOT,
    e4m3_as_f16,
    e4m3_words_as_f16,
    finalize,
    fp8_query,
    load_slots,
    offset_range,
    scale_scores,
)
from attn_triton.kernels.decode import program_heads, split_count, split_range, store_split_result


@triton.jit
def warp_softmax_step(m_i, l_i, acc, s, s_scale):
    """`common.softmax_step` (guarded) for W independent states, one per warp: running max m_i and
    denominator l_i `[W, M]`, accumulator acc `[W, M, DV]`, scores s `[W, M, N]` (base-2 logits
    s * s_scale, -inf where masked). Returns the new max, denominator, rescaled accumulator and p
    `[W, M, N]`; a row that has seen only -inf keeps max -inf and contributes nothing."""
    m_new = tl.maximum(m_i, tl.max(s, 2) * s_scale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s * s_scale - m_use[:, :, None])
    return m_new, l_i * alpha + tl.sum(p, 2), acc * alpha[:, :, None], p


@triton.jit
def merge_warp_states(m_i, l_i, acc):
    """W online-softmax states over disjoint keys, m_i / l_i `[W, M]`, acc `[W, M, DV]`, → one state over
    all of them: (max `[M]`, denominator `[M]`, accumulator `[M, DV]`), each state weighted by
    exp2(its max - the common max); states that saw no key weigh 0. Example (one row): maxima [2, -inf],
    denominators [1.5, 0] → max 2, denominator 1.5, the accumulator of the first state."""
    m = tl.max(m_i, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(m_i - m_use[None, :])
    return m, tl.sum(l_i * w, 0), tl.sum(acc * w[:, :, None], 0)


@triton.jit
def decode_fp8_key_split_kernel(
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
    KEY_WARPS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    FP8_PTX: tl.constexpr,
    V_WORDS: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_SINK: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    """The arguments of `decode._decode_split_kernel` (K / V as uint8, V as int32 words with V_WORDS,
    scales from `fp8_unit_scales`) without its MLA ones; BLOCK_N keys per warp per step, KEY_WARPS warps."""
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
    s_lo, s_hi = split_range(kv_len, lo, s, n_split, KEY_WARPS * BLOCK_N)

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    keys = tl.arange(0, KEY_WARPS * BLOCK_N)  # a step's keys, warp w's at w * BLOCK_N + [0, BLOCK_N)
    q = tl.load(
        Q + r.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=h_ok[:, None] & (offs_d[None, :] < D), other=0.0
    )
    q, _, q_unscale = fp8_query(q, q, False)
    qk_scale = qk_scale * q_unscale
    q = tl.broadcast_to(q[None, :, :], [KEY_WARPS, BLOCK_H, BLOCK_D])
    k_head = K + kv_head * stride_kh
    v_head = V + kv_head * stride_vh

    m_i = tl.full([KEY_WARPS, BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([KEY_WARPS, BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([KEY_WARPS, BLOCK_H, BLOCK_DV], dtype=tl.float32)
    bad_slots = keys < 0
    for start in range(s_lo, s_hi, KEY_WARPS * BLOCK_N):
        n = start + keys
        slot, n_ok, bad_slots = load_slots(KV_INDICES, kv_beg, n, n < s_hi, num_slots, bad_slots)
        n_ok = tl.reshape(n_ok, [KEY_WARPS, BLOCK_N])  # [W, BLOCK_N]: the warps' keys
        slot3, ok3 = tl.reshape(slot, [KEY_WARPS, BLOCK_N])[:, :, None], n_ok[:, :, None]
        k = tl.load(k_head + slot3 * stride_ks + offs_d[None, None, :], mask=ok3 & (offs_d[None, None, :] < D), other=0)
        qk = tl.dot(q, tl.trans(e4m3_as_f16(k, FP8_PTX), 0, 2, 1))  # [W, BLOCK_H, BLOCK_N]
        if LOGIT_CAP:
            sc = scale_scores(qk, qk_scale, cap_scale, LOGIT_CAP)
            s_scale = 1.0
        else:
            sc = qk
            s_scale = qk_scale
        sc = tl.where(n_ok[:, None, :], sc, float("-inf"))
        m_i, l_i, acc, p = warp_softmax_step(m_i, l_i, acc, sc, s_scale)
        if V_WORDS:  # stride_vs in words; the conversion takes 2-D tiles: the warps' rows one after another
            offs_w = tl.arange(0, BLOCK_DV // 4)
            vw = tl.load(v_head + slot3 * stride_vs + offs_w[None, None, :], mask=ok3 & (offs_w[None, None, :] < DV // 4), other=0)
            rows = tl.reshape(vw, [KEY_WARPS * BLOCK_N, BLOCK_DV // 4])
            v = tl.reshape(e4m3_words_as_f16(rows, KEY_WARPS * BLOCK_N, BLOCK_DV, FP8_PTX), [KEY_WARPS, BLOCK_N, BLOCK_DV])
        else:
            v = e4m3_as_f16(
                tl.load(v_head + slot3 * stride_vs + offs_dv[None, None, :], mask=ok3 & (offs_dv[None, None, :] < DV), other=0), FP8_PTX
            )
        acc += tl.dot(p.to(tl.float16), v)

    tl.store(FAULT + FAULT_SLOT + keys * 0, 1, mask=bad_slots)  # one address: a flag, no reduction
    m_i, l_i, acc = merge_warp_states(m_i, l_i, acc)
    out, lse2 = finalize(m_i, l_i, acc)
    store_split_result(
        out, lse2, r, s, heads, h_ok, offs_dv, PART_O, PART_LSE, SINKS, OUT, LSE, v_scale, stride_pb, stride_ph, stride_ps, stride_lb,
        stride_lh, stride_ob, stride_oh, stride_eb, DV, SPLIT, HAS_SINK, STORE_LSE,
    )  # fmt: skip
