"""FlashInfer's MLA work list written on the device, in the launch that writes the step's page ids.

FlashInfer's MLA kernels (FA3 on SM90, FA2 elsewhere; flashinfer 0.6.6) read their schedule from an int
workspace that its host scheduler (`MLAPlan`, the compiled `plan` of the MLA module) fills and copies to
the device every step. The kernel is persistent: CTA (x, y) of a grid `[cluster_size, num_sm //
cluster_size]` runs the works `work_indptr[y] .. work_indptr[y + 1]` (x picks the 64 query rows of the
cluster's tile it owns), writes unsplit works' rows to the output and split ones' to partial buffers,
then, after a grid-wide sync, CTA `x + cluster_size * y` merges the partial rows of merge entry `x +
cluster_size * y`. Any assignment of works to clusters is therefore valid; the split structure (which
works exist, their partial rows, the merge entries) is what must match the kernel's conventions.

This module writes that workspace from one Triton program added to the page-id launch (core's
`attn_core.ops.kv_indices_triton.write_request_ids` runs in the others), so a step's metadata costs one
launch and no host scheduler, no host-to-device copy. Per request i (uniform `q_len` queries, `H`
heads: `q_len * H` packed query rows, cut into tiles of `cluster_tile_q = 64 * cluster_size` rows,
walked from the last tile to the first) and tile t:
- its keys: `kv_len` (what the page ids describe: the device length cut to the table and to the ids
  written) or, causal, `packed_causal_kv_end` of the tile (all keys for the last tile);
- the chunk limit: `kv_len_limit(ceil(sum of those over all tiles / clusters))`; a tile with more keys
  than the limit is split into chunks of the limit (the last shorter), one work each, whose rows go to
  partial buffers at a running offset; its rows are merged by `ceil(rows / ceil(rows / max(keys *
  cluster_size // limit, 1)))` merge entries; other tiles are one work writing the output;
- works are ordered request by request, tile by tile, chunk by chunk, and handed out in rounds of one
  work per cluster: in round r, works `r * clusters ..` sorted by cost (FlashInfer's cost function,
  `2 * cluster_tile_q + keys`) go, costliest first, to the clusters sorted by the cost they hold, least
  first. Clusters' loads then differ by at most one work's cost (as under FlashInfer's host scheduler,
  which gives each work in turn to the least loaded cluster), and a round's works, neighbours in the
  order, run at about the same time, so the query tiles of one request read its keys from L2 together.
  (A cut of the order into one contiguous run per cluster ran a 4-draft verify batch 1.17 x slower on
  an H100: each request's tiles then ran one after another on one cluster.) The results do not depend
  on the assignment, only the time.

These are FlashInfer 0.6.6's conventions (`include/flashinfer/attention/scheduler.cuh`), read from its
source and checked on a GPU: the backend compares `work_layout`'s plan info with the one FlashInfer's
own scheduler returns before it uses the device path (`WorkLayout.verify`, once per cluster size), and
the GPU tests compare outputs with FlashInfer's plan (bitwise equal). Importing this module imports
Triton, not FlashInfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from attn_core.contract.errors import InvalidArgumentError
from attn_core.ops.kv_indices_triton import (
    CHUNK,
    copy_programs,
    id_count,
    keys_in_table,
    table_arguments,
    write_request_ids,
)
from attn_core.ops.triton_launch import CachedLaunch

#: FlashInfer 0.6.6's MLA scheduler: query rows per CTA, capacity of the per-work arrays
CTA_TILE_Q = 64
MAX_WORKS = 16384
#: the int arrays of the MLA workspace in FlashInfer's allocation order; "work" arrays hold MAX_WORKS
#: entries, "merge" arrays one per multiprocessor
WORK_ARRAYS = (
    ("q_indptr", "work"),
    ("kv_indptr", "work"),
    ("partial_indptr", "work"),
    ("merge_packed_offset_start", "merge"),
    ("merge_packed_offset_end", "merge"),
    ("merge_partial_packed_offset_start", "merge"),
    ("merge_partial_packed_offset_end", "merge"),
    ("merge_partial_stride", "merge"),
    ("q_len", "work"),
    ("kv_len", "work"),
    ("q_start", "work"),
    ("kv_start", "work"),
    ("kv_end", "work"),
    ("work_indptr", "work"),
)
#: requests per block of the scheduling program
E_BLOCK = 64


@dataclass(frozen=True)
class StepWorks:
    """A step's device work list as FlashInfer's MLA `run` takes it (`replan.mla_run`): the int workspace
    (uint8 view of the work buffer), the plan info FlashInfer's scheduler returned for its layout (checked
    equal to `WorkLayout.plan_info`), the step's page ids, its mask mode and the layout."""

    int_ws: torch.Tensor
    plan_info: object
    kv_indices: torch.Tensor
    causal: bool
    layout: WorkLayout


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def cluster_size(num_tokens: int, bs: int, num_heads: int) -> int:
    """CTAs per cluster of FlashInfer's MLA kernel for a step: 2 when the requests' packed query rows
    (queries x heads) average over 64, else 1. Example: decode, 128 heads -> 2; 16 heads -> 1; 16 heads,
    5 drafts -> 2."""
    return 2 if (num_tokens * num_heads) // bs > 64 else 1


