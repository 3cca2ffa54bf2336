"""Pieces shared by the decode, extend and verify kernels: score transform, online-softmax step,
finalize, one key tile of the extend/verify loops, the bounds of CSR offsets and the fault-buffer
entries (`attn_core.ops.device_faults`).

All softmax arithmetic runs in the base-2 domain (`exp2`/`log2`, logits pre-multiplied by log2(e));
LSEs leave the kernels in natural log. Host-side scale factors come from `score_scales`.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from attn_core.contract.errors import InvalidArgumentError
from attn_core.ops.device_faults import DeviceFaultKind
from attn_core.ops.masked_values_triton import finite_values  # noqa: F401  (re-exported for the kernels)

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
#: the same constants for use inside kernels (Triton only reads constexpr globals)
LOG2E_K = tl.constexpr(LOG2E)
LN2_K = tl.constexpr(LN2)
#: fault-buffer entries the attention kernels record
FAULT_SLOT = tl.constexpr(int(DeviceFaultKind.SLOT))
FAULT_KEY_OFFSETS = tl.constexpr(int(DeviceFaultKind.KEY_OFFSETS))
FAULT_QUERY_ROWS = tl.constexpr(int(DeviceFaultKind.QUERY_ROWS))
FAULT_MASK = tl.constexpr(int(DeviceFaultKind.MASK))


def check_query_rows(
    T: int,
    bs: int,
    kv_indptr: torch.Tensor,
    o: torch.Tensor,
    lse_out: Optional[torch.Tensor],
    use_mask: bool,
    mask_indptr: Optional[torch.Tensor],
) -> None:
    """Host checks (shapes only) of an extend-like launch over `bs` requests and `T` query rows: kv_indptr
    holds >= bs + 1 offsets, o and lse_out hold T rows, a custom mask comes with >= bs mask offsets.
    Raises `InvalidArgumentError` naming the argument. Example: T 12, bs 3, kv_indptr of 4 entries, o
    `[12, H, D]`, no mask: passes; kv_indptr of 3 entries: raises (kv_indptr/o/lse_out)."""
    if kv_indptr.shape[0] < bs + 1 or o.shape[0] != T or (lse_out is not None and lse_out.shape[0] != T):
        raise InvalidArgumentError(
            "kv_indptr/o/lse_out", f"{bs + 1} key offsets and {T} output rows", (kv_indptr.shape[0], o.shape[0])
        )
    if use_mask and (mask_indptr is None or mask_indptr.shape[0] < bs):
        found = None if mask_indptr is None else tuple(mask_indptr.shape)
        raise InvalidArgumentError("mask_indptr", f"at least {bs} offsets with a custom mask", found)


#: largest lazy-rescale slack (`lazy_softmax_step`): p <= 2^8 stays exact enough in an fp16 / bf16 P operand
MAX_LAZY_SLACK = 8


def tma_compatible(buf: torch.Tensor) -> bool:
    """Whether a pool `[slots, ...]` can be read by TMA as `[slots, tma_row_span(buf)]` (the Hopper kernels'
    descriptors, `extend_wgmma.kv_descriptors`, `mla_wgmma.latent_descriptors`): the last dimension
    contiguous, each dimension between at a 16-byte aligned stride no smaller than what it holds (heads may
    sit apart, as in K and V side by side), slots not overlapping, the base and the slot stride 16-byte
    aligned. Pools as attn-core allocates them are, and vLLM's K|V-side-by-side caches; a pool that is not
    keeps the portable kernels.

    >>> tma_compatible(torch.empty(64, 8, 128, dtype=torch.bfloat16))  # K / V: [slots, Hkv, D]
    True
    >>> tma_compatible(torch.empty(64, 1, 576, dtype=torch.bfloat16))  # an MLA latent pool
    True
    >>> tma_compatible(torch.empty(64, 8, 256, dtype=torch.bfloat16)[:, :, :128])  # heads 256 apart
    True
    >>> tma_compatible(torch.empty(64, 8, 132, dtype=torch.bfloat16)[:, :, :128])  # 264-byte head stride
    False
    >>> tma_compatible(torch.empty(64, 128, 8, dtype=torch.bfloat16).transpose(1, 2))  # channels strided
    False
    """
    return tma_row_span(buf) is not None


def tma_row_span(buf: torch.Tensor) -> Optional[int]:
    """Elements from a slot's first to its last element + 1 when `tma_compatible(buf)`, else None: the row
    width of the pool's TMA descriptor. Example: `[64, 8, 128]` -> 1024; `[64, 8, 256][:, :, :128]` (heads
    256 apart) -> 7 * 256 + 128 = 1920."""
    if buf.dim() < 2:
        return None
    esz, span = buf.element_size(), 1
    for i in range(buf.dim() - 1, 0, -1):
        if buf.shape[i] == 1:
            continue
        if i == buf.dim() - 1:
            if buf.stride(i) != 1:
                return None
            span = buf.shape[i]
        elif buf.stride(i) < span or buf.stride(i) * esz % 16:
            return None
        else:
            span += (buf.shape[i] - 1) * buf.stride(i)
    aligned = buf.stride(0) * esz % 16 == 0 and buf.data_ptr() % 16 == 0
    return span if buf.stride(0) >= span and aligned else None


#: keys one TMA copy of the Hopper kernels brings (`extend_wgmma._tma_tile`): a run of contiguous slots
TMA_BOX = 16


class PageGeometry(NamedTuple):
    """A page-major K/V buffer as the rows of a TMA descriptor (`tma_page_geometry`): `rows` x `width` elements,
    row stride the buffer's token stride; key (slot s, KV head h) starts at row (s // page_size) * rows_page +
    h * rows_head + s % page_size, column h * cols_head."""

    rows: int
    width: int
    rows_page: int
    rows_head: int
    cols_head: int


def tma_page_geometry(buf: torch.Tensor, box: int = TMA_BOX) -> Optional[PageGeometry]:
    """A page-major buffer `[pages, Hkv, page_size, D]` (attn's HND pools, engine caches read through their
    strides) as rows that TMA can read (`PageGeometry`), or None: the row stride is the token stride
    `stride(2)`, and a KV head sits either whole rows apart (HND: its head stride a multiple of the token
    stride, its page's rows not reaching the next head's) or within the row (a page of tokens with every head
    side by side, FlashInfer's / FlashAttention's paged layout: head stride at least D and 16-byte aligned, the
    heads within one token stride); D contiguous, the token stride 16-byte aligned and at least a row's width,
    pages not overlapping, `page_size` a multiple of `box` (a box of contiguous slots never crosses a page),
    a 16-byte aligned base.

    >>> tma_page_geometry(torch.empty(6, 8, 16, 128, dtype=torch.bfloat16))  # contiguous HND
    PageGeometry(rows=768, width=128, rows_page=128, rows_head=16, cols_head=0)
    >>> tma_page_geometry(torch.empty(6, 2, 8, 16, 128, dtype=torch.bfloat16)[:, 0])  # K of [pages, 2, H, P, D]
    PageGeometry(rows=1408, width=128, rows_page=256, rows_head=16, cols_head=0)
    >>> tma_page_geometry(torch.empty(6, 2, 16, 8, 128, dtype=torch.bfloat16)[:, 0].transpose(1, 2))  # [.., P, H, D]
    PageGeometry(rows=176, width=1024, rows_page=32, rows_head=0, cols_head=128)
    >>> tma_page_geometry(torch.empty(6, 8, 8, 128, dtype=torch.bfloat16)) is None  # pages of 8 < a box
    True
    >>> tma_page_geometry(torch.empty(64, 8, 128, dtype=torch.bfloat16)) is None  # NHD: `tma_row_span`
    True
    """
    if buf.dim() != 4 or buf.shape[2] <= 1:
        return None
    pages, heads, page, d = buf.shape
    s_page, s_head, s_tok, s_ch = buf.stride()
    esz = buf.element_size()
    if s_ch != 1 or s_tok < d or s_tok * esz % 16 or page % box or buf.data_ptr() % 16 or s_page % s_tok:
        return None
    if heads == 1:
        rows_head, cols_head, width = 0, 0, d
    elif s_head % s_tok == 0 and s_head // s_tok >= page:  # heads whole pages of rows apart
        rows_head, cols_head, width = s_head // s_tok, 0, d
    elif d <= s_head and s_head * esz % 16 == 0 and (heads - 1) * s_head + d <= s_tok:  # heads side by side in a row
        rows_head, cols_head, width = 0, s_head, (heads - 1) * s_head + d
    else:
        return None
    rows_page = s_page // s_tok
    if pages > 1 and rows_page < (heads - 1) * rows_head + page:  # a page's rows reaching into the next page's
        return None
    rows = (pages - 1) * rows_page + (heads - 1) * rows_head + page
    return PageGeometry(rows, width, rows_page, rows_head, cols_head)


def hopper_readable(buf: torch.Tensor) -> bool:
    """Whether the Hopper kernels' TMA reads a K/V buffer: an NHD pool `[slots, ...]` (`tma_compatible`) or a
    page-major one (`tma_page_geometry`). Example: `[64, 8, 128]` and `[6, 8, 16, 128]` bf16 -> True."""
    if buf.dim() == 4 and buf.shape[2] > 1:
        return tma_page_geometry(buf) is not None
    return tma_compatible(buf)


def paged_strides(buf: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_slots, PAGE, page stride, token stride) of a K/V buffer as the kernels address it (`kv_rows`),
    the head stride being `buf.stride(1)` in both layouts: attn's NHD `[slots, Hkv, D]` (any strides) gives
    (slots, 1, stride(0), stride(0)), one run of slots; an HND `[pages, Hkv, page_size, D]` buffer (attn's
    HND pools, engine-owned caches read through any strides) gives (pages * page_size, page_size, stride(0),
    stride(2)). Example: a contiguous `[6, 2, 4, 8]` HND buffer -> (24, 4, 64, 8)."""
    if buf.dim() == 4 and buf.shape[2] > 1:
        return buf.shape[0] * buf.shape[2], buf.shape[2], buf.stride(0), buf.stride(2)
    return buf.shape[0], 1, buf.stride(0), buf.stride(0)  # one slot per page: the page stride is the slot stride


