"""Absorbed-MLA attention on Hopper's warpgroup MMA, written in Gluon (Triton's explicit-layout dialect):
two warpgroups that take the key tiles in turn (warp-specialized).

The same work and arguments as `mla_decode._mla_kernel` (module doc there: rows are (token, head) pairs
on M, each latent tile loaded once and used for the scores and the output, decode splits, verify with
causal or tree masks, window, logit cap, sinks, LSE, bounds and faults), plus the latent pool's TMA
descriptors (`latent_descriptors`). A program holds BLOCK_H = 64 rows and runs as two partitions of one
warpgroup (4 warps) each (`gl.warp_specialize`):

- Key tiles of BLOCK_N = 32 alternate between the warpgroups: warpgroup w owns tiles k = w, w + 2, ...
  It loads them into buffer k % 4 of four (`_load`), computes the tile's whole `[64, 32]` score block
  (q . latent^T over all kv_lora_rank + rope channels), runs the online-softmax step and publishes p,
  the new row max and the factor alpha in shared memory.
- A tile whose keys are all live and whose 32 slots are one run of contiguous slots inside the pool (any
  tile inside a page of 32 keys or more: the usual engine layout) comes by TMA, two copies (its nope and
  rope columns) issued by one thread; any other tile (a range's last one, pages of 1 or 16, slots outside
  the pool) is gathered by cp.async by slot, keys past the range and slots outside the pool zero-filled,
  the latter raising the SLOT fault. The result does not depend on which; only the speed does: a gather
  costs its warpgroup ~300 instructions a tile, on the softmax chain.
- The `[64, kv_lora_rank]` float32 output is split by columns: warpgroup w accumulates columns
  [w R / 2, (w + 1) R / 2) over every tile, its own and the other's (p . latent[:, its columns]).
- The softmax steps form one chain (tile k's max starts from tile k - 1's), alternating between the
  warpgroups; while one runs its step, the other's tensor-core work runs: the scores of its next tile
  (issued before it waits for the other's p) and its output updates.
- Row sums are kept per warpgroup (each adds its own tiles' p, both apply every alpha) and summed once.

Per tile k, by its owner w (buffer b = k % 4):

    scores = q_nope . nope[b]^T + q_rope . rope[b]^T       [64, 32]   (issued during tile k - 1)
    m, p, alpha = softmax step from tile k - 1's max        -> shared memory, p_ready[w]
    acc_w = acc_w * alpha + p . nope[b][:, w's columns]     [64, R/2]  (both warpgroups, each its half)

Synchronisation (mbarriers, one arrive per warpgroup): p_ready[w], warpgroup w published a tile (phase
(k // 2) & 1); kv_free[b], the non-owner finished reading buffer b (the owner then loads tile k + 4
into it, phase (k // 4) & 1); landed[b], tile k is in buffer b (the expect of a TMA tile's bytes, or a
gather's arrive once every thread's copies land; phase (k // 4) & 1); l_ready[0], both row sums stored;
l_ready[1], q landed (the program gathers it by cp.async in warpgroup 0's threads, under that
warpgroup's first tile). Each warpgroup starts loading its tile k + 3 while the other runs tile k + 1's
softmax, two steps before its scores need it (its slots read a step earlier still). An odd tile count
ends with one tile of keys past s_hi (zero-filled, fully masked: p = 0, alpha = 1).

Shared memory at DeepSeek's 512 + 64 (bf16): q 72 KiB, four 32-key buffers 144 KiB; a tile's p
(`[64, 32]`, 4 KiB) is written over its rope columns (`[32, 64]`, read only by its scores) when rope is
64, otherwise into a ring of its own.

Two ptxas rules shape the code: a warpgroup MMA must not be in flight while another one's accumulator is
written by other instructions, nor across a loop back edge coming out of an own tile (either makes ptxas
serialize every warpgroup MMA of the kernel, `test_triton_compile_sm90.py` checks it); hence the score
MMA's accumulator is a dead tensor rather than fresh zeros, and warpgroup 1 takes tile 0 before its loop.

Requires compute capability 9.x, q / latent in bfloat16 or float16, kv_lora_rank a power of two in
64..512 and rope one in 16..64 (`mla_decode.uses_wgmma`), a pool TMA can read (`common.tma_compatible`);
launched with num_warps 4 (the default partition; the worker adds 4) under `MLAConfig.wgmma`.
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
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from attn_triton.kernels.common import softmax_terms
from attn_triton.kernels.decode import one_split_result
from attn_triton.kernels.gluon_gather import (
    box_slots,
    checked_rows,
    cta_barrier,
    gather_to_shared,
    pool_descriptor,
    reinterpret_shared,
    slot_runs,
    tma_load,
)
from attn_triton.kernels.mla_common import request_keys, tile_scores

#: cp.async gather layout: 8 threads a row (64 channels = 128 bytes), 16 rows a pass
_LOAD = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
#: a tile's 32 slots one a lane, the same in every warp: the TMA check (`slot_runs`) reduces within a warp
_SLOTS = gl.constexpr(gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0]))
#: keys of a tile (`mla_decode.WGMMA_BLOCK_N`), the rows of the descriptors' boxes
TILE_KEYS = 32


def latent_descriptors(kv_buf: torch.Tensor, kv_lora_rank: int) -> tuple:
    """The TMA descriptors of the latent pool for `mla_wgmma_kernel`: `kv_buf` `[slots, 1, kv_lora_rank + rope]`
    (each slot's row contiguous, `common.tma_compatible`) seen as `[slots, kv_lora_rank + rope]`, one in boxes of
    a tile's nope columns (TILE_KEYS slots x kv_lora_rank channels), one of its rope columns (TILE_KEYS x rope,
    from column kv_lora_rank); `gluon_gather.pool_descriptor`. Made once per launch.

    Example: a bf16 pool `[8192, 1, 576]`, kv_lora_rank 512 -> two descriptors of shape [8192, 576], strides
    [576, 1], blocks [32, 512] and [32, 64]; the kernel copies the tile whose slots are s .. s + 31 from
    coordinates [s, 0] and [s, 512]."""
    rope = kv_buf.shape[-1] - kv_lora_rank
    return pool_descriptor(kv_buf, TILE_KEYS, kv_lora_rank), pool_descriptor(kv_buf, TILE_KEYS, rope)


@gluon.jit
def _gather_tile(KV, rows, ok, nope_buf, rope_buf, RANK: gl.constexpr, ROPE: gl.constexpr):
    """Start the cp.async gather of one tile's latent rows (element offsets `rows` from KV; rows not `ok`
    zero-filled) into one buffer, as one commit group."""
    # offsets summed before the pointer is formed: `KV + cols` would be loop-invariant, hoisted out of the
    # tile loop and held (32 addresses a thread)
    r2 = rows[:, None]
    ok2 = ok[:, None]
    gather_to_shared(nope_buf, KV + (r2 + gl.arange(0, RANK, layout=gl.SliceLayout(0, _LOAD))[None, :]), mask=ok2)
    if ROPE == 64:
        gather_to_shared(
            rope_buf, KV + (r2 + (RANK + gl.arange(0, ROPE, layout=gl.SliceLayout(0, _LOAD)))[None, :]), mask=ok2
        )
    else:  # narrower rope: a layout of its own width (no thread copies an element twice)
        ROPE_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (ROPE // 8), ROPE // 8], [4, 1], [1, 0])
        rows_r = gl.convert_layout(rows, gl.SliceLayout(1, ROPE_LOAD))
        ok_r = gl.convert_layout(ok, gl.SliceLayout(1, ROPE_LOAD))
        cols_r = RANK + gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROPE_LOAD))
        gather_to_shared(rope_buf, KV + (rows_r[:, None] + cols_r[None, :]), mask=ok_r[:, None])
    async_copy.commit_group()


@gluon.jit
def _tile_plan(KV_INDICES, kv_beg, start, s_hi, num_slots, BLOCK_N: gl.constexpr):
    """How keys [start, start + BLOCK_N) come in (`_load`): (their slots `[1, BLOCK_N]` in `_SLOTS`, 0 at or
    past s_hi; the first slot; whether TMA brings the tile: every key live and the slots one run of
    contiguous slots inside the pool, as in a page of BLOCK_N keys or more). Read a step before the load,
    so that the index load's latency stays off the softmax chain."""
    slots = box_slots(KV_INDICES, kv_beg, start, s_hi, BLOCK_N, BLOCK_N, _SLOTS)
    first, runs = slot_runs(slots, num_slots, BLOCK_N)
    return slots, gl.max(first, 0), runs & (start + BLOCK_N <= s_hi)