@dataclass(frozen=True)
class WorkLayout:
    """Where FlashInfer's MLA kernel reads its schedule for one device and cluster size: `offsets`, the
    byte offsets of `WORK_ARRAYS` in the int workspace; `plan_info`, the 18 numbers its `run` takes
    (grid, those offsets, the partial output and LSE offsets in the float workspace); `int_bytes`, the int
    workspace's used size. Build with `work_layout`."""

    num_sm: int
    cluster_size: int
    offsets: tuple[int, ...]
    plan_info: tuple[int, ...]
    int_bytes: int

    @property
    def num_clusters(self) -> int:
        return self.num_sm // self.cluster_size

    @property
    def buffer_entries(self) -> int:
        """int32 entries of a work buffer: FlashInfer's arrays, then two arrays of scratch (works' costs and
        clusters) that the launch uses while it assigns works."""
        return self.int_bytes // 4 + 2 * MAX_WORKS

    def verify(self, flashinfer_plan_info: Sequence[int]) -> Optional[str]:
        """None if FlashInfer's own scheduler returned this plan info (same grid and offsets), else why not."""
        theirs = tuple(int(x) for x in flashinfer_plan_info)
        if theirs == self.plan_info:
            return None
        return f"FlashInfer's MLA plan info {theirs} differs from the device work list's {self.plan_info}"


def work_layout(num_sm: int, cs: int, head_dim_o: int, o_bytes: int = 2) -> WorkLayout:
    """The layout FlashInfer 0.6.6's `MLAPlan` gives on a GPU of `num_sm` multiprocessors at cluster size
    `cs`, for outputs of `head_dim_o` channels of `o_bytes` bytes: each array aligned to 16 bytes, in
    `WORK_ARRAYS` order; partial outputs for `2 * clusters * 64 * cs` rows at offset 0 of the float
    workspace, then their LSEs.
    Example: num_sm 132, cs 2, head_dim_o 512 -> offsets (0, 65536, 131072, 196608, 197136, ..., 526928),
    plan_info (2, 66, 0, 65536, ..., 526928, 0, 17301504), int_bytes 592464."""
    offsets, end = [], 0
    for _, kind in WORK_ARRAYS:
        end = _align16(end)
        offsets.append(end)
        end += 4 * (MAX_WORKS if kind == "work" else num_sm)
    clusters, tile_q = num_sm // cs, CTA_TILE_Q * cs
    partial_o = 2 * clusters * tile_q * o_bytes * head_dim_o
    info = (cs, clusters, *offsets, 0, _align16(partial_o))
    return WorkLayout(num_sm, cs, tuple(offsets), info, end)


