"""Extend attention: each request's new tokens attend to its keys in the paged pool.

Covers EXTEND / MIXED / DRAFT_EXTEND (causal: the new token at position p sees keys 0..p, the new
tokens' own K/V having been written to the pool first), TARGET_VERIFY with a per-request custom (tree)
mask, and cross attention (non-causal over the encoder keys). Sliding window, logit cap, sinks and
LSE output are compile-time switches.

Grid `[num_q_heads, m_blocks, bs]`; program (h, mb, r) owns BLOCK_M new tokens of request r for q head h
(m blocks run from the last, the longest under a causal mask, to the first). Keys every row of the block
sees run in an unmasked loop; the rest (the causal diagonal, the window edge, custom masks, the tail)
in a masked loop.

Bounds: qo_indptr is clamped into the step's T tokens (QUERY_ROWS) and kv_indptr into kv_indices
(KEY_OFFSETS); a slot outside [0, slots of k_buf) is masked out in masked tiles and read as the dummy
slot 0 in unmasked ones (SLOT); custom-mask entries outside the mask are not read (those keys stay
hidden; a request whose mask block does not fit is recorded as MASK). Each is recorded in the fault buffer
(`attn_core.ops.device_faults`), so no offset or slot read from the metadata can make the kernel read
or write outside its buffers. No fault is stored inside the key loops (a store there could cost the
loads' software pipelining): slot faults are carried in registers and stored once per program.

`extend_attention` runs this kernel, or, for the launches it takes under `ExtendConfig.wgmma_block_n` (the SM90
default; `hopper_extend`: `uses_wgmma` and buffers its TMA reads), the Hopper kernel `extend_wgmma.py` (same
arguments and faults, plus the pools' TMA descriptors; programs of 128 rows with the q heads of a KV head packed in:
`packed_heads`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from attn_core.contract.errors import InvalidArgumentError
from attn_triton.kernels.common import (
    FAULT_KEY_OFFSETS,
    FAULT_MASK,
    FAULT_QUERY_ROWS,
    FAULT_SLOT,
    LN2_K,
    LOG2E_K,
    add_sink,
    attend_tile,
    check_lazy_rescale,
    check_query_rows,
    finalize,
    hopper_readable,
    key_ranges,
    offset_range,
    paged_strides,
    score_scales,
)


@dataclass(frozen=True)
class ExtendConfig:
    """Tile sizes of the portable kernel: BLOCK_M queries x BLOCK_N keys per step. `lazy_rescale`: 0
    rescales the accumulator on every key tile; K in 1..8 only when some row's max grew by more than K
    (base 2; `common.lazy_softmax_step`).

    `wgmma_block_n` > 0 (64 or 128) runs the launches the Hopper kernel takes (`hopper_extend`;
    `kernels/extend_wgmma.py`, compute capability 9.x only) on it, with tiles of that many keys in
    `wgmma_stages` (>= 3) buffers and `wgmma_regs` registers a thread for each consumer warpgroup (a
    multiple of 8 in 168..240; the producer gets the rest, `extend_wgmma.producer_regs`); the rest keep
    the portable kernel and the tiles above. `wgmma_clean_masked`: the Hopper kernel's producer cleans every
    tile holding keys some query rows do not see (an Inf / NaN value there no longer reaches them: the kit's
    masked-values rule, `extend_wgmma._clean_and_release`); off by default until measured on a GPU."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    lazy_rescale: int = 0
    wgmma_block_n: int = 0
    wgmma_stages: int = 3
    wgmma_regs: int = 224
    wgmma_clean_masked: bool = False

    def __post_init__(self):
        check_lazy_rescale("ExtendConfig.lazy_rescale", self.lazy_rescale)
        if self.wgmma_block_n not in (0, 64, 128):
            raise InvalidArgumentError(
                "ExtendConfig.wgmma_block_n", "0 (portable kernel only), 64 or 128", self.wgmma_block_n
            )
        if self.wgmma_block_n and self.wgmma_stages < 3:
            raise InvalidArgumentError("ExtendConfig.wgmma_stages", ">= 3 K/V buffers", self.wgmma_stages)
        if self.wgmma_regs % 8 or not 168 <= self.wgmma_regs <= 240:
            raise InvalidArgumentError(
                "ExtendConfig.wgmma_regs", "a multiple of 8 in 168..240 (registers a consumer thread)", self.wgmma_regs
            )
        if not isinstance(self.wgmma_clean_masked, bool):
            raise InvalidArgumentError("ExtendConfig.wgmma_clean_masked", "a bool", self.wgmma_clean_masked)


def packed_heads(group: int, rows: int) -> int:
    """q heads of one KV head that the Hopper kernel packs into a program's `rows` query rows (rows / heads
    new tokens each, so every K/V tile it loads serves that many heads): the largest power of two that
    divides the group size, at most `rows`.

    >>> packed_heads(4, 128), packed_heads(1, 128), packed_heads(6, 128), packed_heads(256, 128)
    (4, 1, 2, 128)
    """
    heads = 1
    while group % (heads * 2) == 0 and heads * 2 <= rows:
        heads *= 2
    return heads


