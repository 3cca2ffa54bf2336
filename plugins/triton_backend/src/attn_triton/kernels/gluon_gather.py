"""What both Gluon kernels (`mla_wgmma.py`, `extend_wgmma.py`) share: Triton's Gluon names that moved between
Triton 3.6 (the GPU machine's) and 3.9, and the bounds check of a gathered tile's rows.

- `gather_to_shared(smem, pointers, mask)`: cp.async of a `[R, C]` pointer tensor into shared memory (rows
  where `mask` is false are zero-filled);
- `tma_load(desc, coords, mbarrier, smem)`: a TMA copy of one box of a tensor descriptor into shared memory,
  completing its bytes on the mbarrier;
- `reinterpret_shared(smem, shape, layout)`: the same shared memory seen with another shape and layout;
- `cta_barrier()`: a barrier of the warps that run it (inside a `gl.warp_specialize` partition, of that
  partition only);
- `checked_rows`: element offsets of key rows from their slots, with the SLOT fault;
- `box_slots` / `slot_runs`: a tile's slots in boxes of keys, and whether each box is one run of
  contiguous slots (a tile TMA can bring);
- `pool_descriptor` (host): a pool's TMA descriptor, made per launch (`page_descriptor`: of a page-major HND
  buffer).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma

from attn_core.contract.errors import InvalidArgumentError
from attn_triton.kernels.common import FAULT_SLOT, tma_page_geometry, tma_row_span

gather_to_shared = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@functools.cache
def _box_layout(rows: int, cols: int):
    """The shared-memory layout of a `[rows, cols]` box of 16-bit values (bf16 and fp16 alike), made once: it
    costs more host time than the descriptor itself."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float16)