@gluon.jit
def _load(
    KV,
    NOPE_DESC,
    ROPE_DESC,
    FAULT,
    slots,
    first,
    by_tma,
    start,
    s_hi,
    num_slots,
    stride_ks,
    nope_buf,
    rope_buf,
    landed,
    BLOCK_N: gl.constexpr,
    RANK: gl.constexpr,
    ROPE: gl.constexpr,
):
    """Start bringing the tile of keys [start, start + BLOCK_N) (`_tile_plan`) into a buffer; `landed`
    completes when it is in. By TMA if `by_tma`: two copies, the nope and rope columns of slots first ..
    first + BLOCK_N - 1 (`latent_descriptors`). Else by the cp.async gather (a counted arrive a thread, made
    when its copies land, then the one expected arrive): a key at or past s_hi is not read, nor one whose
    slot is outside [0, num_slots), which also raises the SLOT fault (its row is then zero-filled and the
    key scores q . 0 = 0 rather than being left out: the step is reported bad)."""
    if by_tma:
        mbarrier.expect(landed, BLOCK_N * (RANK + ROPE) * nope_buf.dtype.primitive_bitwidth // 8)
        tma_load(NOPE_DESC, [first, 0], landed, nope_buf)
        tma_load(ROPE_DESC, [first, RANK], landed, rope_buf)
    else:
        slot = gl.convert_layout(
            gl.sum(slots, 0), gl.SliceLayout(1, _LOAD)
        )  # [1, BLOCK_N] -> [BLOCK_N], the gather's rows
        n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _LOAD))
        rows, ok = checked_rows(slot, n < s_hi, FAULT, num_slots, stride_ks)
        _gather_tile(KV, rows, ok, nope_buf, rope_buf, RANK, ROPE)
        async_copy.mbarrier_arrive(landed)  # adds one pending arrive a thread, made when its copies land
        mbarrier.arrive(landed)


