"""Extend attention on Hopper's warpgroup MMA, written in Gluon (Triton's explicit-layout dialect): two
consumer warpgroups share the K/V tiles of one 128-row query block, which a producer partition brings in by
TMA. The SM90 default with 128-key tiles (`ExtendConfig.wgmma_block_n`, `config.extend_config`;
docs/dev/perf-notebook.md, "The Hopper extend kernel with a producer partition and TMA").

The same work and arguments as `extend._extend_kernel` (module doc there), plus the TMA descriptors of the
K and V pools (`kv_descriptors`), for the launches it takes (`extend.uses_wgmma`: 16-bit q and cache,
head_dim = v_head_dim of 64 or 128, no rope split, no shared K/V, no custom mask). Program (hb, mb, r) owns
128 query rows of request r: HEADS q heads of one KV head (`extend.packed_heads`: 4 for GQA 32/8) times
128 / HEADS new tokens (block mb, from the last, the longest under a causal mask), row i being token
i // HEADS, head i % HEADS, so every K/V tile loaded serves HEADS heads. Three partitions
(`gl.warp_specialize`):

- consumers, warpgroups 0 and 1 (4 warps each): warpgroup w owns rows [64 w, 64 w + 64) whole: their row
  max, row sum and `[64, D]` float32 output;
- the producer (4 warps): every tile's K and V rows. It reads a tile's slots a tile ahead, as boxes of
  TMA_BOX keys. A tile whose keys are all live and whose boxes are each one run of contiguous slots inside
  the pool (pages of TMA_BOX keys or a multiple, the usual engine layout) comes by TMA: a copy per box and
  64 channels (`_tma_tile`). Any other tile (the last one of a range, with keys past it; slots that do not
  run; slots outside the pool) is gathered by cp.async by slot, keys past the range and slots outside the
  pool zero-filled, the latter raising the SLOT fault (`_gather_kv`). So the result never depends on the
  page size or on how the engine placed the keys; only the speed does. With CLEAN
  (`ExtendConfig.wgmma_clean_masked`), a tile holding keys some rows of the block do not see (the causal
  diagonal, a window's edge) is gathered, and every key of it whose V holds an Inf or NaN gets V = 0 and K =
  NaN before the tile is released (`_clean_and_release`): the consumers multiply a masked key's V by p = 0, so 0 x
  Inf = NaN would otherwise reach rows that must not see it, while a row that does see the key still gets a
  non-finite output (its NaN score). Compiled for sm_90 (Triton 3.6 and 3.9): the consumers' code is
  unchanged (no spills, no permutes); the producer's clean loop spills 40-48 bytes.

Key tiles of BLOCK_N keys run through STAGES buffers (tile t in buffer t % STAGES). Tiles before the
causal diagonal (or the whole range without a causal mask) take no masks. Per tile t (t >= 1), each
consumer:

    scores_t = q_w . K_t^T        [64, BLOCK_N]  issued (q from shared memory)
    acc += p_{t-1} . V_{t-1}      [64, D]        issued (p from registers)
    wait scores_t; masks, online-softmax step -> p_t, alpha_t   (meant to run under the output update)
    wait the update; acc *= alpha_t

As compiled (ptxas, Triton 3.6 and 3.9), the step does not overlap the update: ptxas reuses the registers of
the update's operand p_{t-1} for the step's temporaries (or for p_t) and so waits for the update first; the
other consumer's MMAs fill the tensor cores meanwhile (docs/dev/perf-notebook.md, "The Hopper extend kernel: the operand
conversion and the producer's box coordinates").

Synchronisation (mbarriers): k_ready[b] / v_ready[b], one arrive (the producer's expect of a TMA tile's
bytes, or its arrive once a gathered tile's copies land), phase (t // STAGES) & 1; k_free[b] / v_free[b],
one arrive per consumer when its scores / output update of the buffer's tile are done.

Shared memory (bf16, D = 128): q 32 KiB, each stage 2 x BLOCK_N x 256 bytes (64 keys: 32 KiB; 4 stages,
160 KiB). Requires compute capability 9.x; launched with num_warps 4 (the default partition: consumer 0;
the workers add 8).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from attn_triton.kernels.common import (
    FAULT_KEY_OFFSETS,
    FAULT_QUERY_ROWS,
    TMA_BOX,
    key_ranges,
    offset_range,
    scale_scores,
    softmax_terms,
)
from attn_triton.kernels.decode import one_split_result
from attn_triton.kernels.gluon_gather import (
    box_slots,
    checked_rows,
    cta_barrier,
    gather_to_shared,
    page_descriptor,
    pool_descriptor,
    reinterpret_shared,
    slot_runs,
    tma_load,
)

#: query rows of a program: one warpgroup MMA's 64 rows for each of the two consumer warpgroups
WGMMA_BLOCK_M = 128
# TMA_BOX (`common`): keys one TMA copy brings, a run of contiguous slots (pages of 16 keys, or a multiple, give
# whole runs)
#: channels one TMA copy brings: 128 bytes of 16-bit values, the width of the buffers' 128-byte swizzle
TMA_CHANNELS = 64
#: registers a thread the kernel's 3 warpgroups share: 168 a thread x 384 threads launched with
REGISTER_POOL = 3 * 168


def producer_regs(consumer_regs: int) -> int:
    """Registers a thread of the producer partition when each consumer warpgroup takes `consumer_regs`
    (`ExtendConfig.wgmma_regs`): what the pool leaves, REGISTER_POOL - 2 x consumer_regs (consumer 0, the
    default partition, gets what the workers leave, the same as consumer 1). Example: 224 -> 56 (128 x 224 x 2
    + 128 x 56 = 64512), 216 -> 72, 208 -> 88 (the SM90 default, `config.extend_config_for`)."""
    return REGISTER_POOL - 2 * consumer_regs


def kv_descriptors(k_buf: torch.Tensor, v_buf: torch.Tensor) -> tuple:
    """(K descriptor, V descriptor, their row arguments) of one layer's K and V buffers for
    `extend_wgmma_kernel`, in boxes of TMA_BOX keys x TMA_CHANNELS channels, made once per launch: an NHD pool
    `[slots, Hkv, D]` (`common.tma_compatible`: D contiguous, heads `stride(1)` apart) seen as `[slots, row]`
    (`gluon_gather.pool_descriptor`; its row arguments 0: rows are slots, a head's column its head stride), a
    page-major buffer `[pages, Hkv, page_size, D]` as its rows (`gluon_gather.page_descriptor`; the kernel's
    `rows_kp` / `rows_kh` / `cols_kh`, `..._v...` for V, from its `common.PageGeometry`).

    Example: a bf16 K pool `[4096, 8, 128]` -> a descriptor of shape [4096, 1024], strides [1024, 1], block
    [16, 64]; the kernel copies box (slot s, KV head h, half c) from coordinates [s, stride(1) h + 64 c] =
    [s, 128 h + 64 c] (K and V side by side, `[4096, 8, 256][:, :, :128]`: [s, 256 h + 64 c]); an HND
    `[256, 8, 16, 128]` -> shape [32768, 128], rows_kp 128, rows_kh 16, cols_kh 0: box (s, h, c) at
    [(s // 16) * 128 + 16 h + s % 16, 64 c]."""
    descriptors, args = [], {}
    for buf, x in ((k_buf, "k"), (v_buf, "v")):
        if buf.dim() == 4 and buf.shape[2] > 1:
            desc, g = page_descriptor(buf, TMA_BOX, TMA_CHANNELS)
            rows_page, rows_head, cols_head = g.rows_page, g.rows_head, g.cols_head
        else:
            desc, rows_page, rows_head, cols_head = pool_descriptor(buf, TMA_BOX, TMA_CHANNELS), 0, 0, 0
        descriptors.append(desc)
        args.update({f"rows_{x}p": rows_page, f"rows_{x}h": rows_head, f"cols_{x}h": cols_head})
    return descriptors[0], descriptors[1], args


@gluon.jit
def _rows(mb, h, W: gl.constexpr, BLOCK_M: gl.constexpr, HEADS: gl.constexpr, L: gl.constexpr):
    """(new token, q head) `[BLOCK_M // 2]` each, in layout L, of warpgroup W's rows of block mb whose first
    q head is h: block row i is token mb * (BLOCK_M // HEADS) + i // HEADS of head h + i % HEADS.

    Worked example: BLOCK_M 128, HEADS 4, mb 2, h 8, W 1 -> rows 64..127: tokens 80, 80, 80, 80, 81, ...,
    95 and heads 8, 9, 10, 11, 8, ..., 11."""
    r = W * (BLOCK_M // 2) + gl.arange(0, BLOCK_M // 2, layout=L)
    return mb * (BLOCK_M // HEADS) + r // HEADS, h + r % HEADS


@gluon.jit
def _gather(buf, BASE, rows, ok, D: gl.constexpr, L: gl.constexpr):
    """Start the cp.async copy of rows `rows` (element offsets from BASE, `[R]`; rows not `ok` zero-filled)
    of D channels into `buf` `[R, D]`, as one commit group."""
    gather_to_shared(
        buf, BASE + (rows[:, None] + gl.arange(0, D, layout=gl.SliceLayout(0, L))[None, :]), mask=ok[:, None]
    )
    async_copy.commit_group()


@gluon.jit
def _box_rows(first, row, rows_page, PAGE: gl.constexpr):
    """The descriptor row of each box of a tile (`first`: the boxes' first slots, `[NB]`, every box one run
    inside one page): the slot itself (PAGE 1: rows are slots, the KV head a column offset), or (first // PAGE)
    rows_page + row + first % PAGE in a page-major buffer (`kv_descriptors`: `row` the KV head's row offset).
    Example: PAGE 16, rows_page 256, row 32: slots [48, 0] -> rows [3 * 256 + 32, 32] = [800, 32]."""
    if PAGE > 1:
        return (first // PAGE) * rows_page + row + first % PAGE
    return first


@gluon.jit
def _tma_tile(
    chunks,
    b,
    t,
    free,
    ready,
    DESC,
    rows,
    col,
    BLOCK_N: gl.constexpr,
    D: gl.constexpr,
    STAGES: gl.constexpr,
    BOX: gl.constexpr,
):
    """Bring the K or V rows of tile t into buffer b by TMA, once its last tile is free: box j of every
    64-channel half c (`chunks`: the buffers as `[STAGES * D / 64, BLOCK_N, 64]`) from the descriptor's
    coordinates [rows[j], col + 64 c] (`_box_rows`; `col` the KV head's column offset); `ready` completes when
    the tile's bytes land. `rows` `[NB]` is held whole by every thread (the producer's `BOXES` layout), so
    picking box j's row is a register read, not a reduction across lanes."""
    NB: gl.constexpr = BLOCK_N // BOX
    CH: gl.constexpr = D // 64
    jb = gl.arange(0, NB, layout=rows.type.layout)
    mbarrier.wait(free.index(b), (gl.maximum(t - STAGES, 0) // STAGES) & 1, pred=t >= STAGES)
    mbarrier.expect(ready.index(b), BLOCK_N * D * chunks.dtype.primitive_bitwidth // 8)
    for j in gl.static_range(NB):
        r_j = gl.sum(gl.where(jb == j, rows, 0), 0)
        for c in gl.static_range(CH):
            tma_load(DESC, [r_j, col + 64 * c], ready.index(b), chunks.index(b * CH + c).slice(j * BOX, BOX))


@gluon.jit
def _gather_kv(
    k_s,
    v_s,
    b,
    t,
    k_free,
    v_free,
    K_HEAD,
    V_HEAD,
    KV_INDICES,
    FAULT,
    kv_beg,
    start,
    hi,
    num_slots,
    stride_ks,
    stride_vs,
    stride_kp,
    stride_vp,
    BLOCK_N: gl.constexpr,
    D: gl.constexpr,
    STAGES: gl.constexpr,
    PAGE: gl.constexpr,
):
    """Start the cp.async copies of the K and V rows of tile t (keys [start, start + BLOCK_N)) into buffer b,
    by slot, once its last tile is free: a key at or past hi is not read, nor one whose slot is outside [0,
    num_slots), which also raises the SLOT fault; their rows are zero-filled. Two commit groups. Slot s's row
    (from the KV head's K_HEAD / V_HEAD): s * stride_ks (PAGE 1), or (s // PAGE) * stride_kp + (s % PAGE) *
    stride_ks in a page-major buffer (`common.kv_rows`)."""
    # 32 channels (four 16-byte copies) a thread, D / 32 threads a row
    LD: gl.constexpr = gl.BlockedLayout([1, 32], [32 // (D // 32), D // 32], [4, 1], [1, 0])
    ph = (gl.maximum(t - STAGES, 0) // STAGES) & 1
    n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
    live = n < hi
    slot = gl.load(KV_INDICES + kv_beg + n, mask=live, other=0)
    rows, ok = checked_rows(slot, live, FAULT, num_slots, stride_ks)
    s = gl.where(ok, slot, 0).to(gl.int64)
    if PAGE > 1:
        rows = (s // PAGE) * stride_kp + (s % PAGE) * stride_ks
        v_rows = (s // PAGE) * stride_vp + (s % PAGE) * stride_vs
    else:
        v_rows = s * stride_vs
    mbarrier.wait(k_free.index(b), ph, pred=t >= STAGES)
    _gather(k_s.index(b), K_HEAD, rows, ok, D, LD)
    mbarrier.wait(v_free.index(b), ph, pred=t >= STAGES)
    _gather(v_s.index(b), V_HEAD, v_rows, ok, D, LD)


@gluon.jit
def _release_landed(k_ready, v_ready, b):
    """Release gathered tile b (`_gather_kv`): `k_ready` / `v_ready` complete when every thread's copies have
    landed (a counted cp.async arrive each, then the one expected arrive)."""
    async_copy.mbarrier_arrive(k_ready.index(b))  # adds one pending arrive a thread, made when its copies land
    async_copy.mbarrier_arrive(v_ready.index(b))
    mbarrier.arrive(k_ready.index(b))
    mbarrier.arrive(v_ready.index(b))


@gluon.jit
def _clean_and_release(k_s, v_s, b, k_ready, v_ready, BLOCK_N: gl.constexpr, D: gl.constexpr):
    """Gathered tile b, whose keys some rows do not see (CLEAN): once every copy of the partition has landed,
    each key whose V holds an Inf or NaN gets V = 0 and K = NaN, then the tile is released. A row that does not
    see the key masks its score to -inf (p = 0 times V = 0 adds nothing, where 0 x Inf was NaN); a row that sees
    it gets a NaN score, so its output is NaN as the reference's is not finite (NaN, its LSE too: `_warpgroup`'s
    epilogue with CLEAN). Keys of 16 at a time (16 registers a thread), stored back only where one is bad."""
    CH: gl.constexpr = 16
    LC: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [4, 1], [1, 0])
    async_copy.wait_group(0)
    cta_barrier()  # every producer thread's copies have landed
    # an Inf or NaN: every exponent bit set (bf16 0x7F80, fp16 0x7C00), read on the raw 16 bits
    if v_s.dtype == gl.bfloat16:
        EXP: gl.constexpr = 0x7F80
    else:
        EXP: gl.constexpr = 0x7C00
    for c in gl.static_range(BLOCK_N // CH):
        v = v_s.index(b).slice(c * CH, CH).load(LC)
        bits = v.to(gl.int16, bitcast=True).to(gl.int32)
        bad = gl.max(((bits & EXP) == EXP).to(gl.int32), 1) > 0
        if gl.max(bad.to(gl.int32), 0) > 0:
            v_s.index(b).slice(c * CH, CH).store(gl.where(bad[:, None], gl.zeros_like(v), v))
            k = k_s.index(b).slice(c * CH, CH).load(LC)
            k_s.index(b).slice(c * CH, CH).store(gl.where(bad[:, None], gl.full_like(k, float("nan")), k))
    fence_async_shared()
    cta_barrier()  # every producer thread's stores are done before the one arrive releases the tile
    mbarrier.arrive(k_ready.index(b))
    mbarrier.arrive(v_ready.index(b))


@gluon.jit
def _producer(
    k_s,
    v_s,
    k_ready,
    v_ready,
    k_free,
    v_free,
    K_DESC,
    V_DESC,
    K_HEAD,
    V_HEAD,
    KV_INDICES,
    FAULT,
    kv_beg,
    lo,
    hi,
    q_len,
    kv_len,
    mb,
    window,
    num_slots,
    col_k,
    col_v,
    row_k,
    row_v,
    rows_kp,
    rows_vp,
    stride_ks,
    stride_vs,
    stride_kp,
    stride_vp,
    BLOCK_N: gl.constexpr,
    D: gl.constexpr,
    STAGES: gl.constexpr,
    BOX: gl.constexpr,
    TOKENS: gl.constexpr,
    CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    CLEAN: gl.constexpr,
    PAGE: gl.constexpr,
):
    """The producer partition (module doc): tiles 0 .. n_tiles - 1 of keys [lo, hi) (one tile at least: with
    no keys it is zero-filled) into buffers t % STAGES, by TMA or by the gather; with CLEAN, a tile holding a
    key outside [seen_from, seen_to), the keys every row of block mb sees, is gathered and cleaned
    (`_clean_and_release`; the bounds from the consumers' own arguments: no value of the kernel's is kept
    live for them)."""
    # a tile's slots `[BLOCK_N // BOX, BOX]`: the boxes along the lanes of every warp, a box's slots across the 4
    # warps, so the run check crosses warps once a tile while each of the tile's 2 x BLOCK_N // BOX box coordinates
    # (`_tma_tile`) is picked within a warp (boxes across warps: a shared-memory round trip and two barriers each;
    # 3-5 % of the extend rows, docs/dev/perf-notebook.md)
    S2: gl.constexpr = gl.BlockedLayout([1, 1], [BLOCK_N // BOX, 32 // (BLOCK_N // BOX)], [1, 4], [1, 0])
    # the boxes' first slots / rows `[BLOCK_N // BOX]` held whole by every thread of the 4 warps (`_tma_tile`)
    BOXES: gl.constexpr = gl.BlockedLayout([BLOCK_N // BOX], [32], [4], [0])
    CHUNKS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], k_s.dtype)
    k_c = reinterpret_shared(k_s, [STAGES * (D // 64), BLOCK_N, 64], CHUNKS)
    v_c = reinterpret_shared(v_s, [STAGES * (D // 64), BLOCK_N, 64], CHUNKS)
    n_tiles = gl.maximum(gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N), 1)
    seen_from, seen_to = lo, hi
    if CLEAN:
        row0 = kv_len - q_len + mb * TOKENS  # the block's first row's position among the request's keys
        if CAUSAL:
            seen_to = row0 + 1  # that row sees keys up to its own position
        if HAS_WINDOW:
            seen_from = gl.maximum(row0 + TOKENS - window, lo)  # the block's last row's oldest key
    slots = box_slots(KV_INDICES, kv_beg, lo, hi, BLOCK_N, BOX, S2)
    for t in range(n_tiles):
        b = t % STAGES
        start = lo + t * BLOCK_N
        nxt = box_slots(KV_INDICES, kv_beg, start + BLOCK_N, hi, BLOCK_N, BOX, S2)
        first, runs = slot_runs(slots, num_slots, BOX, PAGE)  # a page-major buffer's boxes: within one page
        by_tma = (start + BLOCK_N <= hi) & runs
        if CLEAN:  # a tile holding keys some rows do not see is gathered and cleaned
            dirty = (start < seen_from) | (gl.minimum(start + BLOCK_N, hi) > seen_to)
            by_tma = by_tma & ~dirty
        if by_tma:
            if PAGE > 1:  # one exchange a tile, then every thread holds every box's row (the page arithmetic once)
                boxes = gl.convert_layout(first, BOXES)
                rows = _box_rows(boxes, row_k, rows_kp, PAGE)
                _tma_tile(k_c, b, t, k_free, k_ready, K_DESC, rows, col_k, BLOCK_N, D, STAGES, BOX)
                rows = _box_rows(boxes, row_v, rows_vp, PAGE)
                _tma_tile(v_c, b, t, v_free, v_ready, V_DESC, rows, col_v, BLOCK_N, D, STAGES, BOX)
            else:  # rows are slots: each box's picked within its warp (see S2)
                _tma_tile(k_c, b, t, k_free, k_ready, K_DESC, first, col_k, BLOCK_N, D, STAGES, BOX)
                _tma_tile(v_c, b, t, v_free, v_ready, V_DESC, first, col_v, BLOCK_N, D, STAGES, BOX)
        else:
            _gather_kv(
                k_s,
                v_s,
                b,
                t,
                k_free,
                v_free,
                K_HEAD,
                V_HEAD,
                KV_INDICES,
                FAULT,
                kv_beg,
                start,
                hi,
                num_slots,
                stride_ks,
                stride_vs,
                stride_kp,
                stride_vp,
                BLOCK_N,
                D,
                STAGES,
                PAGE,
            )
            if CLEAN:
                if dirty:
                    _clean_and_release(k_s, v_s, b, k_ready, v_ready, BLOCK_N, D)
                else:
                    _release_landed(k_ready, v_ready, b)
            else:
                _release_landed(k_ready, v_ready, b)
        slots = nxt
    async_copy.wait_group(0)  # gathered copies land before the program ends


@gluon.jit
def _scores_step(
    qk,
    n,
    m_ok,
    q_pos,
    hi,
    m_i,
    l_i,
    qk_scale,
    cap_scale,
    s_scale,
    window,
    MASKED: gl.constexpr,
    CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    LOGIT_CAP: gl.constexpr,
):
    """The online-softmax step of one tile's scores qk `[64, BLOCK_N]` (keys `n`), with MASKED the bounds,
    causal and window masks applied first (a tile every row sees whole needs none): returns (p, alpha, the
    new row max, the new row sum)."""
    if LOGIT_CAP:
        sc = scale_scores(qk, qk_scale, cap_scale, LOGIT_CAP)
    else:
        sc = qk
    if MASKED:
        ok = (n < hi)[None, :] & m_ok[:, None]
        if CAUSAL:
            ok = ok & (n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            ok = ok & (n[None, :] > q_pos[:, None] - window)
        sc = gl.where(ok, sc, float("-inf"))
    m_new, l_new, alpha, p = softmax_terms(m_i, l_i, sc, s_scale, MASKED)  # unmasked tiles: every score finite
    return p, alpha, m_new, l_new


@gluon.jit
def _mma_operand(p, dtype: gl.constexpr, P_L: gl.constexpr):
    """p `[64, BLOCK_N]` float32 (the MMA accumulator's layout) as the output update's A operand: dtype (16-bit)
    in layout P_L, rounded to nearest. Two values a register by PTX (`cvt.rn.{bf16,f16}x2.f32`, the first value in
    the low half), not by `p.to(dtype)`: LLVM folds that cast through the loop's phi, so p crossed the loop as 64
    float32 registers, and the conversion packed each pair the other way round (a PRMT a register each tile; the
    compile test checks there are none). Example: p [[1.0, 0.5, ...]] -> the same values in bf16."""
    if dtype == gl.bfloat16:
        q = gl.inline_asm_elementwise(
            "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.bfloat16, is_pure=True, pack=2
        )
    else:
        q = gl.inline_asm_elementwise(
            "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.float16, is_pure=True, pack=2
        )
    return gl.convert_layout(q, P_L)


@gluon.jit
def _tile(
    t,
    qk,
    p_op,
    o,
    m_i,
    l_i,
    q_w,
    k_s,
    v_s,
    k_ready,
    v_ready,
    k_free,
    v_free,
    lo,
    hi,
    m_ok,
    q_pos,
    qk_scale,
    cap_scale,
    s_scale,
    window,
    MASKED: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    LOGIT_CAP: gl.constexpr,
    S_L: gl.constexpr,
    P_L: gl.constexpr,
    ROW_O: gl.constexpr,
):
    """Tile t (t >= 1) of one consumer: issue its scores (into the dead `qk`), then tile t - 1's output
    update p_op . V (onto the rescaled `o`); its softmax step is placed under that update (as compiled, ptxas
    waits for the update first: module doc); then the update's result rescaled by the step's alpha. Returns
    (qk, p_op, o, m_i, l_i) for tile t + 1."""
    dtype: gl.constexpr = q_w.dtype
    b = t % STAGES
    pb = (t - 1) % STAGES
    mbarrier.wait(k_ready.index(b), (t // STAGES) & 1)
    fence_async_shared()  # a gathered tile was written through the generic proxy (no copies of this thread in flight)
    qk = warpgroup_mma(q_w, k_s.index(b).permute((1, 0)), qk, use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(pb), ((t - 1) // STAGES) & 1)
    fence_async_shared()
    acc = warpgroup_mma(p_op, v_s.index(pb), o, is_async=True)
    qk = warpgroup_mma_wait(1, deps=[qk])
    mbarrier.arrive(k_free.index(b))
    n = lo + t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    p, alpha, m_i, l_i = _scores_step(
        qk, n, m_ok, q_pos, hi, m_i, l_i, qk_scale, cap_scale, s_scale, window, MASKED, CAUSAL, HAS_WINDOW, LOGIT_CAP
    )
    o, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
    mbarrier.arrive(v_free.index(pb))
    o = o * gl.convert_layout(alpha, ROW_O)[:, None]
    p_op = _mma_operand(p, dtype, P_L)
    return qk, p_op, o, m_i, l_i


@gluon.jit
def _warpgroup(
    W: gl.constexpr,
    q_s,
    k_s,
    v_s,
    k_ready,
    v_ready,
    k_free,
    v_free,
    Q,
    OUT,
    LSE,
    SINKS,
    q_beg,
    q_len,
    kv_len,
    h,
    mb,
    lo,
    full_end,
    hi,
    qk_scale,
    cap_scale,
    v_scale,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_lt,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    D: gl.constexpr,
    STAGES: gl.constexpr,
    HEADS: gl.constexpr,
    CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    LOGIT_CAP: gl.constexpr,
    HAS_SINK: gl.constexpr,
    STORE_LSE: gl.constexpr,
    CLEAN: gl.constexpr,
):
    """Consumer warpgroup W (module doc): its 64 query rows over every tile."""
    ROWS: gl.constexpr = BLOCK_M // 2
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    COL_S: gl.constexpr = gl.SliceLayout(0, S_L)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    LD: gl.constexpr = gl.BlockedLayout([1, 32], [32 // (D // 32), D // 32], [4, 1], [1, 0])
    dtype: gl.constexpr = q_s.dtype

    # this warpgroup's query rows
    q_w = q_s.index(W)
    tok_q, head_q = _rows(mb, h, W, BLOCK_M, HEADS, gl.SliceLayout(1, LD))
    _gather(q_w, Q, (q_beg + tok_q).to(gl.int64) * stride_qt + head_q * stride_qh, tok_q < q_len, D, LD)
    async_copy.wait_group(0)
    fence_async_shared()
    cta_barrier()

    tok, _ = _rows(mb, h, W, BLOCK_M, HEADS, ROW_S)
    m_ok = tok < q_len
    q_pos = kv_len - q_len + tok
    if LOGIT_CAP:
        s_scale = 1.0
    else:
        s_scale = qk_scale
    n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)

    # tile 0 (always: with no keys it is zero-filled and fully masked, p = 0)
    mbarrier.wait(k_ready.index(0), 0)
    fence_async_shared()
    qk = warpgroup_mma(q_w, k_s.index(0).permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, S_L), use_acc=False)
    mbarrier.arrive(k_free.index(0))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, ROW_S)
    n = lo + gl.arange(0, BLOCK_N, layout=COL_S)
    l_i = gl.zeros([ROWS], gl.float32, ROW_S)
    p, alpha, m_i, l_i = _scores_step(
        qk, n, m_ok, q_pos, hi, m_i, l_i, qk_scale, cap_scale, s_scale, window, True, CAUSAL, HAS_WINDOW, LOGIT_CAP
    )
    p_op = _mma_operand(p, dtype, P_L)
    o = gl.zeros([ROWS, D], gl.float32, O_L)

    # tile t: its scores issued, then tile t - 1's output update; its softmax step is placed under that update.
    # Tiles before n_full are seen whole by every row of the block (no masks), the rest are masked
    n_full = (full_end - lo) // BLOCK_N
    for t in range(1, n_full):
        qk, p_op, o, m_i, l_i = _tile(
            t,
            qk,
            p_op,
            o,
            m_i,
            l_i,
            q_w,
            k_s,
            v_s,
            k_ready,
            v_ready,
            k_free,
            v_free,
            lo,
            hi,
            m_ok,
            q_pos,
            qk_scale,
            cap_scale,
            s_scale,
            window,
            False,
            BLOCK_N,
            STAGES,
            CAUSAL,
            HAS_WINDOW,
            LOGIT_CAP,
            S_L,
            P_L,
            ROW_O,
        )
    for t in range(gl.maximum(n_full, 1), n_tiles):
        qk, p_op, o, m_i, l_i = _tile(
            t,
            qk,
            p_op,
            o,
            m_i,
            l_i,
            q_w,
            k_s,
            v_s,
            k_ready,
            v_ready,
            k_free,
            v_free,
            lo,
            hi,
            m_ok,
            q_pos,
            qk_scale,
            cap_scale,
            s_scale,
            window,
            True,
            BLOCK_N,
            STAGES,
            CAUSAL,
            HAS_WINDOW,
            LOGIT_CAP,
            S_L,
            P_L,
            ROW_O,
        )
    lb = (gl.maximum(n_tiles, 1) - 1) % STAGES
    mbarrier.wait(v_ready.index(lb), ((gl.maximum(n_tiles, 1) - 1) // STAGES) & 1)
    fence_async_shared()
    o = warpgroup_mma(p_op, v_s.index(lb), o)

    has = l_i > 0.0
    if CLEAN:  # a row that saw a cleaned key (its NaN score): NaN output and LSE, never "no keys" (LSE -inf)
        has = has | (l_i != l_i)
    inv = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
    lse2 = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
    tok_o, head_o = _rows(mb, h, W, BLOCK_M, HEADS, ROW_O)
    ok_o = tok_o < q_len
    out = o * gl.convert_layout(inv, ROW_O)[:, None]
    res, lse_e = one_split_result(out, gl.convert_layout(lse2, ROW_O), SINKS, head_o, ok_o, v_scale, HAS_SINK)
    co = gl.arange(0, D, layout=gl.SliceLayout(0, O_L))
    o_rows = OUT + (q_beg + tok_o).to(gl.int64)[:, None] * stride_ot + head_o[:, None] * stride_oh
    gl.store(o_rows + co[None, :], res.to(OUT.dtype.element_ty), mask=ok_o[:, None])
    if STORE_LSE:
        gl.store(LSE + (q_beg + tok_o).to(gl.int64) * stride_lt + head_o, lse_e, mask=ok_o)


@gluon.jit
def extend_wgmma_kernel(
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
    GROUP: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    D: gl.constexpr,
    BLOCK_D: gl.constexpr,
    DPE: gl.constexpr,
    BLOCK_DPE: gl.constexpr,
    DV: gl.constexpr,
    BLOCK_DV: gl.constexpr,
    SHARE_KV: gl.constexpr,
    CAUSAL: gl.constexpr,
    USE_MASK: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    LOGIT_CAP: gl.constexpr,
    HAS_SINK: gl.constexpr,
    STORE_LSE: gl.constexpr,
    DOT_PREC: gl.constexpr,
    LAZY: gl.constexpr,
    STAGES: gl.constexpr,
    HEADS: gl.constexpr,
    K_DESC,
    V_DESC,
    BOX: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    CLEAN: gl.constexpr,
    PAGE: gl.constexpr,
    stride_kp,
    stride_vp,
    rows_kp,
    rows_vp,
    rows_kh,
    rows_vh,
    cols_kh,
    cols_vh,
):
    gl.static_assert(BLOCK_M == 128, "two warpgroups of 64 rows")
    gl.static_assert((D == BLOCK_D) & (DV == D) & ((D == 64) | (D == 128)), "head_dim = v_head_dim of 64 or 128")
    gl.static_assert((DPE == 0) & (not SHARE_KV) & (not USE_MASK) & (LAZY == 0), "extend.uses_wgmma")
    gl.static_assert(STAGES >= 3, "tiles t - 1 and t in use, t + 1 .. t + STAGES - 2 in flight")
    gl.static_assert((BLOCK_N % BOX == 0) & (BOX <= 32), "whole TMA boxes a tile")
    dtype: gl.constexpr = K.dtype.element_ty
    Q_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M // 2, D], dtype)
    KV_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)

    h = gl.program_id(0) * HEADS  # the program's first q head
    mb = gl.num_programs(1) - 1 - gl.program_id(1)
    r = gl.program_id(2)
    q_beg, q_len, q_clamped = offset_range(QO_INDPTR, r, num_tokens)
    kv_beg, kv_len, kv_clamped = offset_range(KV_INDPTR, r, num_indices)
    if (h == 0) & (gl.program_id(1) == 0):
        gl.store(FAULT + FAULT_QUERY_ROWS, 1, mask=q_clamped)
        gl.store(FAULT + FAULT_KEY_OFFSETS, 1, mask=kv_clamped)
    TOKENS: gl.constexpr = BLOCK_M // HEADS
    if mb * TOKENS < q_len:
        q_off = kv_len - q_len  # position of the first new token among the request's keys
        # keys [lo, full_end) seen whole by every row of the block (no masks), [full_end, hi) masked
        lo, full_end, hi = key_ranges(kv_len, q_off, mb * TOKENS, TOKENS, window, BLOCK_N, CAUSAL, HAS_WINDOW, False)
        kv_head = h // GROUP
        q_s = gl.allocate_shared_memory(dtype, [2, BLOCK_M // 2, D], Q_SMEM)
        k_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], KV_SMEM)
        v_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], KV_SMEM)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)  # the producer's expect (TMA) or last arrive (gather)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_free.index(i), count=2)  # one arrive per warpgroup
            mbarrier.init(v_free.index(i), count=2)
        fence_async_shared()
        cta_barrier()
        K_HEAD = K + kv_head * stride_kh
        V_HEAD = V + kv_head * stride_vh
        if PAGE > 1:  # a page-major buffer's descriptor: the KV head a row and a column offset (`kv_descriptors`)
            col_k, col_v, row_k, row_v = kv_head * cols_kh, kv_head * cols_vh, kv_head * rows_kh, kv_head * rows_vh
        else:  # rows are slots, the KV head a column offset
            col_k, col_v, row_k, row_v = kv_head * stride_kh, kv_head * stride_vh, 0, 0
        # (the partitions' arguments written out in the call: a tuple built first would turn the constexprs into
        # tensors)
        gl.warp_specialize(
            [
                (
                    _warpgroup,
                    (
                        0,
                        q_s,
                        k_s,
                        v_s,
                        k_ready,
                        v_ready,
                        k_free,
                        v_free,
                        Q,
                        OUT,
                        LSE,
                        SINKS,
                        q_beg,
                        q_len,
                        kv_len,
                        h,
                        mb,
                        lo,
                        full_end,
                        hi,
                        qk_scale,
                        cap_scale,
                        v_scale,
                        window,
                        stride_qt,
                        stride_qh,
                        stride_ot,
                        stride_oh,
                        stride_lt,
                        BLOCK_M,
                        BLOCK_N,
                        D,
                        STAGES,
                        HEADS,
                        CAUSAL,
                        HAS_WINDOW,
                        LOGIT_CAP,
                        HAS_SINK,
                        STORE_LSE,
                        CLEAN,
                    ),
                ),
                (
                    _warpgroup,
                    (
                        1,
                        q_s,
                        k_s,
                        v_s,
                        k_ready,
                        v_ready,
                        k_free,
                        v_free,
                        Q,
                        OUT,
                        LSE,
                        SINKS,
                        q_beg,
                        q_len,
                        kv_len,
                        h,
                        mb,
                        lo,
                        full_end,
                        hi,
                        qk_scale,
                        cap_scale,
                        v_scale,
                        window,
                        stride_qt,
                        stride_qh,
                        stride_ot,
                        stride_oh,
                        stride_lt,
                        BLOCK_M,
                        BLOCK_N,
                        D,
                        STAGES,
                        HEADS,
                        CAUSAL,
                        HAS_WINDOW,
                        LOGIT_CAP,
                        HAS_SINK,
                        STORE_LSE,
                        CLEAN,
                    ),
                ),
                (
                    _producer,
                    (
                        k_s,
                        v_s,
                        k_ready,
                        v_ready,
                        k_free,
                        v_free,
                        K_DESC,
                        V_DESC,
                        K_HEAD,
                        V_HEAD,
                        KV_INDICES,
                        FAULT,
                        kv_beg,
                        lo,
                        hi,
                        q_len,
                        kv_len,
                        mb,
                        window,
                        num_slots,
                        col_k,
                        col_v,
                        row_k,
                        row_v,
                        rows_kp,
                        rows_vp,
                        stride_ks,
                        stride_vs,
                        stride_kp,
                        stride_vp,
                        BLOCK_N,
                        D,
                        STAGES,
                        BOX,
                        TOKENS,
                        CAUSAL,
                        HAS_WINDOW,
                        CLEAN,
                        PAGE,
                    ),
                ),
            ],
            [
                4,
                4,
            ],  # the workers: consumer 1, the producer (consumer 0 is the default partition, the kernel's num_warps 4)
            [CONSUMER_REGS, PRODUCER_REGS],
        )
