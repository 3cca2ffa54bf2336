"""The step check of `attn_core.ops.step_checks` as one Triton kernel (its CUDA path; the interpreter
runs it on CPU tensors for the tests, which compare it with `check_step_torch`).

Grid `[bs]`: program r loads the whole batch's rows and lengths (masked block loads, O(bs)) for the
prefix sums, totals and the duplicate-row test, checks request r, its keys' slots (chunks of CHUNK table
entries) and its new tokens' slots, and writes their allowed slots. The last program zeroes the allowed
slots of tokens no request covers. Every load is masked or its index clamped: the check itself cannot
read out of bounds whatever the batch holds. Every input is read through its strides (a 1-D view with
stride != 1, e.g. `loc[:, s]` of a `[bs, steps]` slot buffer, is read as torch reads it: reading it
as dense once refused every request after the first of a correct engine's draft steps). Importing this
module imports Triton.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from attn_core.ops.device_faults import FIRST_REQUEST_BASE, NUM_FAULT_KINDS, DeviceFaultKind
from attn_core.ops.step_tensors import StepTensors
from attn_core.ops.triton_launch import CachedLaunch

CHUNK = 256

_NK = tl.constexpr(NUM_FAULT_KINDS)
_BASE = tl.constexpr(FIRST_REQUEST_BASE)
_ROW = tl.constexpr(int(DeviceFaultKind.REQUEST_ROW))
_DUP = tl.constexpr(int(DeviceFaultKind.DUPLICATE_ROW))
_LENGTH = tl.constexpr(int(DeviceFaultKind.LENGTH))
_WIDTH = tl.constexpr(int(DeviceFaultKind.TABLE_WIDTH))
_EXT = tl.constexpr(int(DeviceFaultKind.EXTEND_LENS))
_START = tl.constexpr(int(DeviceFaultKind.START_LOC))
_MASK = tl.constexpr(int(DeviceFaultKind.MASK_INDPTR))
_KEY = tl.constexpr(int(DeviceFaultKind.KEY_SLOT))
_CASC = tl.constexpr(int(DeviceFaultKind.CASCADE))
_SEQ_TOTAL = tl.constexpr(int(DeviceFaultKind.SEQ_TOTAL))
_EXT_TOTAL = tl.constexpr(int(DeviceFaultKind.EXTEND_TOTAL))
_WSLOT = tl.constexpr(int(DeviceFaultKind.WRITE_SLOT))
_WOWNER = tl.constexpr(int(DeviceFaultKind.WRITE_OWNER))


@triton.jit
def flag_request(FAULT, kind, r, bad):
    """Flag `kind` in the fault word and offer request r as its first offender, where `bad` (scalar)."""
    tl.store(FAULT + kind, 1, mask=bad)
    tl.atomic_max(FAULT + _NK + kind, r * -1 + _BASE, mask=bad)


@triton.jit
def check_request(
    r,
    REQ_TO_TOKEN,
    stride_row,
    num_rows,
    width,
    REQ_POOL_INDICES,
    SEQ_LENS,
    ENC_LENS,
    Q_LENS,
    PREFIX_LENS,
    START_LOC,
    MASK_INDPTR,
    OUT_CACHE_LOC,
    SAFE,
    FAULT,
    SEQ_TOTAL_PTR,
    bs,
    num_tokens,
    seq_total,
    num_slots,
    cascade_len,
    pad_seq,
    stride_col,
    stride_rpi,
    stride_seq,
    stride_enc,
    stride_q,
    stride_prefix,
    stride_start,
    stride_mask,
    stride_loc,
    BS_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    MIN_SEQ: tl.constexpr,
    HAS_ENC: tl.constexpr,
    HAS_Q: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    HAS_START: tl.constexpr,
    HAS_MASK_INDPTR: tl.constexpr,
    HAS_WRITE: tl.constexpr,
    HAS_SEQ_TOTAL: tl.constexpr,
    SEQ_TOTAL_ON_DEVICE: tl.constexpr,
    CHECK_DUP: tl.constexpr,
    CHECK_KEYS: tl.constexpr,
    HAS_CASCADE: tl.constexpr,
):
    """Program r of the step check (the module docstring): request r's checks, faults and allowed slots.
    Public so that another per-step kernel runs the check in its own launch (grid axis 0 the requests):
    `attn_core.ops.kv_indices_triton.launch_checked_indices`, the index kernel with the step check."""
    offs = tl.arange(0, BS_BLOCK)
    inb = offs < bs
    before = offs < r
    rows_all = tl.load(REQ_POOL_INDICES + offs * stride_rpi, mask=inb, other=0).to(tl.int64)
    seq_all = tl.load(SEQ_LENS + offs * stride_seq, mask=inb, other=0).to(tl.int64)
    if HAS_Q:
        q_all = tl.load(Q_LENS + offs * stride_q, mask=inb, other=0).to(tl.int64)
    else:
        q_all = inb.to(tl.int64)
    qc_all = tl.maximum(q_all, 0)
    q_beg = tl.sum(tl.where(before, qc_all, 0), 0)
    q_total = tl.sum(qc_all, 0)

    row = tl.load(REQ_POOL_INDICES + r * stride_rpi).to(tl.int64)
    seq = tl.load(SEQ_LENS + r * stride_seq).to(tl.int64)
    enc = seq * 0
    if HAS_ENC:
        enc = tl.load(ENC_LENS + r * stride_enc).to(tl.int64)
    q = seq * 0 + 1
    if HAS_Q:
        q = tl.load(Q_LENS + r * stride_q).to(tl.int64)
    qc = tl.maximum(q, 0)

    never = r < 0  # a False of the scalar mask type
    row_bad = (row < 0) | (row >= num_rows)
    pad = (row == 0) & (seq == pad_seq)  # a graph padding row (pad_seq -1: none)
    dup = never
    if CHECK_DUP:
        pad_all = (rows_all == 0) & (seq_all == pad_seq)
        same = (rows_all == row) & (seq_all == seq)
        dup = (tl.sum(tl.where(before & same & (pad_all == 0), 1, 0), 0) > 0) & (pad == 0)
    len_bad = (seq < MIN_SEQ) | (enc < 0) | (q < 0)
    width_bad = (len_bad == 0) & (enc + seq > width)
    ext_bad = q > seq
    if HAS_PREFIX:
        ext_bad = ext_bad | (tl.load(PREFIX_LENS + r * stride_prefix).to(tl.int64) != seq - q)
    start_bad = never
    if HAS_START:
        start_bad = tl.load(START_LOC + r * stride_start).to(tl.int64) != q_beg
    mask_bad = never
    if HAS_MASK_INDPTR:
        sizes = qc_all * tl.maximum(seq_all, 0)
        m_beg = tl.sum(tl.where(before, sizes, 0), 0)
        mask_bad = tl.load(MASK_INDPTR + r * stride_mask).to(tl.int64) != m_beg
        if r == bs - 1:
            mask_bad = mask_bad | (tl.load(MASK_INDPTR + bs * stride_mask).to(tl.int64) != tl.sum(sizes, 0))
    shape_ok = (row_bad | len_bad | width_bad) == 0
    safe_row = tl.where(row_bad, 0, row)
    n_keys = tl.where(shape_ok, enc + seq, 0).to(tl.int32)
    src = REQ_TO_TOKEN + safe_row * stride_row

    key_bad = never
    if CHECK_KEYS:
        for i in range(0, n_keys, CHUNK):
            o = i + tl.arange(0, CHUNK)
            m = o < n_keys
            slots = tl.load(src + o * stride_col, mask=m, other=1)
            key_bad = key_bad | (tl.max((m & ((slots < 1) | (slots >= num_slots))).to(tl.int32), 0) > 0)
        key_bad = key_bad & (pad == 0)
    casc_bad = never
    if HAS_CASCADE:
        row0 = tl.load(REQ_POOL_INDICES).to(tl.int64)
        src0 = REQ_TO_TOKEN + tl.where((row0 < 0) | (row0 >= num_rows), 0, row0) * stride_row
        p = tl.minimum(cascade_len, width)
        shared = tl.minimum(n_keys, p).to(tl.int32)
        casc_bad = n_keys < p
        if r > 0:
            for i in range(0, shared, CHUNK):
                o = i + tl.arange(0, CHUNK)
                m = o < shared
                mine = tl.load(src + o * stride_col, mask=m, other=0)
                theirs = tl.load(src0 + o * stride_col, mask=m, other=0)
                casc_bad = casc_bad | (tl.max((m & (mine != theirs)).to(tl.int32), 0) > 0)

    req_bad = row_bad | dup | len_bad | width_bad | ext_bad | start_bad | mask_bad | key_bad | casc_bad
    flag_request(FAULT, _ROW, r, row_bad)
    flag_request(FAULT, _DUP, r, dup)
    flag_request(FAULT, _LENGTH, r, len_bad)
    flag_request(FAULT, _WIDTH, r, width_bad)
    flag_request(FAULT, _EXT, r, ext_bad)
    flag_request(FAULT, _START, r, start_bad)
    flag_request(FAULT, _MASK, r, mask_bad)
    flag_request(FAULT, _KEY, r, key_bad)
    flag_request(FAULT, _CASC, r, casc_bad)

    step_bad = q_total != num_tokens
    if HAS_SEQ_TOTAL:
        seq_sum = tl.sum(seq_all, 0)
        if SEQ_TOTAL_ON_DEVICE:  # written by a kernel of the step (a graph replay's `fill_`)
            want = tl.load(SEQ_TOTAL_PTR)
        else:
            want = seq_total
        step_bad = step_bad | (seq_sum != want)
        if r == 0:
            tl.store(FAULT + _SEQ_TOTAL, 1, mask=seq_sum != want)
    if r == 0:
        tl.store(FAULT + _EXT_TOTAL, 1, mask=q_total != num_tokens)

    if HAS_WRITE:
        q_eff = tl.minimum(qc, tl.maximum(num_tokens - q_beg, 0)).to(tl.int32)
        first_col = enc + seq - q
        slot_bad = never
        owner_bad = never
        for i in range(0, q_eff, CHUNK):
            o = i + tl.arange(0, CHUNK)
            m = o < q_eff
            t = q_beg + o
            loc = tl.load(OUT_CACHE_LOC + t * stride_loc, mask=m, other=0).to(tl.int64)
            col = first_col + o
            col_ok = (col >= 0) & (col < tl.where(shape_ok, width, 0))  # a vector mask (no scalar & vector)
            expect = tl.load(src + col * stride_col, mask=m & col_ok, other=-1).to(tl.int64)
            pad_tok = (loc == 0) & (o * 0 + pad_seq >= 0)  # graph runs: a token may write the dummy slot
            in_pool = ((loc >= 1) & (loc < num_slots)) | pad_tok
            owned = (col_ok & (loc == expect)) | pad_tok
            slot_bad = slot_bad | (tl.max((m & ~in_pool).to(tl.int32), 0) > 0)
            owner_bad = owner_bad | (tl.max((m & in_pool & ~owned).to(tl.int32), 0) > 0)
            good = in_pool & owned & (tl.where((req_bad | step_bad) == 0, 1, 0) + o * 0 > 0)
            tl.store(SAFE + t, tl.where(good, loc, 0), mask=m)
        flag_request(FAULT, _WSLOT, r, slot_bad)
        flag_request(FAULT, _WOWNER, r, owner_bad & (req_bad == 0))
        if r == bs - 1:
            for i in range(tl.minimum(q_total, num_tokens).to(tl.int32), num_tokens, CHUNK):
                o = i + tl.arange(0, CHUNK)
                tl.store(SAFE + o, tl.zeros([CHUNK], dtype=tl.int64), mask=o < num_tokens)


#: the step check's arguments left unspecialized (value / alignment): one binary per constexpr set serves every
#: batch; a kernel that runs `check_request` in its own launch leaves the same ones unspecialized
CHECK_INTS = ["stride_row", "num_rows", "width", "bs", "num_tokens", "seq_total", "num_slots", "cascade_len"]
CHECK_INTS += ["pad_seq", "stride_col", "stride_rpi", "stride_seq", "stride_enc", "stride_q", "stride_prefix"]
CHECK_INTS += ["stride_start", "stride_mask", "stride_loc"]
CHECK_POINTERS = ["REQ_TO_TOKEN", "REQ_POOL_INDICES", "SEQ_LENS", "ENC_LENS", "Q_LENS", "PREFIX_LENS", "START_LOC"]
CHECK_POINTERS += ["MASK_INDPTR", "OUT_CACHE_LOC", "SAFE", "FAULT", "SEQ_TOTAL_PTR"]


@triton.jit(do_not_specialize=CHECK_INTS, do_not_specialize_on_alignment=CHECK_POINTERS)
def _step_check_kernel(
    REQ_TO_TOKEN,
    stride_row,
    num_rows,
    width,
    REQ_POOL_INDICES,
    SEQ_LENS,
    ENC_LENS,
    Q_LENS,
    PREFIX_LENS,
    START_LOC,
    MASK_INDPTR,
    OUT_CACHE_LOC,
    SAFE,
    FAULT,
    SEQ_TOTAL_PTR,
    bs,
    num_tokens,
    seq_total,
    num_slots,
    cascade_len,
    pad_seq,
    stride_col,
    stride_rpi,
    stride_seq,
    stride_enc,
    stride_q,
    stride_prefix,
    stride_start,
    stride_mask,
    stride_loc,
    BS_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    MIN_SEQ: tl.constexpr,
    HAS_ENC: tl.constexpr,
    HAS_Q: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    HAS_START: tl.constexpr,
    HAS_MASK_INDPTR: tl.constexpr,
    HAS_WRITE: tl.constexpr,
    HAS_SEQ_TOTAL: tl.constexpr,
    SEQ_TOTAL_ON_DEVICE: tl.constexpr,
    CHECK_DUP: tl.constexpr,
    CHECK_KEYS: tl.constexpr,
    HAS_CASCADE: tl.constexpr,
):
    check_request(
        tl.program_id(0),
        REQ_TO_TOKEN,
        stride_row,
        num_rows,
        width,
        REQ_POOL_INDICES,
        SEQ_LENS,
        ENC_LENS,
        Q_LENS,
        PREFIX_LENS,
        START_LOC,
        MASK_INDPTR,
        OUT_CACHE_LOC,
        SAFE,
        FAULT,
        SEQ_TOTAL_PTR,
        bs,
        num_tokens,
        seq_total,
        num_slots,
        cascade_len,
        pad_seq,
        stride_col,
        stride_rpi,
        stride_seq,
        stride_enc,
        stride_q,
        stride_prefix,
        stride_start,
        stride_mask,
        stride_loc,
        BS_BLOCK,
        CHUNK,
        MIN_SEQ,
        HAS_ENC,
        HAS_Q,
        HAS_PREFIX,
        HAS_START,
        HAS_MASK_INDPTR,
        HAS_WRITE,
        HAS_SEQ_TOTAL,
        SEQ_TOTAL_ON_DEVICE,
        CHECK_DUP,
        CHECK_KEYS,
        HAS_CASCADE,
    )


def check_step_triton(s: StepTensors, safe: Optional[torch.Tensor], fault: torch.Tensor) -> None:
    """`attn_core.ops.step_checks.check_step_torch`'s results in one launch (see the module docstring).
    `safe`: int64, at least `s.num_tokens` entries, unit stride (only the first num_tokens are written).
    Every other tensor is read through its strides: a strided view (an engine's `out_cache_loc` sliced
    out of a `[bs, steps]` buffer, the draft wrapper's per-step slots) reads as torch reads it."""
    bs, T = s.batch_size, s.num_tokens
    if bs == 0:
        if s.out_cache_loc is not None and safe is not None and T:
            safe[:T] = 0
        return
    args, constexprs = step_check_arguments(s, safe, fault)
    _LAUNCH((bs,), *args, **constexprs, num_warps=4)


def step_check_arguments(s: StepTensors, safe: Optional[torch.Tensor], fault: torch.Tensor) -> tuple[tuple, dict]:
    """(runtime arguments, constexpr keywords) of `check_request` for a batch of at least one request, as
    the step check's kernel and any kernel that runs it in its own launch pass them (one owner of the
    argument list)."""
    bs, T = s.batch_size, s.num_tokens
    write = s.out_cache_loc is not None and safe is not None
    r2t = s.req_to_token
    dummy = s.seq_lens
    enc = s.encoder_lens if s.encoder_lens is not None else dummy
    q_lens = s.q_lens if s.q_lens is not None else dummy
    prefix = s.prefix_lens if s.prefix_lens is not None else dummy
    start = s.start_loc if s.start_loc is not None else dummy
    mask_indptr = s.mask_indptr if s.mask_indptr is not None else dummy
    loc = s.out_cache_loc if write and s.out_cache_loc is not None else dummy
    on_device = isinstance(s.seq_total, torch.Tensor)
    total_ptr = s.seq_total if on_device else fault
    total = 0 if on_device or s.seq_total is None else s.seq_total
    args = (
        r2t,
        r2t.stride(0),
        r2t.shape[0],
        r2t.shape[1],
        s.req_pool_indices,
        s.seq_lens,
        enc,
        q_lens,
        prefix,
        start,
        mask_indptr,
        loc,
        safe if write else fault,
        fault,
        total_ptr,
        bs,
        T,
        total,
        s.num_slots,
        s.cascade_len,
        s.pad_seq_len,
        r2t.stride(1),
        s.req_pool_indices.stride(0),
        s.seq_lens.stride(0),
        enc.stride(0),
        q_lens.stride(0),
        prefix.stride(0),
        start.stride(0),
        mask_indptr.stride(0),
        loc.stride(0),
    )
    constexprs = dict(
        BS_BLOCK=max(16, 1 << (bs - 1).bit_length()),
        CHUNK=CHUNK,
        MIN_SEQ=1 if s.decode else 0,
        HAS_ENC=s.encoder_lens is not None,
        HAS_Q=s.q_lens is not None,
        HAS_PREFIX=s.prefix_lens is not None,
        HAS_START=s.start_loc is not None,
        HAS_MASK_INDPTR=s.mask_indptr is not None,
        HAS_WRITE=write,
        HAS_SEQ_TOTAL=s.seq_total is not None,
        SEQ_TOTAL_ON_DEVICE=on_device,
        CHECK_DUP=s.check_dup,
        CHECK_KEYS=s.check_keys,
        HAS_CASCADE=s.cascade_len > 0,
    )
    return args, constexprs


_LAUNCH = CachedLaunch(_step_check_kernel)
