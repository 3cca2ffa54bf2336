"""One Triton kernel that turns `req_to_token` rows into a step's index metadata; the Triton path of
`attn_core.ops.kv_indices.build_kv_indices` and the metadata kernel of the Triton backend.

For request r (row `req_pool_indices[r]`, keys at columns kv_start[r] .. kv_start[r] + kv_lens[r] - 1)
it writes, in a single launch and without any host sync:
- kv_indices: with page_size 1 the slots `req_to_token[row, start + j]`; with page_size > 1 one page id
  per page, `req_to_token[row, start + j * page_size] // page_size` (start must be a multiple of
  page_size, as the paged allocator lays rows out); concatenated over the requests;
- optionally kv_indptr `[bs+1]` int32: exclusive prefix sum of the per-request counts (tokens, or pages);
- optionally last_page_len `[bs]` int32: keys in each request's last page (0 for a request without keys);
- optionally qo_indptr `[bs+1]` int32 (prefix sum of q_lens) and mask_indptr `[bs+1]` int64 (prefix sum
  of q_lens * kv_lens, in tokens: offsets of per-request row-major `[q_len, kv_len]` custom masks).

Bounds (the last line of defence: a CUDA-graph replay runs no host check). Every index the kernel
follows or writes through is checked on the device; what is refused is recorded in the fault buffer
(`attn_core.ops.device_faults`) and the output stays inside its buffers:
- a row outside `[0, rows)` gives the request no keys (REQUEST_ROW; with `keep_layout`, its count of
  dummy ids 0, and the ids' tail up to the capacity is written 0 too); a negative kv_start or length
  counts as 0 (LENGTH); keys past the table's width are cut at the width (TABLE_WIDTH);
- ids past kv_indices' capacity (device lengths larger than the host sum that sized it) are not
  written and kv_indptr stops at the capacity (INDEX_CAPACITY);
- with `num_slots`, a slot outside `[0, num_slots)` is written as the dummy slot 0 (page 0) (SLOT);
- a negative q_len counts as 0 (LENGTH).
kv_indptr, last_page_len and mask_indptr describe what was written, so the kernels that follow them
stay in bounds too. On valid input nothing changes and nothing is recorded.

Grid `[bs, P]`: each program sums the counts before its request (masked block loads, O(bs)) and
copies every P-th CHUNK of its ids, so any P is correct; P only spreads the copy. With a step check
(`kv_indices_triton(step_check=...)`, `launch_checked_indices`) the programs with c == 0 also run the step
check of their request (`attn_core.ops.step_checks_triton.check_request`): one launch where there were two,
with the same results (the parts share nothing but the launch). Importing this
module imports Triton; with `TRITON_INTERPRET=1` set before the import the kernel runs on CPU tensors.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from attn_core.contract.errors import InvalidArgumentError
from attn_core.ops.device_faults import DeviceFaultKind
from attn_core.ops.step_checks import PendingStepCheck
from attn_core.ops.step_checks_triton import CHECK_INTS, CHECK_POINTERS, check_request, step_check_arguments
from attn_core.ops.triton_launch import CachedLaunch

CHUNK = 512

_ROW = tl.constexpr(int(DeviceFaultKind.REQUEST_ROW))
_LENGTH = tl.constexpr(int(DeviceFaultKind.LENGTH))
_WIDTH = tl.constexpr(int(DeviceFaultKind.TABLE_WIDTH))
_CAPACITY = tl.constexpr(int(DeviceFaultKind.INDEX_CAPACITY))
_SLOT = tl.constexpr(int(DeviceFaultKind.SLOT))


@triton.jit
def keys_in_table(row, start, length, num_rows, width):
    """(row ok, start, length) of a request's keys, cut to the table: rows outside [0, num_rows)
    have no keys, negative starts and lengths count as 0, keys stop at the table's width. Elementwise
    (scalars or blocks of requests); what the index kernel writes for a request, so a kernel fused with it
    (`write_request_ids`) that needs the same per-request numbers calls this too.
    Example: num_rows 4, width 100: (row 2, start 0, length 120) -> (True, 0, 100); row 7 -> (False, 0, 0);
    length -5 -> (True, 0, 0)."""
    row_ok = (row >= 0) & (row < num_rows)
    start = tl.minimum(tl.maximum(start, 0), width)
    length = tl.minimum(tl.maximum(length, 0), width - start)
    return row_ok, start, tl.where(row_ok, length, 0)


@triton.jit
def id_count(length, PAGE_SIZE: tl.constexpr):
    """Ids a request of `length` keys gets: its keys (PAGE_SIZE 1) or pages, ceil(length / PAGE_SIZE).
    Example: length 33, PAGE_SIZE 16 -> 3."""
    if PAGE_SIZE == 1:
        return length
    return (length + PAGE_SIZE - 1) // PAGE_SIZE


# No value or alignment specialization: one binary per constexpr set serves every batch, which lets
# `CachedLaunch` skip the per-call specialization work of the JIT launcher.
INDEX_INTS = ["stride_row", "num_rows", "width", "capacity", "num_slots"]
INDEX_POINTERS = ["REQ_TO_TOKEN", "REQ_POOL_INDICES", "KV_LENS", "KV_START", "KV_INDPTR", "KV_INDICES"]
INDEX_POINTERS += ["LAST_PAGE_LEN", "Q_LENS", "QO_INDPTR", "MASK_INDPTR", "FAULT"]


@triton.jit(do_not_specialize=INDEX_INTS, do_not_specialize_on_alignment=INDEX_POINTERS)
def _build_indices_kernel(
    REQ_TO_TOKEN,
    stride_row,
    num_rows,
    width,
    REQ_POOL_INDICES,
    KV_LENS,
    KV_START,
    KV_INDPTR,
    KV_INDICES,
    capacity,
    LAST_PAGE_LEN,
    Q_LENS,
    QO_INDPTR,
    MASK_INDPTR,
    num_slots,
    FAULT,
    BS_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_START: tl.constexpr,
    HAS_INDPTR: tl.constexpr,
    HAS_LAST: tl.constexpr,
    HAS_Q: tl.constexpr,
    HAS_MASK_INDPTR: tl.constexpr,
    CHECK_SLOTS: tl.constexpr,
    HAS_FAULT: tl.constexpr,
    KEEP_LAYOUT: tl.constexpr,
):
    index_program(
        tl.program_id(0),
        tl.program_id(1),
        tl.num_programs(0),
        tl.num_programs(1),
        REQ_TO_TOKEN,
        stride_row,
        num_rows,
        width,
        REQ_POOL_INDICES,
        KV_LENS,
        KV_START,
        KV_INDPTR,
        KV_INDICES,
        capacity,
        LAST_PAGE_LEN,
        Q_LENS,
        QO_INDPTR,
        MASK_INDPTR,
        num_slots,
        FAULT,
        BS_BLOCK,
        CHUNK,
        PAGE_SIZE,
        HAS_START,
        HAS_INDPTR,
        HAS_LAST,
        HAS_Q,
        HAS_MASK_INDPTR,
        CHECK_SLOTS,
        HAS_FAULT,
        KEEP_LAYOUT,
    )


@triton.jit
def index_program(
    r,
    c,
    num_r,
    num_c,
    REQ_TO_TOKEN,
    stride_row,
    num_rows,
    width,
    REQ_POOL_INDICES,
    KV_LENS,
    KV_START,
    KV_INDPTR,
    KV_INDICES,
    capacity,
    LAST_PAGE_LEN,
    Q_LENS,
    QO_INDPTR,
    MASK_INDPTR,
    num_slots,
    FAULT,
    BS_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_START: tl.constexpr,
    HAS_INDPTR: tl.constexpr,
    HAS_LAST: tl.constexpr,
    HAS_Q: tl.constexpr,
    HAS_MASK_INDPTR: tl.constexpr,
    CHECK_SLOTS: tl.constexpr,
    HAS_FAULT: tl.constexpr,
    KEEP_LAYOUT: tl.constexpr,
):
    """Program (r, c) of the index kernel in a grid `[num_r, num_c]` (the module doc): request r's ids and, with
    KEEP_LAYOUT, the last request's programs write the dummy id 0 from the ids' end to the capacity. Public so
    that a kernel that does more per step runs it in its own launch (`launch_checked_indices`)."""
    end = write_request_ids(
        r,
        c,
        num_c,
        REQ_TO_TOKEN,
        stride_row,
        num_rows,
        width,
        REQ_POOL_INDICES,
        KV_LENS,
        KV_START,
        KV_INDPTR,
        KV_INDICES,
        capacity,
        LAST_PAGE_LEN,
        Q_LENS,
        QO_INDPTR,
        MASK_INDPTR,
        num_slots,
        FAULT,
        BS_BLOCK,
        CHUNK,
        PAGE_SIZE,
        HAS_START,
        HAS_INDPTR,
        HAS_LAST,
        HAS_Q,
        HAS_MASK_INDPTR,
        CHECK_SLOTS,
        HAS_FAULT,
        KEEP_LAYOUT,
    )
    if KEEP_LAYOUT:  # the last request's programs write the dummy id 0 from its end to the capacity
        if r == num_r - 1:
            for i in range(end + c * CHUNK, capacity, num_c * CHUNK):
                o = i + tl.arange(0, CHUNK)
                tl.store(KV_INDICES + o, tl.zeros([CHUNK], dtype=tl.int32), mask=o < capacity)


@triton.jit
def write_request_ids(
    r,
    c,
    num_c,
    REQ_TO_TOKEN,
    stride_row,
    num_rows,
    width,
    REQ_POOL_INDICES,
    KV_LENS,
    KV_START,
    KV_INDPTR,
    KV_INDICES,
    capacity,
    LAST_PAGE_LEN,
    Q_LENS,
    QO_INDPTR,
    MASK_INDPTR,
    num_slots,
    FAULT,
    BS_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_START: tl.constexpr,
    HAS_INDPTR: tl.constexpr,
    HAS_LAST: tl.constexpr,
    HAS_Q: tl.constexpr,
    HAS_MASK_INDPTR: tl.constexpr,
    CHECK_SLOTS: tl.constexpr,
    HAS_FAULT: tl.constexpr,
    KEEP_LAYOUT: tl.constexpr,
):
    """What program (r, c) of the index kernel writes (see the module doc): request r's ids (every
    num_c-th CHUNK of them from the c-th on) and, from c == 0, its entries of the optional arrays and
    its faults; returns the end of request r's ids (capped at the capacity). Public so that a plugin's
    kernel can build a step's ids in the same launch as its own per-step work (`attn_flashinfer.mla_works`:
    FlashInfer's MLA work list): call it from the programs r < bs of a grid `[bs + extra, num_c]` with the
    arguments `kv_indices_triton` passes. `KEEP_LAYOUT` (for readers that take the offsets from the host's
    lengths, as FlashInfer's plans do): a request whose row is refused keeps its ids' places, filled with
    the dummy id 0, instead of getting none, so the requests after it stay where the host put them."""
    offs = tl.arange(0, BS_BLOCK)
    before = offs < r
    rows = tl.load(REQ_POOL_INDICES + offs, mask=before, other=0)
    lens = tl.load(KV_LENS + offs, mask=before, other=0)
    row = tl.load(REQ_POOL_INDICES + r)
    length_in = tl.load(KV_LENS + r)
    if HAS_START:
        starts = tl.load(KV_START + offs, mask=before, other=0)
        start_in = tl.load(KV_START + r)
    else:
        starts = offs * 0
        start_in = length_in * 0
    row_ok, start, length = keys_in_table(row, start_in, length_in, num_rows, width)
    if KEEP_LAYOUT:  # refused rows keep their keys' count: row 0 stands in (the table has one) to cut the lengths
        _rows0_ok, _starts0, lens = keys_in_table(rows * 0, starts, lens, num_rows, width)
        _row0_ok, _start0, length = keys_in_table(row * 0, start_in, length_in, num_rows, width)
    else:
        _rows_ok, _starts, lens = keys_in_table(rows, starts, lens, num_rows, width)
    beg_raw = tl.sum(id_count(lens, PAGE_SIZE), 0)
    end_raw = beg_raw + id_count(length, PAGE_SIZE)
    beg = tl.minimum(beg_raw, capacity)
    count = tl.minimum(end_raw, capacity) - beg
    if c == 0:
        if HAS_FAULT:
            tl.store(FAULT + _ROW, 1, mask=(row < 0) | (row >= num_rows))
            tl.store(FAULT + _LENGTH, 1, mask=(length_in < 0) | (start_in < 0))
            tl.store(FAULT + _WIDTH, 1, mask=row_ok & (start_in.to(tl.int64) + length_in.to(tl.int64) > width))
            tl.store(FAULT + _CAPACITY, 1, mask=end_raw > capacity)
        if HAS_INDPTR:
            if r == 0:
                tl.store(KV_INDPTR, beg * 0)
            tl.store(KV_INDPTR + r + 1, beg + count)
        if HAS_LAST:
            kept = tl.minimum(length, count * PAGE_SIZE)
            tl.store(LAST_PAGE_LEN + r, kept - tl.maximum(count - 1, 0) * PAGE_SIZE)
        if HAS_Q:
            q_lens = tl.maximum(tl.load(Q_LENS + offs, mask=before, other=0), 0)
            q_len_in = tl.load(Q_LENS + r)
            q_len = tl.maximum(q_len_in, 0)
            if HAS_FAULT:
                tl.store(FAULT + _LENGTH, 1, mask=q_len_in < 0)
            q_beg = tl.sum(q_lens, 0)
            if r == 0:
                tl.store(QO_INDPTR, q_beg * 0)
            tl.store(QO_INDPTR + r + 1, q_beg + q_len)
            if HAS_MASK_INDPTR:
                m_beg = tl.sum(q_lens.to(tl.int64) * lens.to(tl.int64), 0)
                if r == 0:
                    tl.store(MASK_INDPTR, m_beg * 0)
                tl.store(MASK_INDPTR + r + 1, m_beg + q_len.to(tl.int64) * length.to(tl.int64))
    src = REQ_TO_TOKEN + tl.where(row_ok, row, 0).to(tl.int64) * stride_row + start
    dst = KV_INDICES + beg
    for i in range(c * CHUNK, count, num_c * CHUNK):
        o = i + tl.arange(0, CHUNK)
        ok = o < count
        if PAGE_SIZE == 1:
            ids = tl.load(src + o, mask=ok)
        else:
            ids = tl.load(src + o * PAGE_SIZE, mask=ok)
        if KEEP_LAYOUT:  # a refused row read row 0 (in the table): its ids become the dummy 0
            ids = tl.where(row_ok, ids, 0)
        if CHECK_SLOTS:
            bad = ok & ((ids < 0) | (ids >= num_slots))
            ids = tl.where(bad, 0, ids)
            if HAS_FAULT:
                tl.store(FAULT + _SLOT, 1, mask=tl.max(bad.to(tl.int32), 0) > 0)
        if PAGE_SIZE == 1:
            tl.store(dst + o, ids, mask=ok)
        else:
            tl.store(dst + o, ids // PAGE_SIZE, mask=ok)
    return beg + count


def copy_programs(bs: int, on_gpu: bool) -> int:
    """Programs per request along the copy axis: enough to fill a GPU at small batch sizes (one under
    the interpreter, which runs programs one after another)."""
    return max(1, min(32, 512 // max(bs, 1))) if on_gpu else 1


def table_arguments(req_to_token: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """The request table as `write_request_ids` takes it (REQ_TO_TOKEN, stride_row, num_rows, width), after
    checking its rows are contiguous (`InvalidArgumentError` otherwise). Example: a `[8, 4096]` int32
    table -> (the table, 4096, 8, 4096)."""
    if req_to_token.stride(1) != 1:
        raise InvalidArgumentError("req_to_token", "a tensor with contiguous rows", tuple(req_to_token.stride()))
    return req_to_token, req_to_token.stride(0), req_to_token.shape[0], req_to_token.shape[1]


def kv_indices_triton(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    kv_indptr: Optional[torch.Tensor] = None,
    last_page_len: Optional[torch.Tensor] = None,
    page_size: int = 1,
    kv_start: Optional[torch.Tensor] = None,
    q_lens: Optional[torch.Tensor] = None,
    qo_indptr: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
    num_slots: Optional[int] = None,
    fault: Optional[torch.Tensor] = None,
    capacity: Optional[int] = None,
    keep_layout: bool = False,
    step_check: Optional[PendingStepCheck] = None,
) -> None:
    """Fill the index tensors of `bs = req_pool_indices.shape[0]` requests in place (see module doc).

    req_to_token `[rows, max_context_len]` int32 with contiguous rows; req_pool_indices `[bs]`
    int32/int64; kv_lens, kv_start, q_lens `[bs]` int32 (kv_lens in tokens); kv_indices int32, of
    which the first `capacity` entries (default: all) may be written (ids past them are refused, see the
    module doc; pass the host's total when a larger scratch buffer holds the ids); last_page_len `[bs]` int32
    (with page_size 1: 1, or 0 for an empty request); qo_indptr is written only together with q_lens,
    mask_indptr only together with both. `num_slots`: the KV pool's slot count, to check every slot
    read from the table against (None: slots are not checked); `fault`: the int32 fault buffer of
    `attn_core.ops.device_faults` (None: refusals are not recorded). An empty batch writes kv_indptr = [0].
    `keep_layout`: for readers that go by offsets from the host's lengths (FlashInfer's plans): a request
    whose row is refused gets its keys' count of dummy ids 0 (not none), and every entry from the ids'
    end to the capacity is written 0, so whatever the device tensors hold, a reader of the first
    `capacity` entries finds only valid ids, each request's where the host put it when the lengths agree.
    `step_check` (`attn_core.ops.step_checks.PendingStepCheck`, what `AttentionBackend.take_step_check` hands
    out): the step check runs in the same launch when its batch has these `bs` requests
    (`launch_checked_indices`), else in its own launch first.
    """
    bs = req_pool_indices.shape[0]
    if bs == 0:
        if kv_indptr is not None:
            kv_indptr.zero_()
        if step_check is not None:
            step_check.run()
        return
    dummy = kv_indices
    args = (
        *table_arguments(req_to_token),
        req_pool_indices,
        kv_lens,
        kv_start if kv_start is not None else dummy,
        kv_indptr if kv_indptr is not None else dummy,
        kv_indices,
        kv_indices.shape[0] if capacity is None else min(capacity, kv_indices.shape[0]),
        last_page_len if last_page_len is not None else dummy,
        q_lens if q_lens is not None else dummy,
        qo_indptr if qo_indptr is not None else dummy,
        mask_indptr if mask_indptr is not None else dummy,
        num_slots if num_slots is not None else 0,
        fault if fault is not None else dummy,
    )
    constexprs = dict(
        BS_BLOCK=1
        << (bs - 1).bit_length(),  # next power of 2 (bs >= 1): ~3.7 µs less than triton.next_power_of_2 (3.9, CPU)
        CHUNK=CHUNK,
        PAGE_SIZE=page_size,
        HAS_START=kv_start is not None,
        HAS_INDPTR=kv_indptr is not None,
        HAS_LAST=last_page_len is not None,
        HAS_Q=q_lens is not None,
        HAS_MASK_INDPTR=mask_indptr is not None,
        CHECK_SLOTS=num_slots is not None,
        HAS_FAULT=fault is not None,
        KEEP_LAYOUT=keep_layout,
    )
    grid = (bs, copy_programs(bs, req_to_token.is_cuda))
    if step_check is not None and step_check.tensors.batch_size == bs:
        launch_checked_indices(grid, args, constexprs, step_check)
        return
    if step_check is not None:  # another set of requests than the index launch's: its own launch
        step_check.run()
    _LAUNCH(grid, *args, **constexprs, num_warps=4)


_LAUNCH = CachedLaunch(_build_indices_kernel)


# ---- the index kernel with the step check in the same launch ---------------------------------------------
# the step check's arguments as `check_request` names them, prefixed: C_ (pointers), c_ (the rest)
@triton.jit(
    do_not_specialize=[*INDEX_INTS, *("c_" + n for n in CHECK_INTS)],
    do_not_specialize_on_alignment=[*INDEX_POINTERS, *("C_" + n for n in CHECK_POINTERS)],
)
def _checked_indices_kernel(
    REQ_TO_TOKEN,
    stride_row,
    num_rows,
    width,
    REQ_POOL_INDICES,
    KV_LENS,
    KV_START,
    KV_INDPTR,
    KV_INDICES,
    capacity,
    LAST_PAGE_LEN,
    Q_LENS,
    QO_INDPTR,
    MASK_INDPTR,
    num_slots,
    FAULT,
    C_REQ_TO_TOKEN,
    c_stride_row,
    c_num_rows,
    c_width,
    C_REQ_POOL_INDICES,
    C_SEQ_LENS,
    C_ENC_LENS,
    C_Q_LENS,
    C_PREFIX_LENS,
    C_START_LOC,
    C_MASK_INDPTR,
    C_OUT_CACHE_LOC,
    C_SAFE,
    C_FAULT,
    C_SEQ_TOTAL_PTR,
    c_bs,
    c_num_tokens,
    c_seq_total,
    c_num_slots,
    c_cascade_len,
    c_pad_seq,
    c_stride_col,
    c_stride_rpi,
    c_stride_seq,
    c_stride_enc,
    c_stride_q,
    c_stride_prefix,
    c_stride_start,
    c_stride_mask,
    c_stride_loc,
    BS_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_START: tl.constexpr,
    HAS_INDPTR: tl.constexpr,
    HAS_LAST: tl.constexpr,
    HAS_Q: tl.constexpr,
    HAS_MASK_INDPTR: tl.constexpr,
    CHECK_SLOTS: tl.constexpr,
    HAS_FAULT: tl.constexpr,
    KEEP_LAYOUT: tl.constexpr,
    C_BS_BLOCK: tl.constexpr,
    C_CHUNK: tl.constexpr,
    C_MIN_SEQ: tl.constexpr,
    C_HAS_ENC: tl.constexpr,
    C_HAS_Q: tl.constexpr,
    C_HAS_PREFIX: tl.constexpr,
    C_HAS_START: tl.constexpr,
    C_HAS_MASK_INDPTR: tl.constexpr,
    C_HAS_WRITE: tl.constexpr,
    C_HAS_SEQ_TOTAL: tl.constexpr,
    C_SEQ_TOTAL_ON_DEVICE: tl.constexpr,
    C_CHECK_DUP: tl.constexpr,
    C_CHECK_KEYS: tl.constexpr,
    C_HAS_CASCADE: tl.constexpr,
):
    if tl.program_id(1) == 0:
        check_request(
            tl.program_id(0),
            C_REQ_TO_TOKEN,
            c_stride_row,
            c_num_rows,
            c_width,
            C_REQ_POOL_INDICES,
            C_SEQ_LENS,
            C_ENC_LENS,
            C_Q_LENS,
            C_PREFIX_LENS,
            C_START_LOC,
            C_MASK_INDPTR,
            C_OUT_CACHE_LOC,
            C_SAFE,
            C_FAULT,
            C_SEQ_TOTAL_PTR,
            c_bs,
            c_num_tokens,
            c_seq_total,
            c_num_slots,
            c_cascade_len,
            c_pad_seq,
            c_stride_col,
            c_stride_rpi,
            c_stride_seq,
            c_stride_enc,
            c_stride_q,
            c_stride_prefix,
            c_stride_start,
            c_stride_mask,
            c_stride_loc,
            C_BS_BLOCK,
            C_CHUNK,
            C_MIN_SEQ,
            C_HAS_ENC,
            C_HAS_Q,
            C_HAS_PREFIX,
            C_HAS_START,
            C_HAS_MASK_INDPTR,
            C_HAS_WRITE,
            C_HAS_SEQ_TOTAL,
            C_SEQ_TOTAL_ON_DEVICE,
            C_CHECK_DUP,
            C_CHECK_KEYS,
            C_HAS_CASCADE,
        )
    index_program(
        tl.program_id(0),
        tl.program_id(1),
        tl.num_programs(0),
        tl.num_programs(1),
        REQ_TO_TOKEN,
        stride_row,
        num_rows,
        width,
        REQ_POOL_INDICES,
        KV_LENS,
        KV_START,
        KV_INDPTR,
        KV_INDICES,
        capacity,
        LAST_PAGE_LEN,
        Q_LENS,
        QO_INDPTR,
        MASK_INDPTR,
        num_slots,
        FAULT,
        BS_BLOCK,
        CHUNK,
        PAGE_SIZE,
        HAS_START,
        HAS_INDPTR,
        HAS_LAST,
        HAS_Q,
        HAS_MASK_INDPTR,
        CHECK_SLOTS,
        HAS_FAULT,
        KEEP_LAYOUT,
    )


def launch_checked_indices(grid: tuple[int, int], index_args: tuple, index_constexprs: dict, check: PendingStepCheck):
    """One launch of the index kernel's programs `grid` (`[bs, P]`, with `index_args` / `index_constexprs` as
    `kv_indices_triton` builds them) and the step check of `check` (a batch of the same bs requests)."""
    args, constexprs = step_check_arguments(check.tensors, check.safe, check.fault)
    fused = {f"C_{k}": v for k, v in constexprs.items()}
    _CHECKED_LAUNCH(grid, *index_args, *args, **index_constexprs, **fused, num_warps=4)


_CHECKED_LAUNCH = CachedLaunch(_checked_indices_kernel)
