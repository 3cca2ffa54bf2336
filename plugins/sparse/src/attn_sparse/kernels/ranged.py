"""Paged attention of query rows over a range of key positions, with the LSE: the one attention kernel of
both backends' dense paths and of every dual-chunk part.

Query row i of request r sits at position p = seq_len[r] - q_len[r] + i and attends to the keys at
positions [lo(p), hi(p)) of the request (cut to its `kv_len` keys), set by the part (`PARTS`):

    CAUSAL: [0, p + 1)                       plain causal attention
    INTRA:  [c, p + 1)                        its own chunk, c = (p // chunk_len) * chunk_len
    SUCC:   [max(c - chunk_len, 0), c)        the previous chunk
    INTER:  [0, max(c - chunk_len, 0))        every chunk before that

Key j of request r lives in KV slot `kv_indices[kv_indptr[r] + j]` (attn-core's `build_kv_indices`). A
program takes one tile of rows (`attn_sparse.config.TileGeometry`: tokens x q heads of one KV head) and
one split of the tile's key span; it writes the rows' output (or, with several splits, fp32 partial outputs
and their LSEs for `merge_splits`). A row that sees no key gets output 0 and LSE -inf. Softmax in base 2;
LSEs leave in natural log.

Bounds: slots outside [0, num_slots) read slot 0 instead, query rows outside [0, num_tokens) are neither
read nor written, and keys stop at the request's `kv_len` (what the index kernel wrote), so a corrupt batch
never makes the kernel read or write out of bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from attn_core.ops.masked_values_triton import finite_values
from attn_sparse.plan import StepPlan

CAUSAL, INTRA, SUCC, INTER = 0, 1, 2, 3
#: part name -> its constant in the kernel
PARTS = {"causal": CAUSAL, "intra": INTRA, "succ": SUCC, "inter": INTER}
LOG2E = math.log2(math.e)
LN2 = tl.constexpr(math.log(2.0))
NO_KEY = tl.constexpr(1 << 30)


@triton.jit
def key_range(pos, chunk_len, PART: tl.constexpr):
    """[lo, hi) of the key positions a query at `pos` attends to in part PART (see the module doc); before
    the cut to the request's keys. Example: chunk_len 4, pos 9 (chunk start 8): INTRA [8, 10), SUCC [4, 8),
    INTER [0, 4), CAUSAL [0, 10)."""
    if PART == 0:
        lo = pos * 0
        hi = pos + 1
    else:
        start = (pos // chunk_len) * chunk_len
        if PART == 1:
            lo = start
            hi = pos + 1
        elif PART == 2:
            lo = tl.maximum(start - chunk_len, 0)
            hi = start
        else:
            lo = pos * 0
            hi = tl.maximum(start - chunk_len, 0)
    return lo, hi


@triton.jit
def capped_logits(qk, qk_scale, cap_log2, HAS_CAP: tl.constexpr):
    """Base-2 logits of raw scores `qk`: qk * qk_scale (qk_scale = scale * log2 e), or with a logit cap c,
    c * log2 e * tanh(qk * scale / c) (qk_scale = scale / c, cap_log2 = c * log2 e)."""
    if HAS_CAP:
        x = qk * qk_scale
        return cap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))
    return qk * qk_scale


@triton.jit(do_not_specialize=["num_slots", "num_tokens", "chunk_len", "num_splits"])
def _ranged_attention_kernel(
    Q,
    stride_qt,
    stride_qh,
    K,
    stride_ks,
    stride_kh,
    V,
    stride_vs,
    stride_vh,
    KV_INDPTR,
    KV_INDICES,
    num_slots,
    TILE_REQ,
    TILE_TOK,
    Q_START,
    Q_LEN,
    SEQ_LEN,
    SKIP,
    OUT,
    stride_ot,
    stride_oh,
    stride_os,
    LSE,
    stride_lt,
    stride_lh,
    num_tokens,
    group,
    head_dim,
    v_dim,
    qk_scale,
    cap_log2,
    chunk_len,
    num_splits,
    PART: tl.constexpr,
    SLICES: tl.constexpr,
    HPS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    STORE_LSE: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1) // SLICES
    sl = tl.program_id(1) % SLICES
    split = tl.program_id(2)
    r = tl.load(TILE_REQ + tile)
    if HAS_SKIP:
        if tl.load(SKIP + r) != 0:
            return
    t0 = tl.load(TILE_TOK + tile)
    kv_beg = tl.load(KV_INDPTR + r)
    kv_len = tl.load(KV_INDPTR + r + 1) - kv_beg
    q_start = tl.load(Q_START + r)
    q_len = tl.load(Q_LEN + r)
    seq = tl.load(SEQ_LEN + r)

    m = tl.arange(0, BLOCK_M)
    tok = t0 + m // HPS
    hh = sl * HPS + m % HPS
    q_row = q_start + tok
    row_ok = (m < BLOCK_T * HPS) & (tok < q_len) & (hh < group) & (q_row >= 0) & (q_row < num_tokens)
    head = kvh * group + hh
    lo, hi = key_range(seq - q_len + tok, chunk_len, PART)
    lo = tl.where(row_ok, tl.maximum(lo, 0), NO_KEY)
    hi = tl.where(row_ok, tl.minimum(hi, kv_len), 0)
    t_lo = tl.min(lo, 0)
    t_hi = tl.max(hi, 0)
    per = (tl.maximum(t_hi - t_lo, 0) + num_splits - 1) // num_splits
    s_lo = t_lo + split * per
    s_hi = tl.minimum(s_lo + per, t_hi)

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    row64 = tl.where(row_ok, q_row, 0).to(tl.int64)
    head64 = head.to(tl.int64)
    q = tl.load(
        Q + row64[:, None] * stride_qt + head64[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & (offs_d[None, :] < head_dim),
        other=0.0,
    )
    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start in range(s_lo, s_hi, BLOCK_N):
        n = start + offs_n
        n_ok = n < s_hi
        slot = tl.load(KV_INDICES + kv_beg + n, mask=n_ok, other=0)
        slot = tl.where((slot >= 0) & (slot < num_slots), slot, 0).to(tl.int64)
        k = tl.load(
            k_base + slot[:, None] * stride_ks + offs_d[None, :],
            mask=n_ok[:, None] & (offs_d[None, :] < head_dim),
            other=0.0,
        )
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        s = capped_logits(qk, qk_scale, cap_log2, HAS_CAP)
        visible = (n[None, :] >= lo[:, None]) & (n[None, :] < hi[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + slot[:, None] * stride_vs + offs_dv[None, :],
            mask=n_ok[:, None] & (offs_dv[None, :] < v_dim),
            other=0.0,
        )
        # a key a row does not see adds exactly nothing, whatever its V holds (no 0 * Inf): attn-core's helper
        v, sees_bad = finite_values(v, visible & row_ok[:, None])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        acc = tl.where(sees_bad[:, None] != 0, float("nan"), acc)
        m_i = m_new

    # l_i == 0: the row saw no key; a NaN l_i (a NaN score it saw) keeps a NaN LSE for merge_splits
    seen = l_i != 0
    denom = tl.where(seen, l_i, 1.0)
    out = acc / denom[:, None]
    o_ptr = OUT + row64[:, None] * stride_ot + head64[:, None] * stride_oh + split * stride_os + offs_dv[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < v_dim))
    if STORE_LSE:
        lse = tl.where(seen, (m_i + tl.log2(denom)) * LN2, float("-inf"))
        tl.store(LSE + row64 * stride_lt + head64 * stride_lh + split, lse, mask=row_ok)


@dataclass(frozen=True)
class KernelTiles:
    """Key-block width and warps of the launches (tiny under the interpreter, which runs programs in turn)."""

    block_n: int
    num_warps: int
    num_stages: int


def kernel_tiles(on_gpu: bool) -> KernelTiles:
    """64-key blocks, 4 warps on a GPU; 16-key blocks under the interpreter."""
    return KernelTiles(64, 4, 2) if on_gpu else KernelTiles(16, 1, 1)


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input precision for operands of `dtype`: "ieee" for float32 (no TF32: the fp32 bar is
    1e-5), "tf32" otherwise (ignored for 16-bit operands)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def score_scales(scale: float, logit_cap: float) -> tuple[float, float]:
    """(qk_scale, cap_log2) for `capped_logits`: (scale * log2 e, 0) without a cap, (scale / c, c * log2 e)
    with cap c > 0. Example: score_scales(0.5, 0.0) == (0.5 * 1.4427, 0.0)."""
    if logit_cap > 0:
        return scale / logit_cap, logit_cap * LOG2E
    return scale * LOG2E, 0.0


def launch_ranged(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    plan: StepPlan,
    *,
    part: int,
    chunk_len: int,
    scale: float,
    logit_cap: float,
    out: torch.Tensor,
    lse: Optional[torch.Tensor],
    splits: int,
    skip: Optional[torch.Tensor] = None,
) -> None:
    """Run the kernel for every tile of `plan`. q `[T, Hq, D]` (unit stride along D); k_buf / v_buf the
    layer's pool buffers `[slots, Hkv, D]` / `[slots, Hkv, Dv]`. With `splits` 1, `out` is the output
    `[T, Hq, Dv]` (any float dtype) and `lse` None or float32 `[T, Hq]`; with more, `out` is float32
    `[T, Hq, splits, Dv]` and `lse` float32 `[T, Hq, splits]` (both contiguous), for `merge_splits`.
    `skip` (int8 `[bs]`): requests whose programs return at once (their rows are left as they were)."""
    if plan.num_tiles == 0 or q.shape[0] == 0:
        return
    hq, d = q.shape[1], q.shape[2]
    hkv, dv = k_buf.shape[1], v_buf.shape[2]
    geo = plan.geometry
    tiles = kernel_tiles(q.is_cuda)
    qk_scale, cap_log2 = score_scales(scale, logit_cap)
    split_stride = out.stride(2) if splits > 1 else 0
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    _ranged_attention_kernel[(plan.num_tiles, hkv * geo.slices, splits)](
        q,
        q.stride(0),
        q.stride(1),
        k_buf,
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf,
        v_buf.stride(0),
        v_buf.stride(1),
        plan.kv_indptr,
        plan.kv_indices,
        k_buf.shape[0],
        plan.tile_req,
        plan.tile_tok,
        plan.q_start,
        plan.q_len,
        plan.seq_len,
        skip if skip is not None else plan.q_len,
        out,
        out.stride(0),
        out.stride(1),
        split_stride,
        lse if lse is not None else out,
        *lse_strides,
        q.shape[0],
        hq // hkv,
        d,
        dv,
        qk_scale,
        cap_log2,
        max(int(chunk_len), 1),
        splits,
        PART=part,
        SLICES=geo.slices,
        HPS=geo.heads_per_slice,
        BLOCK_T=geo.block_t,
        BLOCK_M=geo.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        HAS_CAP=logit_cap > 0,
        HAS_SKIP=skip is not None,
        STORE_LSE=lse is not None,
        DOT_PREC=dot_precision(q.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