def hopper_extend(
    config: ExtendConfig,
    dtype: torch.dtype,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    head_dim: int,
    v_head_dim: int,
    plain: bool,
) -> bool:
    """Whether `extend_attention` runs a launch on the Hopper kernel (`kernels/extend_wgmma.py`): `uses_wgmma`
    says the launch is one it takes, and its TMA reads both buffers (`common.hopper_readable`: attn's NHD pools,
    K|V side by side, page-major buffers with pages of 16 keys or a multiple); otherwise the portable
    kernel runs it (the same results).

    >>> cfg = ExtendConfig(128, 64, 4, 3, wgmma_block_n=64)
    >>> hnd = torch.empty(4, 8, 16, 128, dtype=torch.bfloat16)
    >>> hopper_extend(cfg, torch.bfloat16, hnd, hnd, 128, 128, True)
    True
    >>> hopper_extend(cfg, torch.bfloat16, hnd[:, :, :8], hnd[:, :, :8], 128, 128, True)  # pages of 8
    False
    """
    return (
        uses_wgmma(config, dtype, k_buf.dtype, head_dim, v_head_dim, plain)
        and hopper_readable(k_buf)
        and hopper_readable(v_buf)
    )


def uses_wgmma(
    config: ExtendConfig, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, v_head_dim: int, plain: bool
) -> bool:
    """Whether a launch runs the Hopper kernel (`kernels/extend_wgmma.py`): the config asks for it, q and
    the cache are the same 16-bit type, head_dim = v_head_dim is 64 or 128, and the launch is `plain`
    (no custom mask, no rope split, K and V separate). fp8 caches, float32, other widths, tree masks and
    absorbed MLA keep the portable kernel.

    >>> cfg = ExtendConfig(128, 64, 4, 3, wgmma_block_n=64)
    >>> uses_wgmma(cfg, torch.bfloat16, torch.bfloat16, 128, 128, True)
    True
    >>> uses_wgmma(cfg, torch.bfloat16, torch.float8_e4m3fn, 128, 128, True)
    False
    >>> uses_wgmma(cfg, torch.bfloat16, torch.bfloat16, 256, 256, True)
    False
    >>> uses_wgmma(ExtendConfig(), torch.bfloat16, torch.bfloat16, 128, 128, True)
    False
    """
    return (
        config.wgmma_block_n > 0
        and dtype in (torch.bfloat16, torch.float16)
        and kv_dtype == dtype
        and head_dim == v_head_dim
        and head_dim in (64, 128)
        and plain
    )


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
    LAZY: tl.constexpr,
    SPANS,
    HAS_SPAN: tl.constexpr,
    stride_kp,
    stride_vp,
    PAGE: tl.constexpr,
):
    h = tl.program_id(0)
    mb = tl.num_programs(1) - 1 - tl.program_id(1)
    r = tl.program_id(2)
    q_beg, q_len, q_clamped = offset_range(QO_INDPTR, r, num_tokens)
    kv_beg, kv_len, kv_clamped = offset_range(KV_INDPTR, r, num_indices)
    if (h == 0) & (tl.program_id(1) == 0):
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
        if (h == 0) & (tl.program_id(1) == 0):
            tl.store(FAULT + FAULT_MASK, 1, mask=mask_outside)
    k_head = K + kv_head * stride_kh
    v_head = V + kv_head * stride_vh

    lo, full_end, hi = key_ranges(kv_len, q_off, mb * BLOCK_M, BLOCK_M, window, BLOCK_N, CAUSAL, HAS_WINDOW, USE_MASK)
    if (
        HAS_SPAN
    ):  # bidirectional span [a, b) of the request: its queries see keys up to b - 1 (attn_core.contract.bidirectional)
        span_a = tl.load(SPANS + 2 * r)
        span_b = tl.load(SPANS + 2 * r + 1)
        in_span = (q_pos >= span_a) & (q_pos < span_b)
        q_pos = tl.where(in_span, span_b - 1, q_pos)  # the causal limit of each row (no window with spans)
        hi = tl.minimum(kv_len, tl.maximum(hi, tl.max(tl.where(in_span & m_ok, span_b, 0), 0)))

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    bad_slots = tl.arange(0, BLOCK_N) < 0
    for start in range(lo, full_end, BLOCK_N):
        acc, m_i, l_i, bad_slots = attend_tile(
            acc,
            m_i,
            l_i,
            q,
            q_pe,
            start,
            kv_len,
            q_pos,
            offs_m,
            m_ok,
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
            DPE,
            BLOCK_DPE,
            DV,
            BLOCK_DV,
            SHARE_KV,
            False,
            CAUSAL,
            USE_MASK,
            HAS_WINDOW,
            LOGIT_CAP,
            DOT_PREC,
            LAZY,
            PAGE,
        )
    for start in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i, bad_slots = attend_tile(
            acc,
            m_i,
            l_i,
            q,
            q_pe,
            start,
            kv_len,
            q_pos,
            offs_m,
            m_ok,
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
            DPE,
            BLOCK_DPE,
            DV,
            BLOCK_DV,
            SHARE_KV,
            True,
            CAUSAL,
            USE_MASK,
            HAS_WINDOW,
            LOGIT_CAP,
            DOT_PREC,
            LAZY,
            PAGE,
        )

    tl.store(FAULT + FAULT_SLOT + tl.arange(0, BLOCK_N) * 0, 1, mask=bad_slots)  # one address: a flag, no reduction
    if HAS_SINK:
        sink2 = tl.load(SINKS + h) * LOG2E_K
        m_i, l_i, acc = add_sink(m_i, l_i, acc, tl.zeros([BLOCK_M], dtype=tl.float32) + sink2)
    out, lse2 = finalize(m_i, l_i, acc)
    o_rows = OUT + (q_beg + offs_m).to(tl.int64)[:, None] * stride_ot + h * stride_oh
    tl.store(
        o_rows + offs_dv[None, :],
        (out * v_scale).to(OUT.dtype.element_ty),
        mask=m_ok[:, None] & (offs_dv[None, :] < DV),
    )
    if STORE_LSE:
        tl.store(LSE + (q_beg + offs_m).to(tl.int64) * stride_lt + h, lse2 * LN2_K, mask=m_ok)