def tiles_per_request(q_len: int, num_heads: int, cs: int) -> int:
    """Query tiles of one request: ceil(q_len * num_heads / (64 * cs)). Example: 4 drafts, 128 heads,
    cs 2 -> 4."""
    return -(-(q_len * num_heads) // (CTA_TILE_Q * cs))


def fits(bs: int, q_len: int, num_heads: int, layout: WorkLayout, max_tiles: int = 8) -> bool:
    """Whether the device work list serves this step: at most `max_tiles` query tiles a request (decode,
    verify and draft steps; long prefills keep FlashInfer's scheduler) and room for every work (a tile
    splits into at most clusters + tiles works in all; cluster ids fit a byte)."""
    t = tiles_per_request(q_len, num_heads, layout.cluster_size)
    return bs >= 1 and t <= max_tiles and bs * t + layout.num_clusters + 1 <= MAX_WORKS and layout.num_clusters < 256


@triton.jit
def _chunk_limit(x):
    """FlashInfer's rounding of the per-cluster key share x (int64) into the chunk limit."""
    return tl.where(
        x <= 8, 32, tl.where(x <= 16, 64, tl.where(x <= 32, 128, tl.where(x <= 64, 192, tl.cdiv(x, 256) * 256)))
    )


@triton.jit
def _request_keys(
    blk,
    bs,
    raw_before,
    REQ_POOL_INDICES,
    KV_LENS,
    num_rows,
    width,
    capacity,
    PAGE_SIZE: tl.constexpr,
    E_BLOCK: tl.constexpr,
):
    """Requests blk .. blk + E_BLOCK - 1: (index, live, first page id's offset, keys the ids describe,
    the uncut id count up to the block's end), as `write_request_ids` writes them."""
    i = blk + tl.arange(0, E_BLOCK)
    ok = i < bs
    rows = tl.load(REQ_POOL_INDICES + i, mask=ok, other=0)
    lens = tl.load(KV_LENS + i, mask=ok, other=0)
    _, _, length = keys_in_table(rows, lens * 0, lens, num_rows, width)
    cnt = tl.where(ok, id_count(length, PAGE_SIZE), 0)
    pre = raw_before + tl.cumsum(cnt, 0) - cnt
    beg = tl.minimum(pre, capacity)
    count = tl.minimum(pre + cnt, capacity) - beg
    return i, ok, beg, tl.minimum(length, count * PAGE_SIZE), raw_before + tl.sum(cnt, 0)


@triton.jit
def _tile(
    kv_len,
    q_len,
    num_heads,
    lim,
    t: tl.constexpr,
    NT: tl.constexpr,
    CTQ: tl.constexpr,
    CS: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Tile t of each request: (keys, works, split, rows, merge entries, rows per merge entry)."""
    if CAUSAL and t + 1 < NT:
        eff = tl.maximum(tl.minimum(kv_len - q_len + tl.cdiv((t + 1) * CTQ, num_heads), kv_len), 0)
    else:
        eff = kv_len
    split = eff > lim
    works = tl.where(split, tl.cdiv(eff, lim), 1).to(tl.int32)
    rows = tl.minimum(CTQ, q_len * num_heads - t * CTQ)
    per_entry = tl.cdiv(rows, tl.maximum(eff.to(tl.int64) * CS // lim, 1)).to(tl.int32)
    return eff, works, split, rows, tl.cdiv(rows, per_entry), per_entry


@triton.jit
def _emit(
    bs,
    q_len,
    num_heads,
    lim,
    REQ_POOL_INDICES,
    KV_LENS,
    num_rows,
    width,
    capacity,
    WORKS,
    NC: tl.constexpr,
    NUM_SM: tl.constexpr,
    NT: tl.constexpr,
    CTQ: tl.constexpr,
    CS: tl.constexpr,
    CAUSAL: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    E_BLOCK: tl.constexpr,
    MAX_W: tl.constexpr,
    SCR_COST: tl.constexpr,
    SCR_CLUSTER: tl.constexpr,
    Q_INDPTR: tl.constexpr,
    KV_INDPTR: tl.constexpr,
    PARTIAL: tl.constexpr,
    M_START: tl.constexpr,
    M_END: tl.constexpr,
    MP_START: tl.constexpr,
    MP_END: tl.constexpr,
    M_STRIDE: tl.constexpr,
    Q_LEN: tl.constexpr,
    KV_LEN: tl.constexpr,
    Q_START: tl.constexpr,
    KV_START: tl.constexpr,
    KV_END: tl.constexpr,
    WORK_INDPTR: tl.constexpr,
    PHASE: tl.constexpr,
):
    """Walk the works in their order (request by request, tile by tile, chunk by chunk; w = 0, 1, ...).
    PHASE 0: write work w's cost at SCR_COST + w. PHASE 1: write work w's fields at its place in its
    cluster's list (cluster from SCR_CLUSTER + w, place `work_indptr[cluster] + w // NC`: round w // NC
    of the assignment gave the cluster one work), and the merge entries. Returns (the work count, the merge
    entry count)."""
    w_run = tl.sum(tl.zeros([E_BLOCK], tl.int32), 0)
    p_run = w_run
    m_run = w_run
    raw = w_run
    for blk in range(0, bs, E_BLOCK):
        i, ok, beg, kv_len, raw = _request_keys(
            blk, bs, raw, REQ_POOL_INDICES, KV_LENS, num_rows, width, capacity, PAGE_SIZE, E_BLOCK
        )
        w_req = tl.zeros([E_BLOCK], tl.int32)
        p_req = tl.zeros([E_BLOCK], tl.int32)
        m_req = tl.zeros([E_BLOCK], tl.int32)
        for k in tl.static_range(NT):
            eff, works, split, rows, entries, _ = _tile(kv_len, q_len, num_heads, lim, NT - 1 - k, NT, CTQ, CS, CAUSAL)
            w_req += works
            p_req += tl.where(split, works * rows, 0)
            m_req += tl.where(split, entries, 0)
        w_req = tl.where(ok, w_req, 0)
        p_req = tl.where(ok, p_req, 0)
        m_req = tl.where(ok, m_req, 0)
        w0 = w_run + tl.cumsum(w_req, 0) - w_req
        p0 = p_run + tl.cumsum(p_req, 0) - p_req
        m0 = m_run + tl.cumsum(m_req, 0) - m_req
        q_row = i * q_len
        for k in tl.static_range(NT):
            t = NT - 1 - k
            eff, works, split, rows, entries, per_entry = _tile(kv_len, q_len, num_heads, lim, t, NT, CTQ, CS, CAUSAL)
            for j in range(0, tl.max(tl.where(ok, works, 0), 0)):
                w = w0 + j
                st = ok & (j < works) & (w < MAX_W)
                kv_lo = (j * lim).to(tl.int32)
                kv_hi = tl.minimum(kv_lo + lim, eff).to(tl.int32)
                if PHASE == 0:
                    tl.store(WORKS + SCR_COST + w, 2 * CTQ + kv_hi - kv_lo, mask=st)
                else:
                    c = tl.load(WORKS + SCR_CLUSTER + w, mask=st, other=0)
                    st = st & (c >= 0) & (c < NC)
                    at = tl.load(WORKS + WORK_INDPTR + c, mask=st, other=0) + w // NC
                    st = st & (at >= 0) & (at < MAX_W)  # never outside the arrays, whatever the scratch held
                    tl.store(WORKS + Q_INDPTR + at, q_row, mask=st)
                    tl.store(WORKS + KV_INDPTR + at, beg, mask=st)
                    tl.store(WORKS + PARTIAL + at, tl.where(split, p0 + j * rows, -1), mask=st)
                    tl.store(WORKS + Q_LEN + at, q_len + w * 0, mask=st)
                    tl.store(WORKS + KV_LEN + at, kv_len, mask=st)
                    tl.store(WORKS + Q_START + at, t * CTQ + w * 0, mask=st)
                    tl.store(WORKS + KV_START + at, kv_lo, mask=st)
                    tl.store(WORKS + KV_END + at, kv_hi, mask=st)
            if PHASE == 1:
                base = q_row * num_heads + t * CTQ
                for e in range(0, tl.max(tl.where(ok & split, entries, 0), 0)):
                    m = m0 + e
                    st = ok & split & (e < entries) & (m < NUM_SM)
                    tl.store(WORKS + M_START + m, base + e * per_entry, mask=st)
                    tl.store(WORKS + M_END + m, base + tl.minimum((e + 1) * per_entry, rows), mask=st)
                    tl.store(WORKS + MP_START + m, p0 + e * per_entry, mask=st)
                    tl.store(WORKS + MP_END + m, p0 + works * rows, mask=st)
                    tl.store(WORKS + M_STRIDE + m, rows + m * 0, mask=st)
            w0 += works
            p0 += tl.where(split, works * rows, 0)
            m0 += tl.where(split, entries, 0)
        w_run += tl.sum(w_req, 0)
        p_run += tl.sum(p_req, 0)
        m_run += tl.sum(m_req, 0)
    return w_run, m_run


@triton.jit
def _schedule(
    bs,
    q_len,
    num_heads,
    REQ_POOL_INDICES,
    KV_LENS,
    num_rows,
    width,
    capacity,
    WORKS,
    NC: tl.constexpr,
    NUM_SM: tl.constexpr,
    NT: tl.constexpr,
    CTQ: tl.constexpr,
    CS: tl.constexpr,
    CAUSAL: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    E_BLOCK: tl.constexpr,
    NC_BLOCK: tl.constexpr,
    SM_BLOCK: tl.constexpr,
    MAX_W: tl.constexpr,
    SCR_COST: tl.constexpr,
    SCR_CLUSTER: tl.constexpr,
    Q_INDPTR: tl.constexpr,
    KV_INDPTR: tl.constexpr,
    PARTIAL: tl.constexpr,
    M_START: tl.constexpr,
    M_END: tl.constexpr,
    MP_START: tl.constexpr,
    MP_END: tl.constexpr,
    M_STRIDE: tl.constexpr,
    Q_LEN: tl.constexpr,
    KV_LEN: tl.constexpr,
    Q_START: tl.constexpr,
    KV_START: tl.constexpr,
    KV_END: tl.constexpr,
    WORK_INDPTR: tl.constexpr,
):
    """The work list (module doc) into WORKS (int32; array offsets in int32 entries; SCR_COST /
    SCR_CLUSTER: MAX_W entries each of scratch past FlashInfer's arrays)."""
    # pass 1: every tile's keys -> the chunk limit
    total = tl.sum(tl.zeros([E_BLOCK], tl.int64), 0)
    raw = tl.sum(tl.zeros([E_BLOCK], tl.int32), 0)
    for blk in range(0, bs, E_BLOCK):
        i, ok, beg, kv_len, raw = _request_keys(
            blk, bs, raw, REQ_POOL_INDICES, KV_LENS, num_rows, width, capacity, PAGE_SIZE, E_BLOCK
        )
        for k in tl.static_range(NT):
            eff, _, _, _, _, _ = _tile(kv_len, q_len, num_heads, 1, NT - 1 - k, NT, CTQ, CS, CAUSAL)
            total += tl.sum(tl.where(ok, eff, 0).to(tl.int64), 0)
    lim = _chunk_limit(tl.maximum(tl.cdiv(total, NC), 1))
    # pass 2: every work's cost, in order, and the number of works
    n_works, _ = _emit(
        bs,
        q_len,
        num_heads,
        lim,
        REQ_POOL_INDICES,
        KV_LENS,
        num_rows,
        width,
        capacity,
        WORKS,
        NC,
        NUM_SM,
        NT,
        CTQ,
        CS,
        CAUSAL,
        PAGE_SIZE,
        E_BLOCK,
        MAX_W,
        SCR_COST,
        SCR_CLUSTER,
        Q_INDPTR,
        KV_INDPTR,
        PARTIAL,
        M_START,
        M_END,
        MP_START,
        MP_END,
        M_STRIDE,
        Q_LEN,
        KV_LEN,
        Q_START,
        KV_START,
        KV_END,
        WORK_INDPTR,
        0,
    )
    n_works = tl.minimum(n_works, MAX_W)
    tl.debug_barrier()
    # pass 3: rounds of NC works in order; in each, the costliest work goes to the least loaded cluster,
    # the next to the next (clusters' loads then differ by at most one work's cost; a round's works,
    # neighbours in the order, run at about the same time, so tiles of one request share their keys in L2)
    lane = tl.arange(0, NC_BLOCK)
    state = lane.to(tl.int64) + tl.where(lane < NC, 0, 1 << 60)  # (load << 8) | cluster; padding lanes last
    for r in range(0, tl.cdiv(n_works, NC)):
        g = r * NC + lane
        valid = (lane < NC) & (g < n_works)
        cost = tl.load(WORKS + SCR_COST + g, mask=valid, other=0)
        work = tl.sort(tl.where(valid, (cost.to(tl.int64) << 8) | lane, -1), descending=True)
        state = tl.sort(state)
        has = work >= 0
        tl.store(WORKS + SCR_CLUSTER + r * NC + (work & 255), (state & 255).to(tl.int32), mask=has)
        state += tl.where(has, (work >> 8) << 8, 0)
    tl.debug_barrier()
    # every cluster got one work a full round; the last round's works went to the clusters in its list
    rem = n_works % NC
    last = tl.load(WORKS + SCR_CLUSTER + (n_works - rem) + lane, mask=lane < rem, other=-1)
    got = tl.sum((last[:, None] == lane[None, :]).to(tl.int32), 0)
    tl.store(WORKS + WORK_INDPTR + lane, lane * (n_works // NC) + tl.cumsum(got, 0) - got, mask=lane <= NC)
    tl.debug_barrier()
    # pass 4: the works at their places, the merge entries
    _, m_run = _emit(
        bs,
        q_len,
        num_heads,
        lim,
        REQ_POOL_INDICES,
        KV_LENS,
        num_rows,
        width,
        capacity,
        WORKS,
        NC,
        NUM_SM,
        NT,
        CTQ,
        CS,
        CAUSAL,
        PAGE_SIZE,
        E_BLOCK,
        MAX_W,
        SCR_COST,
        SCR_CLUSTER,
        Q_INDPTR,
        KV_INDPTR,
        PARTIAL,
        M_START,
        M_END,
        MP_START,
        MP_END,
        M_STRIDE,
        Q_LEN,
        KV_LEN,
        Q_START,
        KV_START,
        KV_END,
        WORK_INDPTR,
        1,
    )
    # merge entries past the step's: none (the kernel's CTAs past them merge nothing)
    s = tl.arange(0, SM_BLOCK)
    unused = (s >= m_run) & (s < NUM_SM)
    tl.store(WORKS + M_START + s, s * 0, mask=unused)
    tl.store(WORKS + M_END + s, s * 0, mask=unused)
    tl.store(WORKS + MP_START + s, s * 0, mask=unused)
    tl.store(WORKS + MP_END + s, s * 0, mask=unused)
    tl.store(WORKS + M_STRIDE + s, s * 0, mask=unused)


#: the same numbers as Triton constants (globals a kernel reads must be)
_MAX_W = tl.constexpr(MAX_WORKS)
_E_BLOCK = tl.constexpr(E_BLOCK)
_CHUNK = tl.constexpr(CHUNK)


# No value or alignment specialization, few constexprs (each is an argument of every launch): the array
# offsets follow from NUM_SM in the kernel, as `work_layout` computes them on the host (in int32 entries:
# FlashInfer's work arrays hold MAX_WORKS, its merge arrays NUM_SM rounded up to 4; then the scratch).
@triton.jit(
    do_not_specialize=["stride_row", "num_rows", "width", "capacity", "num_slots", "q_len", "num_heads"],
    do_not_specialize_on_alignment=["REQ_TO_TOKEN", "REQ_POOL_INDICES", "KV_LENS", "KV_INDICES", "FAULT", "WORKS"],
)
def _page_ids_and_works_kernel(
    REQ_TO_TOKEN,
    stride_row,
    num_rows,
    width,
    REQ_POOL_INDICES,
    KV_LENS,
    KV_INDICES,
    capacity,
    num_slots,
    FAULT,
    WORKS,
    q_len,
    num_heads,
    BS_BLOCK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CHECK_SLOTS: tl.constexpr,
    HAS_FAULT: tl.constexpr,
    NUM_SM: tl.constexpr,
    NT: tl.constexpr,
    CS: tl.constexpr,
    CTQ: tl.constexpr,
    CAUSAL: tl.constexpr,
    NC_BLOCK: tl.constexpr,
    SM_BLOCK: tl.constexpr,
):
    W: tl.constexpr = _MAX_W
    A: tl.constexpr = (NUM_SM + 3) // 4 * 4
    NC: tl.constexpr = NUM_SM // CS
    M0: tl.constexpr = 3 * W
    L0: tl.constexpr = 5 * A
    r = tl.program_id(0)
    bs = tl.num_programs(0) - 1
    if r < bs:
        write_request_ids(
            r,
            tl.program_id(1),
            tl.num_programs(1),
            REQ_TO_TOKEN,
            stride_row,
            num_rows,
            width,
            REQ_POOL_INDICES,
            KV_LENS,
            KV_INDICES,
            KV_INDICES,
            KV_INDICES,
            capacity,
            KV_INDICES,
            KV_INDICES,
            KV_INDICES,
            KV_INDICES,
            num_slots,
            FAULT,
            BS_BLOCK,
            _CHUNK,
            PAGE_SIZE,
            False,
            False,
            False,
            False,
            False,
            CHECK_SLOTS,
            HAS_FAULT,
            False,
        )
    elif tl.program_id(1) == 0:
        _schedule(
            bs,
            q_len,
            num_heads,
            REQ_POOL_INDICES,
            KV_LENS,
            num_rows,
            width,
            capacity,
            WORKS,
            NC,
            NUM_SM,
            NT,
            CTQ,
            CS,
            CAUSAL,
            PAGE_SIZE,
            _E_BLOCK,
            NC_BLOCK,
            SM_BLOCK,
            W,
            9 * W + L0,
            10 * W + L0,
            0,
            W,
            2 * W,
            M0,
            M0 + A,
            M0 + 2 * A,
            M0 + 3 * A,
            M0 + 4 * A,
            M0 + L0,
            4 * W + L0,
            5 * W + L0,
            6 * W + L0,
            7 * W + L0,
            8 * W + L0,
        )


_LAUNCH = CachedLaunch(_page_ids_and_works_kernel)


class WorkLaunch:
    """One launch writing a step's page ids and its MLA work list, for one step shape, its checks and
    constexprs done once. Made for `bs` requests of `q_len` queries and `num_heads` heads at `page_size`,
    causal or not, the work list into `works` (int32, at least `layout.buffer_entries` entries) laid out
    as `layout`; slots checked when `check_slots`, refusals recorded when `has_fault`; the step must
    `fits` the layout. Called with (req_to_token, req_pool_indices `[bs]`, kv_lens `[bs]` device int32,
    ids, capacity, num_slots, fault), it writes the page ids into `ids` (`attn_core.ops.kv_indices_triton`
    semantics: at most `capacity`, slots checked against `num_slots`, refusals in `fault`) and the work list
    over them in the same launch."""

    def __init__(
        self,
        layout: WorkLayout,
        bs: int,
        q_len: int,
        num_heads: int,
        page_size: int,
        causal: bool,
        works: torch.Tensor,
        check_slots: bool,
        has_fault: bool,
    ) -> None:
        if not fits(bs, q_len, num_heads, layout):
            raise InvalidArgumentError("bs/q_len", "a step the device work list serves (mla_works.fits)", (bs, q_len))
        if works.dtype != torch.int32 or works.numel() < layout.buffer_entries:
            raise InvalidArgumentError(
                "works", f"an int32 tensor of at least {layout.buffer_entries} entries", (works.dtype, works.numel())
            )
        self.layout, self.bs, self.q_len, self.num_heads, self.works = layout, bs, q_len, num_heads, works
        self.grid = (bs + 1, copy_programs(bs, works.is_cuda))
        self.constexprs = _constexprs(
            layout, q_len, num_heads, page_size, causal, 1 << (bs - 1).bit_length(), check_slots, has_fault
        )
        self._launch = _LAUNCH.bind(self.grid, **self.constexprs)

    def __call__(
        self,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        kv_lens: torch.Tensor,
        ids: torch.Tensor,
        capacity: int,
        num_slots: Optional[int],
        fault: Optional[torch.Tensor],
    ) -> None:
        if req_pool_indices.shape[0] != self.bs:
            raise InvalidArgumentError(
                "req_pool_indices", f"{self.bs} requests (the launch's batch size)", req_pool_indices.shape[0]
            )
        self._launch(
            *table_arguments(req_to_token),
            req_pool_indices,
            kv_lens,
            ids,
            min(capacity, ids.shape[0]),
            num_slots if num_slots is not None else 0,
            fault if fault is not None else ids,
            self.works,
            self.q_len,
            self.num_heads,
        )


def _constexprs(
    layout: WorkLayout,
    q_len: int,
    num_heads: int,
    page_size: int,
    causal: bool,
    bs_block: int,
    check_slots: bool,
    has_fault: bool,
) -> dict:
    w, a = MAX_WORKS, -(-layout.num_sm // 4) * 4
    kernel = (
        0,
        w,
        2 * w,
        *(3 * w + k * a for k in range(6)),
        *(k * w + 5 * a for k in range(4, 9)),
    )  # the kernel's arithmetic
    if tuple(o // 4 for o in layout.offsets) != kernel or layout.int_bytes // 4 != 9 * w + 5 * a:
        raise InvalidArgumentError("layout", "FlashInfer 0.6.6's MLA workspace layout (work_layout)", layout.offsets)
    return dict(
        BS_BLOCK=bs_block,
        PAGE_SIZE=page_size,
        CHECK_SLOTS=check_slots,
        HAS_FAULT=has_fault,
        NUM_SM=layout.num_sm,
        NT=tiles_per_request(q_len, num_heads, layout.cluster_size),
        CS=layout.cluster_size,
        CTQ=CTA_TILE_Q * layout.cluster_size,
        CAUSAL=causal,
        NC_BLOCK=triton.next_power_of_2(layout.num_clusters + 1),
        SM_BLOCK=triton.next_power_of_2(layout.num_sm),
        num_warps=4,
    )
