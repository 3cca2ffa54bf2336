"""Exact attention of one DECODE query per (request, q head) over the keys `select_topk` chose for it.

Program (r, h, s) reads the slots `selected[r, h, :count]` (count = min(top_k, kv_len[r])), takes the s-th of
`num_splits` equal parts of them, and writes the part's float32 output and natural-log LSE into the partial
buffers `merge_splits` reads (an empty part: output 0, LSE -inf). Only requests flagged in `sparse` are
worked on. One query row per program, so the scores are elementwise products summed in float32 (no
`tl.dot`, whose tiles need 16 rows). Slots outside [0, num_slots) read slot 0 instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_sparse.kernels.ranged import LN2, capped_logits, kernel_tiles, score_scales
from attn_sparse.plan import StepPlan


@triton.jit(do_not_specialize=["num_slots", "top_k", "num_splits"])
def _selected_attention_kernel(
    Q,
    stride_qb,
    stride_qh,
    K,
    stride_ks,
    stride_kh,
    V,
    stride_vs,
    stride_vh,
    num_slots,
    SEL,
    stride_sb,
    stride_sh,
    KV_INDPTR,
    SPARSE,
    top_k,
    PO,
    stride_pb,
    stride_ph,
    stride_ps,
    PL,
    stride_lb,
    stride_lh,
    group,
    head_dim,
    v_dim,
    qk_scale,
    cap_log2,
    num_splits,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_CAP: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    if tl.load(SPARSE + r) == 0:
        return
    kvh = h // group
    count = tl.minimum(top_k, tl.load(KV_INDPTR + r + 1) - tl.load(KV_INDPTR + r))
    per = (tl.maximum(count, 0) + num_splits - 1) // num_splits
    s_lo = split * per
    s_hi = tl.minimum(s_lo + per, count)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + r * stride_qb + h * stride_qh + offs_d, mask=offs_d < head_dim, other=0.0).to(tl.float32)
    sel = SEL + r * stride_sb + h * stride_sh
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for start in range(s_lo, s_hi, BLOCK_N):
        n = start + offs_n
        n_ok = n < s_hi
        slot = tl.load(sel + n, mask=n_ok, other=0)
        slot = tl.where((slot >= 0) & (slot < num_slots), slot, 0).to(tl.int64)
        k = tl.load(
            k_base + slot[:, None] * stride_ks + offs_d[None, :],
            mask=n_ok[:, None] & (offs_d[None, :] < head_dim),
            other=0.0,
        )
        s = capped_logits(tl.sum(k.to(tl.float32) * q[None, :], 1), qk_scale, cap_log2, HAS_CAP)
        s = tl.where(n_ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use)
        v = tl.load(
            v_base + slot[:, None] * stride_vs + offs_dv[None, :],
            mask=n_ok[:, None] & (offs_dv[None, :] < v_dim),
            other=0.0,
        )
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    seen = l_i != 0  # 0: no key; NaN (a NaN score): the LSE stays NaN for merge_splits
    denom = tl.where(seen, l_i, 1.0)
    tl.store(PO + r * stride_pb + h * stride_ph + split * stride_ps + offs_dv, acc / denom, mask=offs_dv < v_dim)
    tl.store(PL + r * stride_lb + h * stride_lh + split, tl.where(seen, (m_i + tl.log2(denom)) * LN2, float("-inf")))


def selected_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    selected: torch.Tensor,
    plan: StepPlan,
    sparse: torch.Tensor,
    top_k: int,
    *,
    scale: float,
    logit_cap: float,
    partial_o: torch.Tensor,
    partial_lse: torch.Tensor,
) -> None:
    """Attention of each flagged request's DECODE query (q `[bs, Hq, D]`) over its selected keys, into the
    float32 partial buffers `[bs, Hq, S, Dv]` / `[bs, Hq, S]` (S = their split count)."""
    bs, hq, d = q.shape
    hkv, dv = k_buf.shape[1], v_buf.shape[2]
    splits = partial_o.shape[2]
    if bs == 0:
        return
    qk_scale, cap_log2 = score_scales(scale, logit_cap)
    _selected_attention_kernel[(bs, hq, splits)](
        q,
        q.stride(0),
        q.stride(1),
        k_buf,
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf,
        v_buf.stride(0),
        v_buf.stride(1),
        k_buf.shape[0],
        selected,
        selected.stride(0),
        selected.stride(1),
        plan.kv_indptr,
        sparse,
        top_k,
        partial_o,
        partial_o.stride(0),
        partial_o.stride(1),
        partial_o.stride(2),
        partial_lse,
        partial_lse.stride(0),
        partial_lse.stride(1),
        hq // hkv,
        d,
        dv,
        qk_scale,
        cap_log2,
        splits,
        BLOCK_N=kernel_tiles(q.is_cuda).block_n,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        HAS_CAP=logit_cap > 0,
        num_warps=4 if q.is_cuda else 1,
    )