@triton.jit
def kv_rows(slot, PAGE: tl.constexpr, stride_page, stride_token):
    """Element offset of each slot's row (head 0) in a K/V buffer: slot * stride_token for a buffer of one
    run of slots (PAGE 1), else (slot // PAGE) * stride_page + (slot % PAGE) * stride_token (page-major
    buffers, `paged_strides`). Example: PAGE 4, strides 64 / 8: slot 9 -> 2 * 64 + 1 * 8 = 136.
    A slot that is read lies in [0, num_slots), below 2**31: page and offset come from its low 32 bits,
    unsigned (a shift and a mask for a power-of-two PAGE), each then one widening multiply (a slot outside
    the pool gives some offset, which the caller's mask keeps from being read)."""
    if PAGE == 1:
        return slot * stride_token
    u = slot.to(tl.int32).to(tl.uint32, bitcast=True)
    page = (u // PAGE).to(tl.int32, bitcast=True)
    tok = (u % PAGE).to(tl.int32, bitcast=True)
    return page.to(tl.int64) * stride_page + tok.to(tl.int64) * stride_token


def check_lazy_rescale(name: str, slack: int) -> None:
    """Refuse a kernel config's lazy-rescale slack outside 0 (rescale every tile) .. MAX_LAZY_SLACK, naming
    the field `name`. Example: `check_lazy_rescale("ExtendConfig.lazy_rescale", 9)` raises
    InvalidArgumentError; slack 4 passes."""
    if not 0 <= slack <= MAX_LAZY_SLACK:
        raise InvalidArgumentError(name, f"0 (always rescale) or a slack of 1..{MAX_LAZY_SLACK} (log2 units)", slack)


def score_scales(sm_scale: float, logit_cap: float, k_scale: float = 1.0) -> tuple[float, float]:
    """(qk_scale, cap_scale): without a cap, logits2 = qk·sm_scale·k_scale·log2e; with a cap c,
    logits2 = c·tanh(qk·sm_scale·k_scale / c)·log2e (`scale_scores`). The product must be > 0."""
    s = sm_scale * k_scale
    if not s > 0:
        raise InvalidArgumentError("layer.scaling * k_scale", "> 0", s)
    if logit_cap > 0:
        return s / logit_cap, logit_cap * LOG2E
    return s * LOG2E, 0.0


@triton.jit
def scale_scores(qk, qk_scale, cap_scale, LOGIT_CAP: tl.constexpr):
    """Raw q·k under a logit cap to base-2 logits (see `score_scales`); tanh is written with exp so
    the interpreter runs it. Without a cap the kernels keep raw scores and fold qk_scale into
    `softmax_step` (one FMA per score)."""
    x = qk * qk_scale
    t = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
    return t * cap_scale


@triton.jit
def tile_logits(qk, qk_scale, cap_scale, LOGIT_CAP: tl.constexpr):
    """A tile's raw q·k `[M, N]` as what `softmax_step` takes: (scores, their scale to base-2 logits). Under a
    logit cap, the capped logits (`scale_scores`) and 1; without one, the raw scores and qk_scale, which the
    softmax folds in with one FMA a score. Example: no cap, qk_scale 0.125 → (qk, 0.125)."""
    if LOGIT_CAP:
        sc = scale_scores(qk, qk_scale, cap_scale, LOGIT_CAP)
        s_scale = 1.0
    else:
        sc = qk
        s_scale = qk_scale
    return sc, s_scale


#: an e4m3 byte moved bit for bit into an fp16 (`e4m3_as_f16`) reads as its e4m3 value / 256: kernels fold
#: this factor into k_scale / v_scale on the host (`fp8_unit_scales`)
E4M3_AS_F16_UNIT = 256.0
#: PTX for 4 e4m3 bytes (one 32-bit register, byte i = element i) to 4 fp16 of value / 256 (two registers):
#: prmt places byte b0 / b1 (b2 / b3) in the high byte of each 16-bit half (sign at bit 15), then
#: ((t >> 1) & 0x3F803F80) moves the 4 exponent + 3 mantissa bits under fp16's 5-bit exponent and
#: (t & 0x80008000) keeps the sign: 3 integer ops per 2 elements, no F2F conversion instruction
E4M3_AS_F16_PTX = tl.constexpr(
    """
{
.reg .b32 t, u;
prmt.b32 t, $2, 0, 0x1404;
shr.b32 u, t, 1;
and.b32 u, u, 0x3F803F80;
and.b32 t, t, 0x80008000;
or.b32 $0, t, u;
prmt.b32 t, $2, 0, 0x3424;
shr.b32 u, t, 1;
and.b32 u, u, 0x3F803F80;
and.b32 t, t, 0x80008000;
or.b32 $1, t, u;
}
"""
)


def fp8_unit_scales(k_scale: float, v_scale: float) -> tuple[float, float]:
    """(k_scale, v_scale) for kernels that read an e4m3 cache through `e4m3_as_f16` (values / 256): each
    times `E4M3_AS_F16_UNIT`. Example: `fp8_unit_scales(0.02, 1.0)` is `(5.12, 256.0)`."""
    return k_scale * E4M3_AS_F16_UNIT, v_scale * E4M3_AS_F16_UNIT


@triton.jit
def e4m3_as_f16(x, USE_PTX: tl.constexpr):
    """uint8 tensor of float8_e4m3fn bits → float16 tensor of the same shape holding value / 256, exactly
    (e4m3's 4-bit exponent fits fp16's 5-bit one shifted by 8 binades; e4m3 subnormals land on fp16
    subnormals), by moving bits: sign to bit 15, exponent and mantissa (7 bits) to bits 7..13. Callers
    fold the 256 into their scales (`fp8_unit_scales`). e4m3fn's NaN code (0x7F / 0xFF) reads as ±480/256.
    USE_PTX does it 4 bytes at a time in PTX (GPU; the interpreter runs the same bit moves in Triton ops).
    Example: byte 0x38 (1.0) → fp16 bits 0x1C00 = 2^-8; 0x7E (448) → 0x3F00 = 1.75; 0x01 (2^-9) → 2^-17."""
    if USE_PTX:
        return tl.inline_asm_elementwise(E4M3_AS_F16_PTX, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
    h = x.to(tl.uint16)
    return (((h & 0x80) << 8) | ((h & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def e4m3_words_as_f16(w, ROWS: tl.constexpr, COLS: tl.constexpr, USE_PTX: tl.constexpr):
    """`e4m3_as_f16` of a tile loaded as int32 words: w `[ROWS, COLS // 4]`, word j holding bytes 4j..4j+3
    (little-endian) → float16 `[ROWS, COLS]` of value / 256. Loading words keeps the tile's rows contiguous
    in registers (16-byte loads, 16-byte shared-memory reads) where a byte tile consumed as a dot's B
    operand is read from shared memory one byte at a time.
    Example: the word 0x7E013880 (bytes 0x80, 0x38, 0x01, 0x7E) → [-0.0, 2^-8, 2^-17, 1.75]."""
    if USE_PTX:
        lo, hi = tl.inline_asm_elementwise(
            E4M3_AS_F16_PTX, "=r,=r,r", [w], dtype=(tl.int32, tl.int32), is_pure=True, pack=1
        )
    else:  # the same bit moves in Triton ops: bytes 0/1 (2/3) to the high byte of each 16-bit half
        u = w.to(tl.uint32, bitcast=True)
        t_lo = ((u & 0xFF) << 8) | ((u & 0xFF00) << 16)
        t_hi = ((u >> 8) & 0xFF00) | (u & 0xFF000000)
        lo = ((t_lo & 0x80008000) | ((t_lo >> 1) & 0x3F803F80)).to(tl.int32, bitcast=True)
        hi = ((t_hi & 0x80008000) | ((t_hi >> 1) & 0x3F803F80)).to(tl.int32, bitcast=True)
    # join adds a last axis: [.., i, j] = (j-th outer operand)[i], so bytes 0, 1, 2, 3 come out of
    # join(join(b0, b2), join(b1, b3)) in order when flattened (i * 2 + j)
    halves = tl.join(
        tl.join(lo.to(tl.uint16), hi.to(tl.uint16)), tl.join((lo >> 16).to(tl.uint16), (hi >> 16).to(tl.uint16))
    )
    return tl.reshape(halves, [ROWS, COLS]).to(tl.float16, bitcast=True)


@triton.jit
def fp8_query(q, q_pe, HAS_PE: tl.constexpr):
    """q `[M, D]` (and q_pe `[M, DPE]` with HAS_PE) as float16 operands for dots with `e4m3_as_f16` tiles,
    scaled by c = 8192 / max|q| (one factor for the program, so |q·c| <= 2^13 stays inside fp16 and keeps
    11 mantissa bits, more than bf16's 8). Returns (q·c, q_pe·c, 1/c): scores then multiply by 1/c.
    A q of zeros keeps c = 1."""
    qf = q.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(qf), 1), 0)
    if HAS_PE:
        pf = q_pe.to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.max(tl.abs(pf), 1), 0))
    c = tl.where(amax > 0.0, 8192.0 / tl.where(amax > 0.0, amax, 1.0), 1.0)
    q16 = (qf * c).to(tl.float16)
    pe16 = q16
    if HAS_PE:
        pe16 = (pf * c).to(tl.float16)
    return q16, pe16, 1.0 / c


@triton.jit
def softmax_terms(m_i, l_i, s, s_scale, GUARD: tl.constexpr):
    """The terms of one online-softmax step over scores `s` [M, N] (base-2 logits s * s_scale, s_scale > 0;
    -inf where masked), for a running max m_i and denominator l_i [M]: returns (the new max, the new
    denominator, alpha [M] = the factor the accumulator takes, p [M, N]). With GUARD, rows that have seen
    only -inf keep max -inf and contribute nothing (no NaN); without it every row must hold a finite score
    (unmasked tiles). Shared by `softmax_step` and the Hopper kernels (`mla_wgmma.py`, `extend_wgmma.py`,
    which call it from Gluon and rescale their accumulators where their MMAs allow).

    Worked example (one row, s_scale 1): m_i -inf, l_i 0, s [1, 3] -> max 3, alpha 0, p [0.25, 1], l 1.25;
    then s [5, -inf] -> max 5, alpha 0.25, p [1, 0], l 0.25 * 1.25 + 1 = 1.3125."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)
    if GUARD:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s * s_scale - m_use[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def softmax_step(m_i, l_i, acc, s, s_scale, GUARD: tl.constexpr):
    """One online-softmax step (`softmax_terms`) with the accumulator `acc` [M, DV] rescaled: returns the
    new running max, denominator, rescaled accumulator and the probabilities `p` [M, N]."""
    m_new, l_new, alpha, p = softmax_terms(m_i, l_i, s, s_scale, GUARD)
    return m_new, l_new, acc * alpha[:, None], p


@triton.jit
def lazy_softmax_step(m_i, l_i, acc, s, s_scale, SLACK: tl.constexpr):
    """`common.softmax_step` with a lazy reference: base-2 logits s * s_scale ([M, N], -inf where
    masked); the running max m_i moves (every row to its new max, acc and l rescaled) only when some
    row's tile max exceeds it by more than SLACK; otherwise p = exp2(logit - m_i) <= 2^SLACK against
    the old reference and acc is left as it is. Rows that have seen only -inf contribute nothing.

    Returns the reference, the denominator, the accumulator and p [M, N]; finalize gives acc / l and
    the LSE m + log2(l), the same as with the exact max."""
    m_tile = tl.max(s, 1) * s_scale
    grow = tl.where(m_tile > m_i, m_tile - m_i, 0.0)  # +inf for a row's first finite tile
    if tl.max(grow, 0) > SLACK:
        m_new = tl.maximum(m_i, m_tile)
        alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
    p = tl.exp2(s * s_scale - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
    return m_i, l_i + tl.sum(p, 1), acc, p


@triton.jit
def add_sink(m_i, l_i, acc, sink2):
    """Join a base-2 sink logit per row to the denominator (it adds nothing to the output)."""
    m_new = tl.maximum(m_i, sink2)
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.exp2(sink2 - m_new), acc * alpha[:, None]


@triton.jit
def finalize(m_i, l_i, acc):
    """Normalized output and base-2 LSE; rows that saw no key get 0 and -inf."""
    ok = l_i > 0.0
    inv = tl.where(ok, 1.0 / tl.where(ok, l_i, 1.0), 0.0)
    lse2 = tl.where(ok, m_i + tl.log2(tl.where(ok, l_i, 1.0)), float("-inf"))
    return acc * inv[:, None], lse2


@triton.jit
def load_slots(KV_INDICES, kv_beg, n, n_ok, num_slots, bad_slots):
    """Slots (int64) of keys `n` of the request whose CSR entries start at `kv_beg`, read where `n_ok`;
    returns (slot, n_ok and the slot inside [0, num_slots), bad_slots | the keys whose slot is not):
    a key with a slot outside the pool is masked out and recorded, never read."""
    slot = tl.load(KV_INDICES + kv_beg + n, mask=n_ok, other=0).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < num_slots)
    return slot, n_ok & slot_ok, bad_slots | (n_ok & ~slot_ok)


@triton.jit
def whole_tile_slots(KV_INDICES, kv_beg, n, num_slots, bad_slots):
    """`load_slots` for a whole tile (every key `n` inside the request, num_slots > 0), with no per-key mask:
    returns (slot int64, bad_slots | the keys whose slot lies outside [0, num_slots)), where such a slot is
    replaced by slot 0, so it is never read; the caller leaves or redoes those keys. One unsigned compare a
    key: a negative slot wraps past any pool. Example: slots [5, -1, 900] of a 300-slot pool -> [5, 0, 0],
    bad [F, T, T]."""
    raw = tl.load(KV_INDICES + kv_beg + n)
    in_pool = raw.to(tl.uint32, bitcast=True) < num_slots.to(tl.uint32)
    return tl.where(in_pool, raw, 0).to(tl.int64), bad_slots | ~in_pool


@triton.jit
def offset_range(INDPTR, r, size):
    """(begin, length, clamped) of CSR entry r, its offsets INDPTR[r], INDPTR[r+1] clamped so that
    0 <= begin <= end <= size; `clamped` says whether either offset was out of range."""
    beg_in = tl.load(INDPTR + r)
    end_in = tl.load(INDPTR + r + 1)
    beg = tl.minimum(tl.maximum(beg_in, 0), size)
    end = tl.minimum(tl.maximum(end_in, beg), size)
    return beg, end - beg, (beg != beg_in) | (end != end_in)


@triton.jit
def attend_tile(
    acc,
    m_i,
    l_i,
    q,
    q_pe,
    start,
    kv_len,
    q_pos,
    q_idx,
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
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DPE: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SHARE_KV: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    LAZY: tl.constexpr,
    PAGE: tl.constexpr,
):
    """Attend one BLOCK_N tile of keys starting at `start` for the rows of `q` [M, D] (and `q_pe`
    [M, DPE], the rope part, when DPE > 0); MASKED applies bounds and visibility.

    Row i of the tile is a query at position q_pos[i] (causal: it sees keys n <= q_pos[i]; window W:
    n > q_pos[i] - W) whose custom-mask row is q_idx[i] of the request's `[q_len, kv_len]` block at
    MASK + mask_beg (entries outside [0, mask_size) are not read: the key stays hidden); rows with
    m_ok false see nothing in masked tiles. Keys come from the request's CSR entries
    KV_INDICES[kv_beg + n] (slots of `k_head` / `v_head`, one KV head). Shared by the extend kernel
    (rows = tokens of one q head) and the verify kernel (rows = q heads x draft tokens of one KV head).
    LAZY > 0 rescales the accumulator lazily (`lazy_softmax_step` with that slack), else on every tile.
    K/V rows sit at `kv_rows(slot, PAGE, stride_kp / stride_vp, stride_ks / stride_vs)` (`paged_strides`).
    In MASKED tiles a key a row does not see adds exactly nothing to it whatever its V holds
    (`attn_core.ops.masked_values_triton.finite_values`: V entries that are not finite are zeroed, a row
    that sees one gets NaN); unmasked tiles are seen whole by every row.
    Returns (acc, m_i, l_i, bad_slots | the tile's slots outside [0, num_slots))."""
    n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    if MASKED:
        slot, n_ok, bad_slots = load_slots(KV_INDICES, kv_beg, n, n < kv_len, num_slots, bad_slots)
    else:
        slot, bad_slots = whole_tile_slots(KV_INDICES, kv_beg, n, num_slots, bad_slots)
    k_rows = kv_rows(slot, PAGE, stride_kp, stride_ks)[:, None]
    if MASKED:
        k = tl.load(k_head + k_rows + offs_d[None, :], mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    else:
        k = tl.load(k_head + k_rows + offs_d[None, :], mask=offs_d[None, :] < D, other=0.0)
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)
    if BLOCK_DPE > 0:
        offs_dpe = tl.arange(0, BLOCK_DPE)
        pe_ptr = k_head + k_rows + D + offs_dpe[None, :]
        if MASKED:
            k_pe = tl.load(pe_ptr, mask=n_ok[:, None] & (offs_dpe[None, :] < DPE), other=0.0)
        else:
            k_pe = tl.load(pe_ptr, mask=offs_dpe[None, :] < DPE, other=0.0)
        qk += tl.dot(q_pe, tl.trans(k_pe.to(q.dtype)), input_precision=DOT_PREC)
    sc, s_scale = tile_logits(qk, qk_scale, cap_scale, LOGIT_CAP)
    if MASKED:
        ok = n_ok[None, :] & m_ok[:, None]
        if CAUSAL:
            ok = ok & (n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            ok = ok & (n[None, :] > q_pos[:, None] - window)
        if USE_MASK:
            at = mask_beg + q_idx[:, None].to(tl.int64) * kv_len + n[None, :]
            bits = tl.load(MASK + at, mask=ok & (at >= 0) & (at < mask_size), other=0)
            ok = ok & (bits != 0)
        sc = tl.where(ok, sc, float("-inf"))
    if LAZY > 0:
        m_i, l_i, acc, p = lazy_softmax_step(m_i, l_i, acc, sc, s_scale, LAZY)
    else:
        m_i, l_i, acc, p = softmax_step(m_i, l_i, acc, sc, s_scale, MASKED)
    if SHARE_KV:
        v = k
    else:
        v_rows = kv_rows(slot, PAGE, stride_vp, stride_vs)[:, None]
        if MASKED:
            v = tl.load(v_head + v_rows + offs_dv[None, :], mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        else:
            v = tl.load(v_head + v_rows + offs_dv[None, :], mask=offs_dv[None, :] < DV, other=0.0)
    v = v.to(q.dtype)
    if MASKED:
        v, seen = finite_values(v, ok)
        acc += tl.dot(p.to(q.dtype), v, input_precision=DOT_PREC)
        acc = tl.where(seen[:, None] != 0, float("nan"), acc)
    else:
        acc += tl.dot(p.to(q.dtype), v, input_precision=DOT_PREC)
    return acc, m_i, l_i, bad_slots


@triton.jit
def key_ranges(
    kv_len,
    q_off,
    first,
    tokens,
    window,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    USE_MASK: tl.constexpr,
):
    """(lo, full_end, hi): the keys a block of `tokens` new tokens sees, the first of them new token `first`
    (at position q_off + first among the request's kv_len keys). Keys [lo, full_end) are seen by every row
    of the block (no masks needed), keys [full_end, hi) need masks; lo and full_end are multiples of BLOCK_N.
    Causal: the block's last row sees keys up to q_off + first + tokens - 1, its first row up to q_off +
    first. A window W starts the range at the first row's oldest key (q_off + first - W + 1, rounded down)
    and masks every tile, as do custom masks. Shared by both extend kernels (`extend.py`; `extend_wgmma.py` calls it
    from Gluon).

    Worked example: kv_len 1000, q_off 600 (400 new tokens), first 128, tokens 128, BLOCK_N 64, causal:
    hi = min(1000, 856) = 856, full_end = 728 rounded down = 704, lo = 0; with a window of 100, lo = 629 // 64
    * 64 = 576 and full_end = 576."""
    if CAUSAL:
        hi = tl.minimum(kv_len, q_off + first + tokens)
        full_end = q_off + first
    else:
        hi = kv_len
        full_end = kv_len
    lo = hi * 0
    if HAS_WINDOW:
        lo = tl.maximum(q_off + first - window + 1, 0) // BLOCK_N * BLOCK_N
        full_end = lo
    if USE_MASK:
        full_end = lo
    full_end = tl.maximum(full_end // BLOCK_N * BLOCK_N, lo)
    return lo, full_end, hi