@gluon.jit
def _start_scores(qn_s, qr_s, nope_buf, rope_buf, spent):
    """Issue scores = q_nope . nope^T + q_rope . rope^T of one tile `[BLOCK_H, BLOCK_N]` (async: a
    `warpgroup_mma_wait` gives them). `spent`: a dead `[BLOCK_H, BLOCK_N]` tensor of the scores' layout
    whose registers take the result (not read: a fresh zero tensor would be written while the other
    MMA is in flight, which makes ptxas serialize every warpgroup MMA of the kernel)."""
    qk = warpgroup_mma(qn_s, nope_buf.permute((1, 0)), spent, use_acc=False, is_async=True)
    return warpgroup_mma(qr_s, rope_buf.permute((1, 0)), qk, is_async=True)


@gluon.jit
def _p_buf(rope_s, p_s, b, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, P_IN_ROPE: gl.constexpr):
    """Where tile b's p `[BLOCK_H, BLOCK_N]` lives: over the tile's rope columns (`[BLOCK_N, 64]`, the same
    bytes, no longer read once its scores are done) or in a ring of its own."""
    if P_IN_ROPE:
        P_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], rope_s.dtype)
        return reinterpret_shared(rope_s.index(b), [BLOCK_H, BLOCK_N], P_SMEM)
    else:
        return p_s.index(b)


@gluon.jit
def _own_tile(
    k,
    scores,
    acc,
    m_i,
    l_i,
    W: gl.constexpr,
    nope_s,
    rope_s,
    p_s,
    m_s,
    a_s,
    p_ready,
    kv_free,
    MASK,
    t,
    row_ok,
    q_pos,
    s_lo,
    s_hi,
    mask_beg,
    kv_len,
    mask_size,
    qk_scale,
    cap_scale,
    window,
    s_scale,
    Q_LEN: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HALF: gl.constexpr,
    USE_MASK: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    LOGIT_CAP: gl.constexpr,
    P_IN_ROPE: gl.constexpr,
    S_L: gl.constexpr,
    O_L: gl.constexpr,
):
    """Warpgroup W's own tile k (buffer k % 4; scores `[BLOCK_H, BLOCK_N]` float32, waited): the softmax step
    from the running max m_i after tile k - 1, p / max / alpha published (p_ready[W]), then, once this
    warpgroup's update from the other's tile k - 1 is done (kv_free of that buffer), the output rescaled
    and p . latent[:, W's columns] issued. Returns (acc in flight, m, l)."""
    dtype: gl.constexpr = nope_s.dtype
    n = s_lo + k * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    sc = tile_scores(
        scores,
        n,
        n < s_hi,
        t,
        row_ok,
        q_pos,
        mask_beg,
        kv_len,
        MASK,
        mask_size,
        qk_scale,
        cap_scale,
        window,
        Q_LEN,
        USE_MASK,
        HAS_WINDOW,
        LOGIT_CAP,
    )
    m_new, l_i, alpha, p = softmax_terms(m_i, l_i, sc, s_scale, True)
    b = k % 4
    p_buf = _p_buf(rope_s, p_s, b, BLOCK_H, BLOCK_N, P_IN_ROPE)
    p_buf.store(p.to(dtype))
    m_s.index(W).store(m_new)
    a_s.index(W).store(alpha)
    fence_async_shared()
    cta_barrier()  # this warpgroup's p, max and alpha are all stored
    mbarrier.arrive(p_ready.index(W))
    o = warpgroup_mma_wait(0, deps=[acc])
    if k > 0:
        mbarrier.arrive(kv_free.index((k - 1) % 4))  # done reading the other's tile k - 1
    o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
    acc = warpgroup_mma(p_buf, nope_s.index(b).slice(W * HALF, HALF, dim=1), o, is_async=True)
    return acc, m_new, l_i


