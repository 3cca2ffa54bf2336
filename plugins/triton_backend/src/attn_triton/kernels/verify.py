"""Speculative verify attention (MHA/GQA/MQA): every request has the same q_len (1..16) new tokens.

TARGET_VERIFY and DRAFT_EXTEND steps of speculative decoding carry a few query tokens per request.
The extend kernel would tile them BLOCK_M tokens of one q head at a time (a 64- or 128-row tile
holding 4 useful rows) and read each K/V tile once per q head. Here the tokens are folded into the M
dimension instead: program (r, hb) takes request r and a block of the q heads sharing one KV head,
and its tile rows are (q head, draft token) pairs, row i = head hh = i // Q_LEN, token t = i % Q_LEN.
Each K/V tile is loaded once for the whole group and all the request's tokens (GQA 32/8 with 4
drafts: 16 rows, one tensor-core tile; with 8 drafts: 32 rows).

Grid `[bs, num_kv_heads * head_blocks]`; a group with more than `block_m_max // q_len` q heads is cut
into head blocks. There is no key split: at the sizes verify runs (bs x kv_heads programs, e.g. bs64 x
8 = 512 for the 132 SMs of an H100/H200) the grid already fills the device several times over, and
without splits the result is deterministic and batch-invariant by construction.

Token t of request r (q row r * Q_LEN + t) sits at position kv_len - Q_LEN + t and sees the keys
before it and itself (causal), or the keys its row of the request's custom (tree) mask allows
(`[Q_LEN, kv_len]` row-major uint8 block at mask_indptr[r], as in the extend kernel). Sliding window,
logit cap, sinks, LSE output, k_scale / v_scale as in the other kernels; the key tile is
`common.attend_tile`, shared with the extend kernel.

Bounds: kv_indptr is clamped into kv_indices (KEY_OFFSETS); a slot outside [0, slots of k_buf) is
masked out in masked tiles and read as the dummy slot 0 in unmasked ones (SLOT); a mask block that
does not fit inside the mask is not read past its end (MASK). Query rows are r * Q_LEN + t < bs * Q_LEN
= T by construction (checked on the host). Each refusal is recorded in the fault buffer
(`attn_core.ops.device_faults`), once per program, outside the key loops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from attn_core.batching.batch_utils import shared_query_len
from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.forward_mode import ForwardMode
from attn_triton.kernels.common import (
    FAULT_KEY_OFFSETS,
    FAULT_MASK,
    FAULT_SLOT,
    LN2_K,
    LOG2E_K,
    add_sink,
    attend_tile,
    check_query_rows,
    finalize,
    offset_range,
    paged_strides,
    score_scales,
)

#: the most query tokens per request the verify kernel takes (longer ones go to the extend kernel)
MAX_VERIFY_Q_LEN = 16


@dataclass(frozen=True)
class VerifyConfig:
    """Tile sizes: at most `block_m_max` (q head, token) rows per program (a power of two >= 16),
    BLOCK_N keys per step."""

    block_m_max: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def verify_q_len(mode: ForwardMode, batch_size: int, num_tokens: int, max_q_len: int) -> Optional[int]:
    """The q_len every request of the step shares when the step goes to the verify kernel, else None.

    A TARGET_VERIFY or DRAFT_EXTEND step of `batch_size` requests and `num_tokens` query rows whose
    longest request has `max_q_len` tokens, when every request carries the same count
    (`attn_core.batching.batch_utils.shared_query_len`: num_tokens == batch_size * max_q_len, host integers only, no
    device sync; a CUDA-graph batch, every request padded to the captured tokens per request, passes the
    same test) and that count is 1..MAX_VERIFY_Q_LEN.

    >>> verify_q_len(ForwardMode.TARGET_VERIFY, 3, 12, 4)
    4
    >>> verify_q_len(ForwardMode.DRAFT_EXTEND, 3, 10, 4) is None  # lengths 4, 4, 2: not uniform
    True
    >>> verify_q_len(ForwardMode.EXTEND, 3, 12, 4) is None  # not a speculative mode
    True
    >>> verify_q_len(ForwardMode.TARGET_VERIFY, 2, 64, 32) is None  # longer than MAX_VERIFY_Q_LEN
    True
    """
    if not (mode.is_target_verify() or mode.is_draft_extend()):
        return None
    n = shared_query_len(batch_size, num_tokens, longest=max_q_len)
    return n if n is not None and 1 <= n <= MAX_VERIFY_Q_LEN else None


def verify_head_block(group: int, q_len: int, config: VerifyConfig) -> int:
    """q heads per program: as many of the group as fit `block_m_max` rows with q_len tokens each
    (at least one).

    >>> verify_head_block(4, 8, VerifyConfig(block_m_max=64))  # GQA 32/8, 8 drafts: the whole group
    4
    >>> verify_head_block(32, 4, VerifyConfig(block_m_max=64))  # MQA with 32 heads: 16 per program
    16
    >>> verify_head_block(2, 16, VerifyConfig(block_m_max=16))
    1
    """
    return max(1, min(group, config.block_m_max // q_len))


@triton.jit
def _verify_kernel(
    Q,
    K,
    V,
    OUT,
    LSE,
    KV_INDPTR,
    KV_INDICES,
    MASK,
    MASK_INDPTR,
    SINKS,
    FAULT,
    num_indices,
    num_slots,
    mask_size,
    qk_scale,
    cap_scale,
    v_scale,
    window,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    Q_LEN: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
    HAS_SINK: tl.constexpr,
    STORE_LSE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    stride_kp,
    stride_vp,
    PAGE: tl.constexpr,
):
    r = tl.program_id(0)
    hb = tl.program_id(1)
    kv_beg, kv_len, kv_clamped = offset_range(KV_INDPTR, r, num_indices)
    if hb == 0:
        tl.store(FAULT + FAULT_KEY_OFFSETS, 1, mask=kv_clamped)
    kv_head = hb // HEAD_BLOCKS
    rows = tl.arange(0, BLOCK_M)
    hh = rows // Q_LEN
    tok = rows % Q_LEN
    in_group = (hb % HEAD_BLOCKS) * HEADS + hh
    row_ok = (hh < HEADS) & (in_group < GROUP)
    head = kv_head * GROUP + in_group
    q_off = kv_len - Q_LEN  # position of the first new token among the request's keys
    q_pos = q_off + tok
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    t_idx = r.to(tl.int64) * Q_LEN + tok  # the row's token among the step's T query rows
    t_rows = t_idx[:, None]
    q_ptr = Q + t_rows * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    mask_beg = 0
    if USE_MASK:  # the request's [Q_LEN, kv_len] block must lie inside the mask (entries past it are not read)
        mask_beg = tl.load(MASK_INDPTR + r)
        mask_outside = (mask_beg < 0) | (mask_beg + Q_LEN * kv_len.to(tl.int64) > mask_size)
        if hb == 0:
            tl.store(FAULT + FAULT_MASK, 1, mask=mask_outside)
    k_head = K + kv_head * stride_kh
    v_head = V + kv_head * stride_vh

    # key tiles: [lo, full_lo) masked (the window's lower edge), [full_lo, full_hi) seen by every row (no
    # visibility masks), [full_hi, kv_len) masked (the causal diagonal, the tail); a custom mask masks all
    lo = tl.full([], 0, tl.int32)
    all_from = tl.full([], 0, tl.int32)  # the first key every row sees
    if HAS_WINDOW:
        lo = tl.maximum(q_off - window + 1, 0) // BLOCK_N * BLOCK_N
        all_from = tl.maximum(q_off + Q_LEN - window, 0)
    full_lo = tl.cdiv(all_from, BLOCK_N) * BLOCK_N
    full_hi = tl.maximum(q_off + 1, 0) // BLOCK_N * BLOCK_N  # token 0 sees keys 0 .. q_off
    if USE_MASK:
        full_hi = lo
    no_full = full_hi <= full_lo  # no tile every row sees: all masked from lo
    full_lo = tl.where(no_full, lo, full_lo)
    full_hi = tl.where(no_full, lo, full_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    bad_slots = tl.arange(0, BLOCK_N) < 0
    for start in range(lo, full_lo, BLOCK_N):
        acc, m_i, l_i, bad_slots = attend_tile(
            acc,
            m_i,
            l_i,
            q,
            q,
            start,
            kv_len,
            q_pos,
            tok,
            row_ok,
            k_head,
            v_head,
            KV_INDICES,
            kv_beg,
            num_slots,
            FAULT,
            stride_ks,
            stride_vs,
            stride_kp,
            stride_vp,
            MASK,
            mask_beg,
            mask_size,
            bad_slots,
            qk_scale,
            cap_scale,
            window,
            BLOCK_N,
            D,
            BLOCK_D,
            0,
            0,
            DV,
            BLOCK_DV,
            False,
            True,
            CAUSAL,
            USE_MASK,
            HAS_WINDOW,
            LOGIT_CAP,
            DOT_PREC,
            0,
            PAGE,
        )
    for start in range(full_lo, full_hi, BLOCK_N):
        acc, m_i, l_i, bad_slots = attend_tile(
            acc,
            m_i,
            l_i,
            q,
            q,
            start,
            kv_len,
            q_pos,
            tok,
            row_ok,
            k_head,
            v_head,
            KV_INDICES,
            kv_beg,
            num_slots,
            FAULT,
            stride_ks,
            stride_vs,
            stride_kp,
            stride_vp,
            MASK,
            mask_beg,
            mask_size,
            bad_slots,
            qk_scale,
            cap_scale,
            window,
            BLOCK_N,
            D,
            BLOCK_D,
            0,
            0,
            DV,
            BLOCK_DV,
            False,
            False,
            CAUSAL,
            USE_MASK,
            HAS_WINDOW,
            LOGIT_CAP,
            DOT_PREC,
            0,
            PAGE,
        )
    for start in range(full_hi, kv_len, BLOCK_N):
        acc, m_i, l_i, bad_slots = attend_tile(
            acc,
            m_i,
            l_i,
            q,
            q,
            start,
            kv_len,
            q_pos,
            tok,
            row_ok,
            k_head,
            v_head,
            KV_INDICES,
            kv_beg,
            num_slots,
            FAULT,
            stride_ks,
            stride_vs,
            stride_kp,
            stride_vp,
            MASK,
            mask_beg,
            mask_size,
            bad_slots,
            qk_scale,
            cap_scale,
            window,
            BLOCK_N,
            D,
            BLOCK_D,
            0,
            0,
            DV,
            BLOCK_DV,
            False,
            True,
            CAUSAL,
            USE_MASK,
            HAS_WINDOW,
            LOGIT_CAP,
            DOT_PREC,
            0,
            PAGE,
        )

    tl.store(FAULT + FAULT_SLOT + tl.arange(0, BLOCK_N) * 0, 1, mask=bad_slots)  # one address: a flag, no reduction
    if HAS_SINK:
        sink2 = tl.load(SINKS + head, mask=row_ok, other=0.0) * LOG2E_K
        m_i, l_i, acc = add_sink(m_i, l_i, acc, sink2)
    out, lse2 = finalize(m_i, l_i, acc)
    o_ptr = OUT + t_rows * stride_ot + head[:, None] * stride_oh + offs_dv[None, :]
    tl.store(o_ptr, (out * v_scale).to(OUT.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    if STORE_LSE:
        tl.store(LSE + t_idx * stride_lt + head, lse2 * LN2_K, mask=row_ok)


def _pow2(x: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(int(x), 1)))


def verify_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    q_len: int,
    fault: torch.Tensor,
    *,
    sm_scale: float,
    config: VerifyConfig,
    custom_mask: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
    logit_cap: float = 0.0,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
    lse_out: Optional[torch.Tensor] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Attention of `q_len` new tokens per request into `o` (and `lse_out`).

    q `[bs * q_len, Hq, D]` (request r's tokens are rows r * q_len .. r * q_len + q_len - 1); k_buf
    `[slots, Hkv, D]`, v_buf `[slots, Hkv, Dv]`; o `[bs * q_len, Hq, Dv]`; kv_indptr `[>= bs+1]` /
    kv_indices: CSR int32 of each request's keys, its new tokens last (their K/V already written).
    Causal: token t of request r sits at position kv_len - q_len + t. `custom_mask` (uint8, per request
    a row-major `[q_len, kv_len]` block starting at mask_indptr[r], int64) replaces the causal mask.
    lse_out `[bs * q_len, Hq]` float32 natural log; sinks `[Hq]` float32 logits; fault: the int32
    fault buffer (`attn_core.ops.device_faults`). Example: GQA 32/8, 4 drafts, bs 64: q `[256, 32,
    128]`, grid (64, 8), each program a 16-row tile (4 q heads x 4 tokens).
    """
    T, hq, d = q.shape
    if not 1 <= q_len <= MAX_VERIFY_Q_LEN or T % q_len:
        raise InvalidArgumentError("q_len", f"1..{MAX_VERIFY_Q_LEN} dividing the {T} query rows", q_len)
    bs = T // q_len
    if bs == 0:
        return
    use_mask = custom_mask is not None
    check_query_rows(T, bs, kv_indptr, o, lse_out, use_mask, mask_indptr)
    hkv = k_buf.shape[1]
    group = hq // hkv
    heads = verify_head_block(group, q_len, config)
    hblocks = triton.cdiv(group, heads)
    dv = o.shape[2]
    qk_scale, cap_scale = score_scales(sm_scale, logit_cap, k_scale)
    num_slots, page, k_page, k_token = paged_strides(k_buf)
    _, _, v_page, v_token = paged_strides(v_buf)
    _verify_kernel[(bs, hkv * hblocks)](
        q,
        k_buf,
        v_buf,
        o,
        lse_out if lse_out is not None else o,
        kv_indptr,
        kv_indices,
        custom_mask if use_mask else kv_indices,
        mask_indptr if use_mask else kv_indptr,
        sinks if sinks is not None else o,
        fault,
        kv_indices.shape[0],
        num_slots,
        custom_mask.numel() if use_mask else 0,
        qk_scale,
        cap_scale,
        float(v_scale),
        int(window or 0),
        q.stride(0),
        q.stride(1),
        k_token,
        k_buf.stride(1),
        v_token,
        v_buf.stride(1),
        o.stride(0),
        o.stride(1),
        lse_out.stride(0) if lse_out is not None else 0,
        Q_LEN=q_len,
        GROUP=group,
        HEADS=heads,
        HEAD_BLOCKS=hblocks,
        BLOCK_M=_pow2(heads * q_len),
        BLOCK_N=config.block_n,
        D=d,
        BLOCK_D=_pow2(d),
        DV=dv,
        BLOCK_DV=_pow2(dv),
        CAUSAL=not use_mask,
        USE_MASK=use_mask,
        HAS_WINDOW=window is not None,
        LOGIT_CAP=logit_cap > 0,
        HAS_SINK=sinks is not None,
        STORE_LSE=lse_out is not None,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        stride_kp=k_page,
        stride_vp=v_page,
        PAGE=page,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