def _pow2(x: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(int(x), 1)))


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
    spans: Optional[torch.Tensor] = None,
) -> None:
    """Attention of every request's new tokens into `o` (and `lse_out`).

    q `[T, Hq, D]` (request r's rows qo_indptr[r] .. qo_indptr[r+1]-1); k_buf `[slots, Hkv, D]`, v_buf
    `[slots, Hkv, Dv]` (ignored with `share_kv`: V = first Dv channels of K, absorbed MLA); o `[T, Hq, Dv]`;
    kv_indptr / kv_indices: CSR int32 of each request's keys, the new tokens last (self attention).
    Causal: the new token i of request r sits at position kv_len - q_len + i. `custom_mask` (uint8, per
    request a row-major `[q_len, kv_len]` block starting at mask_indptr[r]) replaces the causal mask.
    lse_out `[T, Hq]` float32 natural log. `max_q_len` (host int) sizes the grid. fault: the int32
    fault buffer (`attn_core.ops.device_faults`). `spans` (int32 `[bs, 2]`, causal launches without a
    window): request r's queries at positions in [a, b) also see the keys up to b - 1
    (`attn_core.contract.bidirectional`).
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
    plain = not use_mask and d_rope == 0 and not share_kv and spans is None
    num_slots, page, k_page, k_token = paged_strides(k_buf)
    _, _, v_page, v_token = paged_strides(v)
    if hopper_extend(config, q.dtype, k_buf, v, d, dv, plain):
        # Gluon: imported only where it runs
        from attn_triton.kernels.extend_wgmma import (
            TMA_BOX,
            WGMMA_BLOCK_M,
            extend_wgmma_kernel,
            kv_descriptors,
            producer_regs,
        )

        heads = packed_heads(hq // hkv, WGMMA_BLOCK_M)
        tokens, grid_h, kernel = WGMMA_BLOCK_M // heads, hq // heads, extend_wgmma_kernel
        k_desc, v_desc, rows = kv_descriptors(k_buf, v)
        # num_warps: the default partition's (the kernel's worker partitions add 8)
        options = dict(
            BLOCK_M=WGMMA_BLOCK_M,
            BLOCK_N=config.wgmma_block_n,
            STAGES=config.wgmma_stages,
            HEADS=heads,
            LAZY=0,
            num_warps=4,
            K_DESC=k_desc,
            V_DESC=v_desc,
            BOX=TMA_BOX,
            CONSUMER_REGS=config.wgmma_regs,
            PRODUCER_REGS=producer_regs(config.wgmma_regs),
            CLEAN=config.wgmma_clean_masked,
            PAGE=page,
            stride_kp=k_page,
            stride_vp=v_page,
            **rows,  # rows_kp, rows_kh, cols_kh and V's: the buffers' rows in their descriptors
        )
    else:
        tokens, grid_h, kernel = config.block_m, hq, _extend_kernel
        options = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, LAZY=config.lazy_rescale)
        options.update(PAGE=page, stride_kp=k_page, stride_vp=v_page)  # K/V addressing (`common.paged_strides`)
        options.update(num_warps=config.num_warps, num_stages=config.num_stages)
        options.update(SPANS=spans if spans is not None else qo_indptr, HAS_SPAN=spans is not None)
    grid = (grid_h, triton.cdiv(max_q_len, tokens), bs)
    kernel[grid](
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
        T,
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
        v.stride(1),
        o.stride(0),
        o.stride(1),
        lse_out.stride(0) if lse_out is not None else 0,
        GROUP=hq // hkv,
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
        **options,
    )