@gluon.jit
def _other_tile(
    k,
    acc,
    l_i,
    spent,
    W: gl.constexpr,
    qn_s,
    qr_s,
    nope_s,
    rope_s,
    p_s,
    m_s,
    a_s,
    p_ready,
    kv_free,
    landed,
    KV,
    NOPE_DESC,
    ROPE_DESC,
    KV_INDICES,
    FAULT,
    kv_beg,
    s_lo,
    s_hi,
    num_slots,
    stride_ks,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    RANK: gl.constexpr,
    ROPE: gl.constexpr,
    HALF: gl.constexpr,
    P_IN_ROPE: gl.constexpr,
    S_L: gl.constexpr,
    O_L: gl.constexpr,
):
    """The other warpgroup's tile k, seen from warpgroup W (its own output update of tile k - 1 in flight):
    issue the scores of W's next tile k + 1 once it has landed and read the slots of its tile k + 3, wait
    for tile k's p, start loading tile k + 3 into the buffer of tile k - 1 (once both warpgroups are done
    with it; `_load`), then take tile k's alpha and issue p . latent[:, W's columns]. `spent`: a dead
    scores tensor (the score MMA's accumulator, `_start_scores`). Returns (acc in flight, m, l, W's scores
    of tile k + 1)."""
    b1 = (k + 1) % 4
    mbarrier.wait(landed.index(b1), ((k + 1) // 4) & 1)
    fence_async_shared()  # a gathered tile's copies, before the MMA reads them
    qk = _start_scores(qn_s, qr_s, nope_s.index(b1), rope_s.index(b1), spent)
    start3 = s_lo + (k + 3) * BLOCK_N
    slots3, first3, tma3 = _tile_plan(KV_INDICES, kv_beg, start3, s_hi, num_slots, BLOCK_N)
    mbarrier.wait(p_ready.index(1 - W), (k // 2) & 1)
    m_i = m_s.index(1 - W).load(gl.SliceLayout(1, S_L))
    l_i = l_i * a_s.index(1 - W).load(gl.SliceLayout(1, S_L))
    o = warpgroup_mma_wait(1, deps=[acc])  # own output update of tile k - 1 (issued before the scores) done
    b3 = (k + 3) % 4
    if k > 0:  # the other warpgroup finished reading tile k - 1 (this buffer's last tile)
        mbarrier.wait(kv_free.index(b3), ((k - 1) // 4) & 1)
    _load(
        KV,
        NOPE_DESC,
        ROPE_DESC,
        FAULT,
        slots3,
        first3,
        tma3,
        start3,
        s_hi,
        num_slots,
        stride_ks,
        nope_s.index(b3),
        rope_s.index(b3),
        landed.index(b3),
        BLOCK_N,
        RANK,
        ROPE,
    )
    scores = warpgroup_mma_wait(0, deps=[qk])
    o = o * a_s.index(1 - W).load(gl.SliceLayout(1, O_L))[:, None]
    b = k % 4
    acc = warpgroup_mma(
        _p_buf(rope_s, p_s, b, BLOCK_H, BLOCK_N, P_IN_ROPE),
        nope_s.index(b).slice(W * HALF, HALF, dim=1),
        o,
        is_async=True,
    )
    return acc, m_i, l_i, scores


@gluon.jit
def _warpgroup(
    W: gl.constexpr,
    qn_s,
    qr_s,
    nope_s,
    rope_s,
    p_s,
    m_s,
    a_s,
    l_s,
    kv_free,
    landed,
    p_ready,
    l_ready,
    KV,
    NOPE_DESC,
    ROPE_DESC,
    KV_INDICES,
    MASK,
    SINKS,
    FAULT,
    OUT,
    LSE,
    PART_O,
    PART_LSE,
    kv_beg,
    s_lo,
    s_hi,
    kv_len,
    q_len,
    q_beg,
    mask_beg,
    hb,
    r,
    s,
    num_slots,
    mask_size,
    num_heads,
    qk_scale,
    cap_scale,
    v_scale,
    window,
    stride_ks,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    Q_LEN: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    RANK: gl.constexpr,
    ROPE: gl.constexpr,
    SPLIT: gl.constexpr,
    USE_MASK: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    LOGIT_CAP: gl.constexpr,
    HAS_SINK: gl.constexpr,
    STORE_LSE: gl.constexpr,
    P_IN_ROPE: gl.constexpr,
):
    """Warpgroup W's part of a program (module doc): its own tiles k = W, W + 2, ... and its output columns."""
    HALF: gl.constexpr = RANK // 2
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)

    offs_m = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_S)
    t = offs_m // num_heads
    row_ok = (offs_m < Q_LEN * num_heads) & (t < q_len)
    q_pos = kv_len - q_len + t
    if LOGIT_CAP:
        s_scale = 1.0
    else:
        s_scale = qk_scale

    # tiles are taken in pairs (warpgroup 0's, then 1's), at least one; an odd count ends with an empty
    # tile (all keys past s_hi: zero-filled, fully masked, p = 0 and alpha = 1)
    n_pairs = gl.maximum(gl.cdiv(gl.cdiv(s_hi - s_lo, BLOCK_N), 2), 1)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
    l_i = gl.zeros([BLOCK_H], gl.float32, ROW_S)
    acc = warpgroup_mma_init(gl.zeros([BLOCK_H, HALF], gl.float32, O_L))
    slots, first, by_tma = _tile_plan(KV_INDICES, kv_beg, s_lo + W * BLOCK_N, s_hi, num_slots, BLOCK_N)
    _load(
        KV,
        NOPE_DESC,
        ROPE_DESC,
        FAULT,
        slots,
        first,
        by_tma,
        s_lo + W * BLOCK_N,
        s_hi,
        num_slots,
        stride_ks,
        nope_s.index(W),
        rope_s.index(W),
        landed.index(W),
        BLOCK_N,
        RANK,
        ROPE,
    )
    if W == 0:
        async_copy.wait_group(0)
        fence_async_shared()
        cta_barrier()
        mbarrier.arrive(l_ready.index(1))  # q (copied by these threads, waited above) is in shared memory
        mbarrier.wait(landed.index(0), 0)
        fence_async_shared()
        qk = _start_scores(qn_s, qr_s, nope_s.index(0), rope_s.index(0), gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L))
        slots, first, by_tma = _tile_plan(KV_INDICES, kv_beg, s_lo + 2 * BLOCK_N, s_hi, num_slots, BLOCK_N)
        _load(
            KV,
            NOPE_DESC,
            ROPE_DESC,
            FAULT,
            slots,
            first,
            by_tma,
            s_lo + 2 * BLOCK_N,
            s_hi,
            num_slots,
            stride_ks,
            nope_s.index(2),
            rope_s.index(2),
            landed.index(2),
            BLOCK_N,
            RANK,
            ROPE,
        )
        scores = warpgroup_mma_wait(0, deps=[qk])
        for u in range(n_pairs):
            acc, m_i, l_i = _own_tile(
                2 * u,
                scores,
                acc,
                m_i,
                l_i,
                W,
                nope_s,
                rope_s,
                p_s,
                m_s,
                a_s,
                p_ready,
                kv_free,
                MASK,
                t,
                row_ok,
                q_pos,
                s_lo,
                s_hi,
                mask_beg,
                kv_len,
                mask_size,
                qk_scale,
                cap_scale,
                window,
                s_scale,
                Q_LEN,
                BLOCK_H,
                BLOCK_N,
                HALF,
                USE_MASK,
                HAS_WINDOW,
                LOGIT_CAP,
                P_IN_ROPE,
                S_L,
                O_L,
            )
            acc, m_i, l_i, scores = _other_tile(
                2 * u + 1,
                acc,
                l_i,
                scores,
                W,
                qn_s,
                qr_s,
                nope_s,
                rope_s,
                p_s,
                m_s,
                a_s,
                p_ready,
                kv_free,
                landed,
                KV,
                NOPE_DESC,
                ROPE_DESC,
                KV_INDICES,
                FAULT,
                kv_beg,
                s_lo,
                s_hi,
                num_slots,
                stride_ks,
                BLOCK_H,
                BLOCK_N,
                RANK,
                ROPE,
                HALF,
                P_IN_ROPE,
                S_L,
                O_L,
            )
    else:
        mbarrier.wait(l_ready.index(1), 0)  # q, gathered by warpgroup 0's threads
        # tile 0 (the other's) before the loop, so that no output update is in flight across the loop's
        # back edge coming out of an own tile (ptxas would then serialize every warpgroup MMA)
        acc, m_i, l_i, scores = _other_tile(
            0,
            acc,
            l_i,
            gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L),
            W,
            qn_s,
            qr_s,
            nope_s,
            rope_s,
            p_s,
            m_s,
            a_s,
            p_ready,
            kv_free,
            landed,
            KV,
            NOPE_DESC,
            ROPE_DESC,
            KV_INDICES,
            FAULT,
            kv_beg,
            s_lo,
            s_hi,
            num_slots,
            stride_ks,
            BLOCK_H,
            BLOCK_N,
            RANK,
            ROPE,
            HALF,
            P_IN_ROPE,
            S_L,
            O_L,
        )
        for u in range(n_pairs - 1):
            acc, m_i, l_i = _own_tile(
                2 * u + 1,
                scores,
                acc,
                m_i,
                l_i,
                W,
                nope_s,
                rope_s,
                p_s,
                m_s,
                a_s,
                p_ready,
                kv_free,
                MASK,
                t,
                row_ok,
                q_pos,
                s_lo,
                s_hi,
                mask_beg,
                kv_len,
                mask_size,
                qk_scale,
                cap_scale,
                window,
                s_scale,
                Q_LEN,
                BLOCK_H,
                BLOCK_N,
                HALF,
                USE_MASK,
                HAS_WINDOW,
                LOGIT_CAP,
                P_IN_ROPE,
                S_L,
                O_L,
            )
            acc, m_i, l_i, scores = _other_tile(
                2 * u + 2,
                acc,
                l_i,
                scores,
                W,
                qn_s,
                qr_s,
                nope_s,
                rope_s,
                p_s,
                m_s,
                a_s,
                p_ready,
                kv_free,
                landed,
                KV,
                NOPE_DESC,
                ROPE_DESC,
                KV_INDICES,
                FAULT,
                kv_beg,
                s_lo,
                s_hi,
                num_slots,
                stride_ks,
                BLOCK_H,
                BLOCK_N,
                RANK,
                ROPE,
                HALF,
                P_IN_ROPE,
                S_L,
                O_L,
            )
        acc, m_i, l_i = _own_tile(
            2 * n_pairs - 1,
            scores,
            acc,
            m_i,
            l_i,
            W,
            nope_s,
            rope_s,
            p_s,
            m_s,
            a_s,
            p_ready,
            kv_free,
            MASK,
            t,
            row_ok,
            q_pos,
            s_lo,
            s_hi,
            mask_beg,
            kv_len,
            mask_size,
            qk_scale,
            cap_scale,
            window,
            s_scale,
            Q_LEN,
            BLOCK_H,
            BLOCK_N,
            HALF,
            USE_MASK,
            HAS_WINDOW,
            LOGIT_CAP,
            P_IN_ROPE,
            S_L,
            O_L,
        )
    o = warpgroup_mma_wait(0, deps=[acc])
    async_copy.wait_group(0)  # loads issued past the last tile (zero-fills) land before the program ends

    # row sums: this warpgroup's plus the other's
    l_s.index(W).store(l_i)
    cta_barrier()
    mbarrier.arrive(l_ready.index(0))
    mbarrier.wait(l_ready.index(0), 0)
    l_i = l_i + l_s.index(1 - W).load(ROW_S)

    has = l_i > 0.0
    inv = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
    lse2 = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
    offs_mo = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_O)
    to = offs_mo // num_heads
    ho = offs_mo % num_heads
    row_ok_o = (offs_mo < Q_LEN * num_heads) & (to < q_len)
    ok_o = row_ok_o[:, None]
    co = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, O_L))
    out = o * gl.convert_layout(inv, ROW_O)[:, None]
    if SPLIT:
        po = PART_O + r.to(gl.int64) * stride_pb + ho[:, None] * stride_ph + s * stride_ps + co[None, :]
        gl.store(po, out, mask=ok_o)
        if W == 0:
            h = offs_m % num_heads
            gl.store(PART_LSE + r.to(gl.int64) * stride_lb + h * stride_lh + s, lse2, mask=row_ok)
    else:
        res, lse_e = one_split_result(out, gl.convert_layout(lse2, ROW_O), SINKS, ho, row_ok_o, v_scale, HAS_SINK)
        o_rows = OUT + (q_beg + to).to(gl.int64)[:, None] * stride_ot + ho[:, None] * stride_oh
        gl.store(o_rows + co[None, :], res.to(OUT.dtype.element_ty), mask=ok_o)
        if STORE_LSE and W == 0:
            gl.store(LSE + (q_beg + to).to(gl.int64) * stride_lt + ho, lse_e, mask=row_ok_o)


