"""Extend attention: each request's new tokens attend to its keys in the paged pool.

Covers EXTEND / MIXED / DRAFT_EXTEND (causal: the new token at position p sees keys 0..p, the new
tokens' own K/V having been written to the pool first), TARGET_VERIFY with a per-request custom (tree)
mask, and cross attention (non-causal over the encoder keys). Sliding window, logit cap, sinks and
LSE output are compile-time switches.

Grid `[num_q_heads, m_blocks, bs]` (`[num_q_heads, bs, m_blocks]` with `ExtendConfig.longest_first`); program
(h, mb, r) owns BLOCK_M new tokens of request r for q head h (m blocks run from the last, the longest under a
causal mask, to the first). Keys every row of the block
sees run in an unmasked loop; the rest (the causal diagonal, the window edge, custom masks, the tail)
in a masked loop. With `ExtendConfig.page_tma` (where `tma_page` allows it) the unmasked loop loads
whole pages of K/V through TMA tensor descriptors made on the host once per launch (`page_descriptor`),
one kv_indices entry read per page, stacked into one tile (`load_pages`) or, with `page_dots`, each
through its own dots (`attend_pages`); the masked loop always gathers row by row.

Bounds: qo_indptr is clamped into the step's T tokens (QUERY_ROWS) and kv_indptr into kv_indices
(KEY_OFFSETS); a slot outside [0, slots of k_buf) is masked out in masked tiles and read as the dummy
slot 0 in unmasked ones (SLOT); custom-mask entries outside the mask are not read (those keys stay
hidden; a request whose mask block does not fit is recorded as MASK); on the TMA path a page whose
first slot is not a multiple of the page size or whose page is not inside the pool is read as the dummy
page 0 and recorded as SLOT (`page_row`). Each is recorded in the fault buffer
(`attn_core.ops.device_faults`), so no offset or slot read from the metadata can make the kernel read
or write outside its buffers. No fault is stored inside the key loops (a store there could cost the
loads' software pipelining): slot faults are carried in registers and stored once per program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from attn_triton.kernels.common import (
    FAULT_KEY_OFFSETS,
    FAULT_MASK,
    FAULT_QUERY_ROWS,
    FAULT_SLOT,
    LN2_K,
    LOG2E_K,
    add_sink,
    attend_pages,
    attend_tile,
    check_query_rows,
    finalize,
    offset_range,
    score_scales,
)


@dataclass(frozen=True)
class ExtendConfig:
    """Tile sizes: BLOCK_M queries x BLOCK_N keys per step.

    `page_tma`: the unmasked key tiles come in page by page through TMA tensor descriptors (`tma_page`
    says where that applies: a page pool of >= 16 slots a page, BLOCK_N 1, 2 or 4 pages, K/V in q's dtype
    with power-of-two head dims, Hopper or later); elsewhere the kernel gathers key rows through kv_indices.
    The pages of a tile are stacked into one `[BLOCK_N, D]` tile for the two dots (`load_pages`), or with
    `page_dots` each page goes through its own score and P·V dots (`attend_pages`: no stacking, smaller
    score dots). `page_dots` without `page_tma` changes nothing.
    `longest_first`: the grid runs the m blocks outermost (`[Hq, bs, m_blocks]`), so the last block of every
    request (under a causal mask the longest key range) starts before any request's shorter ones; by
    default the grid is `[Hq, m_blocks, bs]`, longest first within each request.
    """

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    page_tma: bool = False
    page_dots: bool = False
    longest_first: bool = False


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    OUT,
    LSE,
    QO_INDPTR,
    KV_INDPTR,
    KV_INDICES,
    MASK,
    MASK_INDPTR,
    SINKS,
    FAULT,
    K_DESC,
    V_DESC,
    num_tokens,
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
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DPE: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SHARE_KV: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
    HAS_SINK: tl.constexpr,
    STORE_LSE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PAGE: tl.constexpr,
    PAGE_DOTS: tl.constexpr,
    BLOCKS_OUTER: tl.constexpr,
):
    h = tl.program_id(0)
    if BLOCKS_OUTER:  # grid [Hq, bs, m_blocks]: every request's last block first
        r = tl.program_id(1)
        first = tl.program_id(2) == 0
        mb = tl.num_programs(2) - 1 - tl.program_id(2)
    else:
        first = tl.program_id(1) == 0
        mb = tl.num_programs(1) - 1 - tl.program_id(1)
        r = tl.program_id(2)
    q_beg, q_len, q_clamped = offset_range(QO_INDPTR, r, num_tokens)
    kv_beg, kv_len, kv_clamped = offset_range(KV_INDPTR, r, num_indices)
    if (h == 0) & first:
        tl.store(FAULT + FAULT_QUERY_ROWS, 1, mask=q_clamped)
        tl.store(FAULT + FAULT_KEY_OFFSETS, 1, mask=kv_clamped)
    if mb * BLOCK_M >= q_len:
        return
    q_off = kv_len - q_len  # position of the first new token among the request's keys
    kv_head = h // GROUP

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < q_len
    q_pos = q_off + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = Q + (q_beg + offs_m).to(tl.int64)[:, None] * stride_qt + h * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=m_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    q_pe = q
    if BLOCK_DPE > 0:
        offs_dpe = tl.arange(0, BLOCK_DPE)
        q_pe = tl.load(q_rows + D + offs_dpe[None, :], mask=m_ok[:, None] & (offs_dpe[None, :] < DPE), other=0.0)
    mask_beg = 0
    if USE_MASK:  # the request's [q_len, kv_len] block must lie inside the mask (entries past it are not read)
        mask_beg = tl.load(MASK_INDPTR + r)
        mask_outside = (mask_beg < 0) | (mask_beg + q_len.to(tl.int64) * kv_len > mask_size)
        if (h == 0) & first:
            tl.store(FAULT + FAULT_MASK, 1, mask=mask_outside)
    k_head = K + kv_head * stride_kh
    v_head = V + kv_head * stride_vh

    # key ranges: [lo, full_end) seen by every row without masks, [full_end, hi) masked
    if CAUSAL:
        hi = tl.minimum(kv_len, q_off + (mb + 1) * BLOCK_M)
        full_end = q_off + mb * BLOCK_M
    else:
        hi = kv_len
        full_end = kv_len
    lo = tl.full([], 0, tl.int32)
    if HAS_WINDOW:
        lo = tl.maximum(q_off + mb * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
        full_end = lo
    if USE_MASK:
        full_end = lo
    full_end = tl.maximum(full_end // BLOCK_N * BLOCK_N, lo)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    bad_slots = tl.arange(0, BLOCK_N) < 0
    for start in range(lo, full_end, BLOCK_N):
        if PAGE_DOTS:
            acc, m_i, l_i, bad_slots = attend_pages(
                acc, m_i, l_i, q, kv_beg + start, kv_head, K_DESC, V_DESC, KV_INDICES, num_slots, bad_slots, qk_scale, cap_scale,
                D, DV, PAGE, BLOCK_N // PAGE, LOGIT_CAP, DOT_PREC,
            )  # fmt: skip
        else:
            acc, m_i, l_i, bad_slots = attend_tile(
                acc, m_i, l_i, q, q_pe, start, kv_len, q_pos, offs_m, m_ok, k_head, v_head, KV_INDICES, kv_beg, num_slots, FAULT,
                stride_ks, stride_vs, MASK, mask_beg, mask_size, bad_slots, qk_scale, cap_scale, window,
                BLOCK_N, D, BLOCK_D, DPE, BLOCK_DPE, DV, BLOCK_DV, SHARE_KV, False, CAUSAL, USE_MASK, HAS_WINDOW, LOGIT_CAP, DOT_PREC,
                K_DESC, V_DESC, kv_head, PAGE,
            )  # fmt: skip
    for start in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i, bad_slots = attend_tile(
            acc, m_i, l_i, q, q_pe, start, kv_len, q_pos, offs_m, m_ok, k_head, v_head, KV_INDICES, kv_beg, num_slots, FAULT,
            stride_ks, stride_vs, MASK, mask_beg, mask_size, bad_slots, qk_scale, cap_scale, window,
            BLOCK_N, D, BLOCK_D, DPE, BLOCK_DPE, DV, BLOCK_DV, SHARE_KV, True, CAUSAL, USE_MASK, HAS_WINDOW, LOGIT_CAP, DOT_PREC,
        )  # fmt: skip

    tl.store(FAULT + FAULT_SLOT + tl.arange(0, BLOCK_N) * 0, 1, mask=bad_slots)  # one address: a flag, no reduction
    if HAS_SINK:
        sink2 = tl.load(SINKS + h) * LOG2E_K
        m_i, l_i, acc = add_sink(m_i, l_i, acc, tl.zeros([BLOCK_M], dtype=tl.float32) + sink2)
    out, lse2 = finalize(m_i, l_i, acc)
    o_rows = OUT + (q_beg + offs_m).to(tl.int64)[:, None] * stride_ot + h * stride_oh
    tl.store(o_rows + offs_dv[None, :], (out * v_scale).to(OUT.dtype.element_ty), mask=m_ok[:, None] & (offs_dv[None, :] < DV))
    if STORE_LSE:
        tl.store(LSE + (q_beg + offs_m).to(tl.int64) * stride_lt + h, lse2 * LN2_K, mask=m_ok)


def _pow2(x: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(int(x), 1)))


#: pages per key tile the TMA path stacks (`load_pages`)
TMA_PAGES_PER_TILE = (1, 2, 4)


def tma_page(
    config: ExtendConfig, page_size: int, q: torch.Tensor, k_buf: torch.Tensor, v: torch.Tensor, d_rope: int, share_kv: bool
) -> int:
    """The page size the extend kernel loads whole pages of by TMA (`ExtendConfig.page_tma`), or 0 for
    the row gather. It applies when the config asks for it, the keys lie page by page in a pool of
    `page_size` >= 16 slots a page, BLOCK_N is 1, 2 or 4 pages, K and V (not shared, no rope part) hold
    q's dtype (fp16, bf16 or fp32) with power-of-two head dims <= 256, each slot's heads contiguous (a 2-D view
    `[slots, heads x D]` of 16-byte-aligned rows), and the device is a CPU (interpreter) or a GPU of
    compute capability >= 9 (TMA; not ROCm).
    Example: `ExtendConfig(128, 64, 8, 3, page_tma=True)`, page_size 16, bf16 `[slots, 8, 128]` K/V on an
    H100 → 16; the same with page_size 1 → 0."""
    if not config.page_tma or page_size < 16 or config.block_n % page_size or config.block_n // page_size not in TMA_PAGES_PER_TILE:
        return 0
    if d_rope or share_kv or q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k_buf.dtype != q.dtype or v.dtype != q.dtype:
        return 0
    for buf in (k_buf, v):
        d = buf.shape[2]
        rows_ok = buf.stride(2) == 1 and buf.stride(1) == d and buf.stride(0) * buf.element_size() % 16 == 0
        if d != _pow2(d) or d > 256 or not rows_ok or buf.data_ptr() % 16:
            return 0
    if q.is_cuda and (torch.version.hip or torch.cuda.get_device_capability(q.device)[0] < 9):
        return 0
    return page_size


def page_descriptor(buf: torch.Tensor, page_size: int) -> TensorDescriptor:
    """A TMA descriptor of the pool buffer `[slots, heads, D]` as the 2-D `[slots, heads x D]` with a
    `[page_size, D]` box: one page of one head. Example: bf16 `[1024, 8, 128]`, page 16 → shape
    `[1024, 1024]`, strides `[1024, 1]`, box `[16, 128]`."""
    slots, heads, d = buf.shape
    return TensorDescriptor(buf, [slots, heads * d], [buf.stride(0), 1], [page_size, d])


def extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    o: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    max_q_len: int,
    fault: torch.Tensor,
    *,
    sm_scale: float,
    config: ExtendConfig,
    causal: bool = True,
    custom_mask: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
    logit_cap: float = 0.0,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
    lse_out: Optional[torch.Tensor] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    d_rope: int = 0,
    share_kv: bool = False,
    page_size: int = 1,
) -> None:
    """Attention of every request's new tokens into `o` (and `lse_out`).

    q `[T, Hq, D]` (request r's rows qo_indptr[r] .. qo_indptr[r+1]-1); k_buf `[slots, Hkv, D]`, v_buf
    `[slots, Hkv, Dv]` (ignored with `share_kv`: V = first Dv channels of K, absorbed MLA); o `[T, Hq, Dv]`;
    kv_indptr / kv_indices: CSR int32 of each request's keys, the new tokens last (self attention).
    Causal: the new token i of request r sits at position kv_len - q_len + i. `custom_mask` (uint8, per
    request a row-major `[q_len, kv_len]` block starting at mask_indptr[r]) replaces the causal mask.
    lse_out `[T, Hq]` float32 natural log. `max_q_len` (host int) sizes the grid. fault: the int32
    fault buffer (`attn_core.ops.device_faults`). `page_size` > 1 promises that every request's keys lie
    page by page (key i at page offset i % page_size of pages of that many slots), which lets
    `config.page_tma` load whole pages (`tma_page`); 1 promises nothing.
    """
    T, hq, d_total = q.shape
    bs = qo_indptr.shape[0] - 1
    if T == 0 or bs == 0 or max_q_len == 0:
        return
    use_mask = custom_mask is not None
    check_query_rows(T, bs, kv_indptr, o, lse_out, use_mask, mask_indptr)
    hkv = k_buf.shape[1]
    d = d_total - d_rope
    dv = o.shape[2]
    qk_scale, cap_scale = score_scales(sm_scale, logit_cap, k_scale)
    v = k_buf if share_kv else v_buf
    # a window or a custom mask leaves no unmasked tile: nothing for the page path to load
    page = tma_page(config, page_size, q, k_buf, v, d_rope, share_kv) if window is None and not use_mask else 0
    m_blocks = triton.cdiv(max_q_len, config.block_m)
    grid = (hq, bs, m_blocks) if config.longest_first else (hq, m_blocks, bs)
    _extend_kernel[grid](
        q,
        k_buf,
        v,
        o,
        lse_out if lse_out is not None else o,
        qo_indptr,
        kv_indptr,
        kv_indices,
        custom_mask if use_mask else kv_indices,
        mask_indptr if use_mask else kv_indptr,
        sinks if sinks is not None else o,
        fault,
        page_descriptor(k_buf, page) if page else None,
        page_descriptor(v, page) if page else None,
        T,
        kv_indices.shape[0],
        k_buf.shape[0],
        custom_mask.numel() if use_mask else 0,
        qk_scale,
        cap_scale,
        float(v_scale),
        int(window or 0),
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v.stride(0),
        v.stride(1),
        o.stride(0),
        o.stride(1),
        lse_out.stride(0) if lse_out is not None else 0,
        GROUP=hq // hkv,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        D=d,
        BLOCK_D=_pow2(d),
        DPE=d_rope,
        BLOCK_DPE=_pow2(d_rope) if d_rope else 0,
        DV=dv,
        BLOCK_DV=_pow2(d) if share_kv else _pow2(dv),
        SHARE_KV=share_kv,
        CAUSAL=causal and not use_mask,
        USE_MASK=use_mask,
        HAS_WINDOW=window is not None,
        LOGIT_CAP=logit_cap > 0,
        HAS_SINK=sinks is not None,
        STORE_LSE=lse_out is not None,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        PAGE=page,
        PAGE_DOTS=bool(page) and config.page_dots,
        BLOCKS_OUTER=config.longest_first,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
