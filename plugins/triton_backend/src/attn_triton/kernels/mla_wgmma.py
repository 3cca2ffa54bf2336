"""Absorbed-MLA attention on Hopper's warpgroup MMA, written in Gluon (Triton's explicit-layout dialect).

The same work and arguments as `mla_decode._mla_kernel` (module doc there: rows are (token, head) pairs
on M, each latent tile loaded once and used for the scores and the output, decode splits, verify with
causal or tree masks, window, logit cap, sinks, LSE, bounds and faults), laid out the way Hopper runs it
best, which Triton's automatic layouts do not reach for this shape:

- 8 warps = 2 warpgroups per program of BLOCK_H = 64 rows. The `[64, 512]` float32 output accumulator is
  split by columns: warpgroup w holds columns [256 w, 256 w + 256) (128 registers a thread), so nothing
  spills.
- Scores `[64, BLOCK_N]` are split by keys: warpgroup w computes keys [w BLOCK_N / 2, ...) of the tile
  (Triton's own layout for a dot that feeds another dot puts both warpgroups on the full tile, so every
  score is computed twice). The row max crosses the two warpgroups through shared memory; row sums are
  kept per score column and summed once after the last tile.
- q (`[64, 512]` + `[64, 64]`), the latent tiles and p live in shared memory, the A and B operands of
  `warpgroup_mma`; latent tiles arrive by `cp.async` gathers (one slot per key row, any page size) in two
  buffers, tile j + 1 in flight while tile j is computed (at BLOCK_N 64 these fill Hopper's 227 KB).
- Grid `[row blocks, bs, splits]`: the row blocks of one request are neighbours in launch order, so they
  run together and read its latent rows from L2 once (with the request first, a batch of more than one
  wave read every row from DRAM once per row block).

Per key tile (buffer b):

    scores = q_nope · nope[b]^T + q_rope · rope[b]^T        [64, BLOCK_N]   (keys split across warpgroups)
    p      = online softmax of scores (lazy rescale: `mla_decode` module doc)
    acc   += p · nope[b]                                    [64, 512]       (columns split across warpgroups)

Requires compute capability 9.x, q / latent in bfloat16 or float16, kv_lora_rank and rope powers of two
(512 and 64 in DeepSeek), BLOCK_H 64 and num_warps 8; launched by `mla_decode.mla_attention` under
`MLAConfig.wgmma` (`mla_decode.uses_wgmma`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from attn_triton.kernels.common import (
    FAULT_KEY_OFFSETS,
    FAULT_MASK,
    FAULT_QUERY_ROWS,
    FAULT_SLOT,
    offset_range,
)
from attn_triton.kernels.decode import one_split_result, split_count
from attn_triton.kernels.mla_decode import tile_scores

# Gluon's names moved between Triton releases (3.6: async_copy_global_to_shared / thread_barrier; 3.9:
# async_load / barrier); the same builtins under either name
_gather_to_shared = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _tile_slots(KV_INDICES, kv_beg, start, s_hi, BLOCK_N: gl.constexpr, LAYOUT: gl.constexpr):
    """Slots (int32, as stored) of keys [start, start + BLOCK_N) in the row layout of LAYOUT's tiles; -1
    for keys at or past s_hi."""
    n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAYOUT))
    return gl.load(KV_INDICES + kv_beg + n, mask=n < s_hi, other=-1)


@gluon.jit
def _issue_tile(
    KV,
    slot_n,
    slot_r,
    num_slots,
    stride_ks,
    nope_buf,
    rope_buf,
    RANK: gl.constexpr,
    ROPE: gl.constexpr,
    NOPE_LOAD: gl.constexpr,
    ROPE_LOAD: gl.constexpr,
):
    """Start the cp.async gather of one key tile into one ring buffer: nope_buf `[BLOCK_N, RANK]`, rope_buf
    `[BLOCK_N, ROPE]`, rows from `_tile_slots` in each load layout (a slot outside [0, num_slots) is not
    read: its row is zero-filled)."""
    ok = (slot_n >= 0) & (slot_n < num_slots)
    cols = gl.arange(0, RANK, layout=gl.SliceLayout(0, NOPE_LOAD))
    _gather_to_shared(nope_buf, KV + (slot_n.to(gl.int64) * stride_ks)[:, None] + cols[None, :], mask=ok[:, None])
    ok_r = (slot_r >= 0) & (slot_r < num_slots)
    cols_r = RANK + gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROPE_LOAD))
    _gather_to_shared(rope_buf, KV + (slot_r.to(gl.int64) * stride_ks)[:, None] + cols_r[None, :], mask=ok_r[:, None])


@gluon.jit
def _qk(qn_s, qr_s, nope_buf, rope_buf, zero):
    """Start scores = q_nope · nope^T + q_rope · rope^T of one tile (async; `warpgroup_mma_wait` gives them)."""
    qk = warpgroup_mma(qn_s, nope_buf.permute((1, 0)), zero, use_acc=False, is_async=True)
    return warpgroup_mma(qr_s, rope_buf.permute((1, 0)), qk, is_async=True)


@gluon.jit
def _softmax_tile(sc, m_i, l_acc, s_scale, LAZY: gl.constexpr):
    """One online-softmax step in base 2 (logits sc * s_scale): returns (reference max, the row sums kept
    per score column `l_acc` [BLOCK_H, BLOCK_N] (summed once at the end: no cross-warpgroup sum per tile),
    p, alpha the factor the accumulator takes, moved: whether it takes it). With LAZY the reference moves
    only when some row's tile max exceeds it by more than LAZY (`mla_decode` module doc)."""
    m_tile = gl.max(sc, 1) * s_scale
    if LAZY > 0:
        grow = gl.where(m_tile > m_i, m_tile - m_i, 0.0)  # +inf for a row's first finite tile
        moved = gl.max(grow, 0) > LAZY
        m_new = gl.where(moved, gl.maximum(m_i, m_tile), m_i)
    else:
        moved = True
        m_new = gl.maximum(m_i, m_tile)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(sc * s_scale - m_use[:, None])
    return m_new, l_acc * alpha[:, None] + p, p, alpha, moved


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
):
    gl.static_assert(BLOCK_H == 64, "one warpgroup MMA row block")
    gl.static_assert(BLOCK_R == RANK, "kv_lora_rank a power of two")
    gl.static_assert(BLOCK_ROPE == ROPE, "rope a power of two")
    dtype: gl.constexpr = KV.dtype.element_ty
    # scores: keys split across the two warpgroups; output: columns split across them
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, RANK // 2, 16])
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    COL_S: gl.constexpr = gl.SliceLayout(0, S_L)
    NOPE_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    ROPE_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (ROPE // 8), ROPE // 8], [8, 1], [1, 0])
    NOPE_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, RANK], dtype)
    ROPE_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dtype)
    QN_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, RANK], dtype)
    QR_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, ROPE], dtype)
    P_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)

    hb = gl.program_id(0)  # the row blocks of a request run side by side and share its latent rows in L2
    r = gl.program_id(1)
    s = gl.program_id(2)
    first = (hb == 0) & (s == 0)
    kv_beg, kv_len, kv_clamped = offset_range(KV_INDPTR, r, num_indices)
    if Q_LEN == 1:
        q_beg = r
        q_len = 1
    else:
        q_beg, q_len, q_clamped = offset_range(QO_INDPTR, r, num_tokens)
        if first & q_clamped:
            gl.store(FAULT + FAULT_QUERY_ROWS, 1)
    if first & kv_clamped:
        gl.store(FAULT + FAULT_KEY_OFFSETS, 1)

    mask_beg = 0
    if USE_MASK:
        mask_beg = gl.load(MASK_INDPTR + r)
        mask_outside = (mask_beg < 0) | (mask_beg + q_len.to(gl.int64) * kv_len > mask_size)
        if first & mask_outside:
            gl.store(FAULT + FAULT_MASK, 1)

    lo = 0
    if HAS_WINDOW:
        lo = gl.maximum(kv_len - q_len - window + 1, 0)
    if SPLIT:
        n_split = split_count(kv_len, min_split_len, max_splits)
        per = gl.cdiv(gl.cdiv(kv_len - lo, n_split), BLOCK_N) * BLOCK_N
        s_lo = lo + s * per
        s_hi = gl.minimum(s_lo + per, kv_len)
    else:
        n_split = 1
        s_lo = lo
        s_hi = kv_len
    if s < n_split:
        # q rows into shared memory (rows past the request's tokens read as zeros and are not stored)
        offs_mq = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, NOPE_LOAD))
        tq = offs_mq // num_heads
        q_ok = (offs_mq < Q_LEN * num_heads) & (tq < q_len)
        q_rows = Q + (q_beg + tq).to(gl.int64) * stride_qt + (offs_mq % num_heads) * stride_qh
        cq = gl.arange(0, RANK, layout=gl.SliceLayout(0, NOPE_LOAD))
        q_nope = gl.load(q_rows[:, None] + cq[None, :], mask=q_ok[:, None], other=0.0)
        qn_s = gl.allocate_shared_memory(dtype, [BLOCK_H, RANK], QN_SMEM, q_nope)
        offs_mr = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ROPE_LOAD))
        tr = offs_mr // num_heads
        qr_ok = (offs_mr < Q_LEN * num_heads) & (tr < q_len)
        qr_rows = Q + (q_beg + tr).to(gl.int64) * stride_qt + (offs_mr % num_heads) * stride_qh + RANK
        cr = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROPE_LOAD))
        q_rope = gl.load(qr_rows[:, None] + cr[None, :], mask=qr_ok[:, None], other=0.0)
        qr_s = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], QR_SMEM, q_rope)
        nope_s = gl.allocate_shared_memory(dtype, [2, BLOCK_N, RANK], NOPE_SMEM)
        rope_s = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], ROPE_SMEM)
        p_s = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], P_SMEM)

        # rows of this program in the score layout: (token t, head h) pairs
        offs_m = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_S)
        t = offs_m // num_heads
        h = offs_m % num_heads
        row_ok = (offs_m < Q_LEN * num_heads) & (t < q_len)
        q_pos = kv_len - q_len + t

        n_tiles = gl.cdiv(s_hi - s_lo, BLOCK_N)
        if n_tiles > 0:
            slot_n = _tile_slots(KV_INDICES, kv_beg, s_lo, s_hi, BLOCK_N, NOPE_LOAD)
            slot_r = _tile_slots(KV_INDICES, kv_beg, s_lo, s_hi, BLOCK_N, ROPE_LOAD)
            _issue_tile(KV, slot_n, slot_r, num_slots, stride_ks, nope_s.index(0), rope_s.index(0), RANK, ROPE, NOPE_LOAD, ROPE_LOAD)
        async_copy.commit_group()

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
        l_acc = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L)
        zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_L)
        acc = gl.zeros([BLOCK_H, RANK], gl.float32, O_L)
        bad = gl.zeros([BLOCK_N], gl.int1, COL_S)
        if LOGIT_CAP:
            s_scale = 1.0
        else:
            s_scale = qk_scale
        for j in range(n_tiles):
            b = j % 2
            n = s_lo + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=COL_S)
            slot = gl.load(KV_INDICES + kv_beg + n, mask=n < s_hi, other=0)
            n_ok = n < s_hi
            slot_ok = (slot >= 0) & (slot < num_slots)
            bad = bad | (n_ok & ~slot_ok)
            n_ok = n_ok & slot_ok
            # slots of tile j + 1, whose loads this step starts into the other buffer
            slot_n = _tile_slots(KV_INDICES, kv_beg, s_lo + (j + 1) * BLOCK_N, s_hi, BLOCK_N, NOPE_LOAD)
            slot_r = _tile_slots(KV_INDICES, kv_beg, s_lo + (j + 1) * BLOCK_N, s_hi, BLOCK_N, ROPE_LOAD)
            async_copy.wait_group(0)  # tile j has landed (this thread's copies, then everyone's)
            fence_async_shared()
            _cta_barrier()
            qk = _qk(qn_s, qr_s, nope_s.index(b), rope_s.index(b), zero)
            if j + 1 < n_tiles:
                _issue_tile(KV, slot_n, slot_r, num_slots, stride_ks, nope_s.index(1 - b), rope_s.index(1 - b), RANK, ROPE, NOPE_LOAD,
                            ROPE_LOAD)  # fmt: skip
            async_copy.commit_group()
            qk = warpgroup_mma_wait(0, deps=[qk])
            sc = tile_scores(qk, n, n_ok, t, row_ok, q_pos, mask_beg, kv_len, MASK, mask_size, qk_scale, cap_scale, window,
                             Q_LEN, USE_MASK, HAS_WINDOW, LOGIT_CAP)  # fmt: skip
            m_i, l_acc, p, alpha, moved = _softmax_tile(sc, m_i, l_acc, s_scale, LAZY)
            if moved:
                acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
            p_s.store(p.to(dtype))
            fence_async_shared()
            _cta_barrier()  # p of both warpgroups stored
            acc = warpgroup_mma_wait(0, deps=[warpgroup_mma(p_s, nope_s.index(b), acc, is_async=True)])
        async_copy.wait_group(0)
        l_i = gl.sum(l_acc, 1)

        gl.store(FAULT + FAULT_SLOT + gl.zeros([BLOCK_N], gl.int32, COL_S), 1, mask=bad)
        has = l_i > 0.0
        inv = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
        lse2 = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
        offs_mo = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_O)
        to = offs_mo // num_heads
        ho = offs_mo % num_heads
        row_ok_o = (offs_mo < Q_LEN * num_heads) & (to < q_len)
        ok_o = row_ok_o[:, None]
        co = gl.arange(0, RANK, layout=gl.SliceLayout(0, O_L))
        out = acc * gl.convert_layout(inv, ROW_O)[:, None]  # the split's normalized output
        if SPLIT:
            po = PART_O + r.to(gl.int64) * stride_pb + ho[:, None] * stride_ph + s * stride_ps + co[None, :]
            gl.store(po, out, mask=ok_o)
            gl.store(PART_LSE + r.to(gl.int64) * stride_lb + h * stride_lh + s, lse2, mask=row_ok)
        else:  # the merge's arithmetic for one split: the same bits as a merged launch (decode.one_split_result)
            res, lse_e = one_split_result(out, gl.convert_layout(lse2, ROW_O), SINKS, ho, row_ok_o, v_scale, HAS_SINK)
            o_rows = OUT + (q_beg + to).to(gl.int64)[:, None] * stride_ot + ho[:, None] * stride_oh
            gl.store(o_rows + co[None, :], res.to(OUT.dtype.element_ty), mask=ok_o)
            if STORE_LSE:
                gl.store(LSE + (q_beg + to).to(gl.int64) * stride_lt + ho, lse_e, mask=row_ok_o)