def pool_descriptor(buf: torch.Tensor, rows: int, cols: int):
    """The TMA descriptor of a 16-bit pool `buf` `[slots, ...]` (`common.tma_compatible`) seen as `[slots,
    row]` (row: `common.tma_row_span`, a slot's first to last element), in boxes of `rows` slots x `cols`
    channels. Made per launch (a host object; Triton's launcher encodes it); a box wider than the 128-byte
    swizzle (64 channels) is copied as that many pieces by one `tma_load`.

    Example: a bf16 K pool `[4096, 8, 128]`, rows 16, cols 64 -> shape [4096, 1024], strides [1024, 1], block
    [16, 64] (the Hopper extend kernel's box of slot s, KV head h, half c is at [s, 128 h + 64 c]); the K of a
    K|V side-by-side cache `[4096, 8, 256][:, :, :128]` -> shape [4096, 1920], strides [2048, 1] (head h's
    half c at [s, 256 h + 64 c]); an MLA latent pool `[8192, 1, 576]`, rows 32, cols 512 -> shape [8192,
    576], strides [576, 1], block [32, 512]."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    row = tma_row_span(buf)
    if row is None:
        expected = "a pool TMA can read (common.tma_compatible)"
        raise InvalidArgumentError("buf", expected, (tuple(buf.shape), buf.stride()))
    return TensorDescriptor(buf, [buf.shape[0], row], [buf.stride(0), 1], [rows, cols], _box_layout(rows, cols))


def page_descriptor(buf: torch.Tensor, rows: int, cols: int) -> tuple:
    """(The TMA descriptor, its `common.PageGeometry`) of a 16-bit page-major buffer `[pages, Hkv, page_size,
    D]` (`common.tma_page_geometry`) seen as its rows (row stride: the token stride), in boxes of `rows` rows x
    `cols` channels; key (slot s, KV head h) at row (s // page_size) * rows_page + h * rows_head + s %
    page_size, column h * cols_head. Made per launch.

    Example: a contiguous bf16 HND `[6, 8, 16, 128]`, rows 16, cols 64 -> shape [768, 128], strides [128, 1],
    block [16, 64] (slot 37 of head 2 at row 2 * 128 + 2 * 16 + 5 = 293); `[6, 16, 8, 128]` (tokens of every
    head) seen as `[6, 8, 16, 128]` -> shape [96, 1024], strides [1024, 1] (slot 37 of head 2: row 37, column
    256)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    geometry = tma_page_geometry(buf, rows)
    if geometry is None:
        expected = "a page-major buffer TMA can read (common.tma_page_geometry)"
        raise InvalidArgumentError("buf", expected, (tuple(buf.shape), buf.stride()))
    shape, strides = [geometry.rows, geometry.width], [buf.stride(2), 1]
    return TensorDescriptor(buf, shape, strides, [rows, cols], _box_layout(rows, cols)), geometry


# shared_memory_descriptor.reinterpret (3.9) was _reinterpret (3.6)
_NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def reinterpret_shared(smem, shape: gl.constexpr, layout: gl.constexpr):
    """`smem` (a shared memory descriptor) seen as `shape` in `layout`, its element type kept: the same bytes,
    no copy. Example: a `[4, 64, 128]` bf16 buffer of 128-byte swizzled tiles seen as `[8, 64, 64]`, each
    tile's two 64-channel halves (`extend_wgmma.py`)."""
    if _NEW_REINTERPRET:
        return smem.reinterpret(smem.dtype, shape, layout)
    else:
        return smem._reinterpret(smem.dtype, shape, layout)


@gluon.jit
def checked_rows(slot, live, FAULT, num_slots, stride):
    """(element offsets (int64) `slot * stride` of key rows `[R]`, which rows to read): a key not `live` (past
    its range) is not read, nor one whose slot is outside [0, num_slots), which also raises the SLOT fault
    in FAULT (`attn_core.ops.device_faults`); rows not read are zero-filled by the gather.

    Worked example: slots [5, -1, 7, 0], live [T, T, T, F], num_slots 6, stride 1024 -> offsets [5120, 0,
    0, 0], read [T, F, F, F], and the SLOT fault raised (the slot -1; 7 is past the pool too)."""
    slot_ok = (slot >= 0) & (slot < num_slots)
    gl.store(FAULT + FAULT_SLOT + gl.zeros_like(slot), 1, mask=live & ~slot_ok)
    ok = live & slot_ok
    # slot * stride, never a constant in its place: the offsets stay provably 16-divisible (vector copies)
    return gl.where(ok, slot, 0).to(gl.int64) * stride, ok


@gluon.jit
def box_slots(KV_INDICES, kv_beg, start, hi, BLOCK_N: gl.constexpr, BOX: gl.constexpr, L: gl.constexpr):
    """The slots of keys [start, start + BLOCK_N) of a request (its slots from KV_INDICES + kv_beg) as
    `[BLOCK_N // BOX, BOX]` in layout L, row j holding box j (keys start + j BOX onwards), 0 at or past hi.
    The Hopper kernels read a tile's slots a step before loading it (extend: its producer, a tile ahead; MLA:
    the tile's warpgroup, a softmax step ahead), so the load's latency stays off the tile.

    Worked example: BOX 4, BLOCK_N 8, start 8, hi 14, the request's slots 100, 101, ... -> [[108, 109,
    110, 111], [112, 113, 0, 0]]."""
    j = gl.arange(0, BLOCK_N // BOX, layout=gl.SliceLayout(1, L))
    i = gl.arange(0, BOX, layout=gl.SliceLayout(0, L))
    n = start + j[:, None] * BOX + i[None, :]
    return gl.load(KV_INDICES + kv_beg + n, mask=n < hi, other=0)


@gluon.jit
def slot_runs(slots, num_slots, BOX: gl.constexpr, PAGE: gl.constexpr = 1):
    """(first slot of each box `[NB]`, whether every box of `slots` `[NB, BOX]` (`box_slots`) is one run of
    BOX contiguous slots inside the pool [0, num_slots), and with PAGE > 1 (a page-major buffer, pages of
    PAGE slots) inside one page): a tile TMA can bring box by box (`tma_load`). One reduction a tile.

    Worked example: BOX 4, num_slots 64, slots [[8, 9, 10, 11], [40, 41, 42, 43]] -> ([8, 40], True);
    [[8, 9, 11, 10], ...] -> False (not a run); [[62, 63, 64, 65], ...] -> False (past the pool); with PAGE 8,
    [[6, 7, 8, 9], ...] -> False (across a page)."""
    base = slots - gl.arange(0, BOX, layout=gl.SliceLayout(0, slots.type.layout))[None, :]
    first = gl.min(base, 1)
    ok = (gl.max(base, 1) == first) & (first >= 0) & (first <= num_slots - BOX)
    if PAGE > 1:
        ok = ok & (first % PAGE <= PAGE - BOX)
    return first, gl.min(ok.to(gl.int32), 0) == 1