@gluon.jit
def mla_wgmma_kernel(
    Q,
    KV,
    OUT,
    LSE,
    PART_O,
    PART_LSE,
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
    min_split_len,
    max_splits,
    qk_scale,
    cap_scale,
    v_scale,
    window,
    num_heads,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    Q_LEN: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    RANK: gl.constexpr,
    BLOCK_R: gl.constexpr,
    ROPE: gl.constexpr,
    BLOCK_ROPE: gl.constexpr,
    SPLIT: gl.constexpr,
    USE_MASK: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    LOGIT_CAP: gl.constexpr,
    HAS_SINK: gl.constexpr,
    STORE_LSE: gl.constexpr,
    DOT_PREC: gl.constexpr,
    LAZY: gl.constexpr,
    NOPE_DESC,
    ROPE_DESC,
):
    gl.static_assert(BLOCK_H == 64, "one warpgroup MMA row block")
    gl.static_assert(BLOCK_N == 32, "32-key tiles in four buffers")
    gl.static_assert(BLOCK_R == RANK, "kv_lora_rank a power of two")
    gl.static_assert(BLOCK_ROPE == ROPE, "rope a power of two")
    gl.static_assert(LAZY == 0, "rescales on every tile")
    dtype: gl.constexpr = KV.dtype.element_ty
    NOPE_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    ROPE_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (ROPE // 8), ROPE // 8], [4, 1], [1, 0])
    NOPE_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, RANK], dtype)
    ROPE_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dtype)
    QN_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, RANK], dtype)
    QR_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], dtype)
    P_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)
    ROWS_SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    hb = gl.program_id(0)  # the row blocks of a request run side by side and share its latent rows in L2
    r = gl.program_id(1)
    s = gl.program_id(2)
    q_beg, q_len, kv_beg, kv_len, mask_beg, s_lo, s_hi, n_split = request_keys(
        QO_INDPTR,
        KV_INDPTR,
        MASK_INDPTR,
        FAULT,
        r,
        (hb == 0) & (s == 0),
        s,
        num_tokens,
        num_indices,
        mask_size,
        min_split_len,
        max_splits,
        window,
        Q_LEN,
        USE_MASK,
        HAS_WINDOW,
        SPLIT,
        BLOCK_N,
    )
    if s < n_split:
        offs_mq = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, NOPE_LOAD))
        tq = offs_mq // num_heads
        q_ok = (offs_mq < Q_LEN * num_heads) & (tq < q_len)
        q_rows = Q + (q_beg + tq).to(gl.int64) * stride_qt + (offs_mq % num_heads) * stride_qh
        cq = gl.arange(0, RANK, layout=gl.SliceLayout(0, NOPE_LOAD))
        qn_s = gl.allocate_shared_memory(dtype, [BLOCK_H, RANK], QN_SMEM)
        gather_to_shared(qn_s, q_rows[:, None] + cq[None, :], mask=q_ok[:, None])
        offs_mr = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ROPE_LOAD))
        tr = offs_mr // num_heads
        qr_ok = (offs_mr < Q_LEN * num_heads) & (tr < q_len)
        qr_rows = Q + (q_beg + tr).to(gl.int64) * stride_qt + (offs_mr % num_heads) * stride_qh + RANK
        cr = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROPE_LOAD))
        qr_s = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], QR_SMEM)
        gather_to_shared(qr_s, qr_rows[:, None] + cr[None, :], mask=qr_ok[:, None])
        # q lands under warpgroup 0's first tile (its copies: the default partition's threads)
        async_copy.commit_group()
        nope_s = gl.allocate_shared_memory(dtype, [4, BLOCK_N, RANK], NOPE_SMEM)
        rope_s = gl.allocate_shared_memory(dtype, [4, BLOCK_N, ROPE], ROPE_SMEM)
        P_IN_ROPE: gl.constexpr = ROPE == BLOCK_H  # a tile's p `[BLOCK_H, BLOCK_N]` fits its rope columns
        if P_IN_ROPE:
            p_s = rope_s
        else:
            p_s = gl.allocate_shared_memory(dtype, [4, BLOCK_H, BLOCK_N], P_SMEM)
        m_s = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], ROWS_SMEM)
        a_s = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], ROWS_SMEM)
        l_s = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], ROWS_SMEM)
        kv_free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        landed = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        l_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # [0] row sums, [1] q landed
        for i in gl.static_range(4):
            mbarrier.init(kv_free.index(i), count=1)
            mbarrier.init(landed.index(i), count=1)  # the expect of a TMA tile's bytes, or a gather's last arrive
        for i in gl.static_range(2):
            mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(l_ready.index(0), count=2)
        mbarrier.init(l_ready.index(1), count=1)
        fence_async_shared()
        cta_barrier()
        # (the partitions' arguments written out in the call: a tuple built first would turn the constexprs into
        # tensors)
        gl.warp_specialize(
            [
                (
                    _warpgroup,
                    (
                        0,
                        qn_s,
                        qr_s,
                        nope_s,
                        rope_s,
                        p_s,
                        m_s,
                        a_s,
                        l_s,
                        kv_free,
                        landed,
                        p_ready,
                        l_ready,
                        KV,
                        NOPE_DESC,
                        ROPE_DESC,
                        KV_INDICES,
                        MASK,
                        SINKS,
                        FAULT,
                        OUT,
                        LSE,
                        PART_O,
                        PART_LSE,
                        kv_beg,
                        s_lo,
                        s_hi,
                        kv_len,
                        q_len,
                        q_beg,
                        mask_beg,
                        hb,
                        r,
                        s,
                        num_slots,
                        mask_size,
                        num_heads,
                        qk_scale,
                        cap_scale,
                        v_scale,
                        window,
                        stride_ks,
                        stride_ot,
                        stride_oh,
                        stride_lt,
                        stride_pb,
                        stride_ph,
                        stride_ps,
                        stride_lb,
                        stride_lh,
                        Q_LEN,
                        BLOCK_H,
                        BLOCK_N,
                        RANK,
                        ROPE,
                        SPLIT,
                        USE_MASK,
                        HAS_WINDOW,
                        LOGIT_CAP,
                        HAS_SINK,
                        STORE_LSE,
                        P_IN_ROPE,
                    ),
                ),
                (
                    _warpgroup,
                    (
                        1,
                        qn_s,
                        qr_s,
                        nope_s,
                        rope_s,
                        p_s,
                        m_s,
                        a_s,
                        l_s,
                        kv_free,
                        landed,
                        p_ready,
                        l_ready,
                        KV,
                        NOPE_DESC,
                        ROPE_DESC,
                        KV_INDICES,
                        MASK,
                        SINKS,
                        FAULT,
                        OUT,
                        LSE,
                        PART_O,
                        PART_LSE,
                        kv_beg,
                        s_lo,
                        s_hi,
                        kv_len,
                        q_len,
                        q_beg,
                        mask_beg,
                        hb,
                        r,
                        s,
                        num_slots,
                        mask_size,
                        num_heads,
                        qk_scale,
                        cap_scale,
                        v_scale,
                        window,
                        stride_ks,
                        stride_ot,
                        stride_oh,
                        stride_lt,
                        stride_pb,
                        stride_ph,
                        stride_ps,
                        stride_lb,
                        stride_lh,
                        Q_LEN,
                        BLOCK_H,
                        BLOCK_N,
                        RANK,
                        ROPE,
                        SPLIT,
                        USE_MASK,
                        HAS_WINDOW,
                        LOGIT_CAP,
                        HAS_SINK,
                        STORE_LSE,
                        P_IN_ROPE,
                    ),
                ),
            ],
            [4],  # the worker: warpgroup 1 (warpgroup 0 is the default partition, the kernel's num_warps 4)
            [248],  # its registers; the default partition takes 256 (128 x 256 + 128 x 248 <= 64 Ki)
        )
