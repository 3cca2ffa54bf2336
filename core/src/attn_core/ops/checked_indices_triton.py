"""The index kernel with the step check in the same launch: `attn_core.ops.kv_indices_triton`'s programs
(grid `[bs, P]`) of which those with c == 0 also run the step check of request r
(`attn_core.ops.step_checks_triton.check_request`). One launch a step where there were two: the step check's
host cost (~50 µs a launch on the GPU machine's host, docs/dev/perf-notebook.md) goes away for a backend that
hands its pending check (`AttentionBackend.take_step_check`) to its index launch. The two parts share nothing
but the launch: the same results as the two kernels one after the other (the tests compare them). Importing
this module imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attn_core.ops.kv_indices_triton import index_program
from attn_core.ops.step_checks_triton import check_request, step_check_arguments
from attn_core.ops.step_tensors import PendingStepCheck
from attn_core.ops.triton_launch import CachedLaunch

_INDEX_POINTERS = ["REQ_TO_TOKEN", "REQ_POOL_INDICES", "KV_LENS", "KV_START", "KV_INDPTR", "KV_INDICES"]
_INDEX_POINTERS += ["LAST_PAGE_LEN", "Q_LENS", "QO_INDPTR", "MASK_INDPTR", "FAULT"]
_CHECK_POINTERS = ["C_REQ_TO_TOKEN", "C_REQ_POOL_INDICES", "C_SEQ_LENS", "C_ENC_LENS", "C_Q_LENS", "C_PREFIX_LENS"]
_CHECK_POINTERS += ["C_START_LOC", "C_MASK_INDPTR", "C_OUT_CACHE_LOC", "C_SAFE", "C_FAULT", "C_SEQ_TOTAL_PTR"]
_CHECK_INTS = ["c_stride_row", "c_num_rows", "c_width", "c_bs", "c_num_tokens", "c_seq_total", "c_num_slots"]
_CHECK_INTS += ["c_cascade_len", "c_pad_seq", "c_stride_col", "c_stride_rpi", "c_stride_seq", "c_stride_enc"]
_CHECK_INTS += ["c_stride_q", "c_stride_prefix", "c_stride_start", "c_stride_mask", "c_stride_loc"]


@triton.jit(
    do_not_specialize=["stride_row", "num_rows", "width", "capacity", "num_slots", *_CHECK_INTS],
    do_not_specialize_on_alignment=[*_INDEX_POINTERS, *_CHECK_POINTERS],
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
    _LAUNCH(grid, *index_args, *args, **index_constexprs, **fused, num_warps=4)


_LAUNCH = CachedLaunch(_checked_indices_kernel)

__all__ = ["launch_checked_indices"]
