"""Absorbed-MLA attention of one or a few query tokens per request, written for the shape of MLA.

In absorbed MLA every q head attends to the same latent row per key: `[kv_lora_rank + rope]` (e.g.
512 + 64), whose first kv_lora_rank channels are also the value. The work is compute-bound (one latent
row serves all heads), so a program takes BLOCK_H query rows on the M dimension of tensor-core dots,
loads each tile of BLOCK_N latent rows once, and uses it three times:

    scores = q_nope · latent_nope^T + q_rope · latent_rope^T      [BLOCK_H, BLOCK_N]
    acc   += softmax(scores) · latent_nope                        [BLOCK_H, kv_lora_rank]

Query rows are (token, head) pairs folded into M: row m of request r is token m // Hq, head m % Hq.

- DECODE (one token per request): grid `[bs, cdiv(Hq, BLOCK_H), max_splits]`; program
  (r, hb, s) takes split s of request r's `split_count(kv_len)` splits (the same split layout as
  `decode.py`, computed on the device) and writes the normalized partial output and base-2 LSE to the
  split scratch; stage 2 is `decode.merge_splits` (sinks, v_scale, LSE). A launch with max_splits 1
  under the wave-aware split policy (`MLAConfig.ctas_per_sm` > 0) finalizes its rows itself instead
  (no scratch, no merge launch).
- TARGET_VERIFY / DRAFT_EXTEND with the same q_len (2..16) for every request: grid
  `[bs, cdiv(q_len * Hq, BLOCK_H), 1]`; token t of a request with kv_len keys sees the keys
  < kv_len - q_len + t + 1 (causal), or those its custom (tree) mask allows; each program finalizes its
  rows itself. No KV split here: verify batches give bs * q_len * Hq / BLOCK_H programs, enough to fill
  the GPU at the batch sizes speculative decoding runs (bs64 x 4 drafts x 128 heads / 32 = 1024).

Lazy rescaling (`MLAConfig.lazy_rescale` = K > 0): the running max that p, l and acc are relative to
moves only when some row's tile max exceeds it by more than K (base-2 units); otherwise the tile's p
is taken against the old max (p <= 2^K) and the BLOCK_H x kv_lora_rank accumulator is not rescaled. The
reference cancels in acc / l, so the result is the same softmax; what it saves is the accumulator
multiply of most tiles once the max has settled.

Sliding window, logit cap, sinks, LSE output, k_scale / v_scale follow `decode.py` / `extend.py`.

Bounds (as `decode.py` / `extend.py`): kv_indptr entries are clamped into [0, len(kv_indices)]
(KEY_OFFSETS), qo_indptr entries into the step's T tokens (QUERY_ROWS); a slot outside [0, slots of
the latent buffer) is not read (the key is masked out; SLOT); mask entries outside the custom mask are
not read (MASK). Each is recorded in the fault buffer (`attn_core.ops.device_faults`); no fault is
stored inside the key loop.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from attn_core.contract.errors import InvalidArgumentError
from attn_triton.kernels.common import (
    FAULT_SLOT,
    check_lazy_rescale,
    finalize,
    finite_values,
    lazy_softmax_step,
    load_slots,
    score_scales,
    softmax_step,
    tma_compatible,
)
from attn_triton.kernels.decode import check_split_shapes, merge_splits, one_split_result
from attn_triton.kernels.mla_common import request_keys, tile_scores

#: most query tokens per request the folded kernel takes (speculative verify / draft extend)
MAX_FOLDED_Q_LEN = 16


def gluon_hopper_available(version: str = triton.__version__) -> bool:
    """Whether this Triton has the Gluon Hopper API that the Hopper kernels (`kernels/mla_wgmma.py`,
    `kernels/extend_wgmma.py`) are written against (Triton >= 3.6; otherwise `mla_config_for` picks the
    portable kernel's tiles and a backend refuses `ExtendConfig.wgmma_block_n`).

    >>> gluon_hopper_available("3.5.1"), gluon_hopper_available("3.6.0")
    (False, True)
    """
    major, minor = (int("".join(c for c in x if c.isdigit()) or 0) for x in version.split(".")[:2])
    return (major, minor) >= (3, 6) and importlib.util.find_spec("triton.experimental.gluon") is not None


#: tiles of the Hopper kernel (`kernels/mla_wgmma.py`): one warpgroup MMA's M rows, 32-key tiles in four
#: buffers, two warpgroups (launched as num_warps 4: the default partition; the worker adds 4)
WGMMA_BLOCK_H = 64
WGMMA_BLOCK_N = 32
WGMMA_WARPS = 8
WGMMA_BUFFERS = 4
#: CUDA's limit on a grid's y dimension (the Hopper kernel's requests; more take the portable kernel)
MAX_GRID_Y = 65535


@dataclass(frozen=True)
class MLAConfig:
    """Tiles of the MLA kernel: BLOCK_H (token, head) rows on M, BLOCK_N latent rows per step.
    Chosen per architecture in `attn_triton.config.mla_config`.

    - ctas_per_sm: 0 takes the backend's `SplitPolicy` for the decode splits (about two waves of
      programs, always merged); k >= 1 takes the wave-aware choice (`attn_triton.config.wave_splits`)
      for k programs resident per multiprocessor, under which a batch that fills the GPU runs with one
      split and no merge launch. It describes these tiles (registers and shared memory decide how many
      programs fit an SM; `test_triton_compile_sm90.py` prints both), so it lives here.
    - lazy_rescale: 0 rescales the accumulator on every key tile; K in 1..8 only when a row's max grew
      by more than K in base-2 units (module doc).
    - wgmma: run the Hopper kernel (`kernels/mla_wgmma.py`, Gluon: two warp-specialized warpgroups that take
      the key tiles in turn, the accumulator split by columns between them) for the launches it takes
      (`uses_wgmma`); it needs block_h 64, block_n 32, 8 warps, num_stages 4 (four latent buffers) and no
      lazy rescaling. Only for GPUs of compute capability 9.x (`attn_triton.config.mla_config_for` sets it
      there).
    """

    block_h: int = 64
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    ctas_per_sm: int = 0
    lazy_rescale: int = 0
    wgmma: bool = False

    def __post_init__(self) -> None:
        if self.ctas_per_sm < 0:
            raise InvalidArgumentError(
                "MLAConfig.ctas_per_sm", "0 (SplitPolicy) or programs per SM >= 1", self.ctas_per_sm
            )
        check_lazy_rescale("MLAConfig.lazy_rescale", self.lazy_rescale)
        tiles = (self.block_h, self.block_n, self.num_warps, self.num_stages, self.lazy_rescale)
        if self.wgmma and tiles != (WGMMA_BLOCK_H, WGMMA_BLOCK_N, WGMMA_WARPS, WGMMA_BUFFERS, 0):
            raise InvalidArgumentError(
                "MLAConfig.wgmma",
                f"block_h {WGMMA_BLOCK_H}, block_n {WGMMA_BLOCK_N}, num_warps {WGMMA_WARPS}, "
                f"num_stages {WGMMA_BUFFERS} (the Hopper kernel's four latent buffers) and lazy_rescale 0",
                tiles,
            )


@triton.jit
def _mla_kernel(
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
    Q_LEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_ROPE: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
    HAS_SINK: tl.constexpr,
    STORE_LSE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    LAZY: tl.constexpr,
):
    r = tl.program_id(0)
    hb = tl.program_id(1)
    s = tl.program_id(2)
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
    if s >= n_split:
        return

    # rows of this program: (token t, head h) pairs
    offs_m = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    t = offs_m // num_heads
    h = offs_m % num_heads
    row_ok = (offs_m < Q_LEN * num_heads) & (t < q_len)
    q_pos = kv_len - q_len + t  # position of token t among the request's keys (the new tokens are last)

    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = Q + (q_beg + t).to(tl.int64)[:, None] * stride_qt + h[:, None] * stride_qh
    q_nope = tl.load(q_rows + offs_r[None, :], mask=row_ok[:, None] & (offs_r[None, :] < RANK), other=0.0)
    if BLOCK_ROPE > 0:
        offs_p = tl.arange(0, BLOCK_ROPE)
        q_rope = tl.load(q_rows + RANK + offs_p[None, :], mask=row_ok[:, None] & (offs_p[None, :] < ROPE), other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    bad_slots = offs_n < 0
    for start in range(s_lo, s_hi, BLOCK_N):
        n = start + offs_n
        n_ok = n < s_hi
        slot, n_ok, bad_slots = load_slots(KV_INDICES, kv_beg, n, n_ok, num_slots, bad_slots)
        row = KV + slot[:, None] * stride_ks
        latent = tl.load(row + offs_r[None, :], mask=n_ok[:, None] & (offs_r[None, :] < RANK), other=0.0).to(
            q_nope.dtype
        )
        qk = tl.dot(q_nope, tl.trans(latent), input_precision=DOT_PREC)
        if BLOCK_ROPE > 0:
            k_rope = tl.load(row + RANK + offs_p[None, :], mask=n_ok[:, None] & (offs_p[None, :] < ROPE), other=0.0)
            qk += tl.dot(q_rope, tl.trans(k_rope.to(q_nope.dtype)), input_precision=DOT_PREC)
        sc = tile_scores(
            qk,
            n,
            n_ok,
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
        s_scale = 1.0 if LOGIT_CAP else qk_scale
        if LAZY > 0:
            m_i, l_i, acc, p = lazy_softmax_step(m_i, l_i, acc, sc, s_scale, LAZY)
        else:
            m_i, l_i, acc, p = softmax_step(m_i, l_i, acc, sc, s_scale, True)
        if Q_LEN > 1:  # rows see different keys: a key a row does not see adds exactly nothing (`finite_values`)
            v_lat, seen = finite_values(latent, sc != float("-inf"))
            acc = tl.dot(p.to(q_nope.dtype), v_lat, acc, input_precision=DOT_PREC)
            acc = tl.where(seen[:, None] != 0, float("nan"), acc)
        else:
            acc = tl.dot(p.to(q_nope.dtype), latent, acc, input_precision=DOT_PREC)

    tl.store(FAULT + FAULT_SLOT + offs_n * 0, 1, mask=bad_slots)  # one address: a flag, no reduction
    if SPLIT:
        out, lse2 = finalize(m_i, l_i, acc)
        po = PART_O + r.to(tl.int64) * stride_pb + h[:, None] * stride_ph + s * stride_ps + offs_r[None, :]
        tl.store(po, out, mask=row_ok[:, None] & (offs_r[None, :] < RANK))
        tl.store(PART_LSE + r.to(tl.int64) * stride_lb + h * stride_lh + s, lse2, mask=row_ok)
    else:  # the merge's arithmetic for one split: the same bits as a merged launch (decode.one_split_result)
        out, lse2 = finalize(m_i, l_i, acc)
        res, lse_e = one_split_result(out, lse2, SINKS, h, row_ok, v_scale, HAS_SINK)
        o_rows = OUT + (q_beg + t).to(tl.int64)[:, None] * stride_ot + h[:, None] * stride_oh
        tl.store(
            o_rows + offs_r[None, :], res.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (offs_r[None, :] < RANK)
        )
        if STORE_LSE:
            tl.store(LSE + (q_beg + t).to(tl.int64) * stride_lt + h, lse_e, mask=row_ok)


def _pow2(x: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(int(x), 1)))


def rows_per_program(q_len: int, num_heads: int, config: MLAConfig) -> int:
    """BLOCK_H of a launch: config.block_h, or fewer when q_len * num_heads rows are fewer (at least 16,
    the tensor-core dot's minimum M).

    >>> rows_per_program(1, 128, MLAConfig(block_h=64))
    64
    >>> rows_per_program(1, 16, MLAConfig(block_h=64))
    16
    >>> rows_per_program(4, 8, MLAConfig(block_h=64))
    32
    """
    return min(config.block_h, _pow2(q_len * num_heads))


def uses_wgmma(config: MLAConfig, dtype: torch.dtype, kv_lora_rank: int, rope: int) -> bool:
    """Whether a launch runs the Hopper kernel (`kernels/mla_wgmma.py`): the config asks for it and the
    shapes are its: 16-bit q and latent, kv_lora_rank a power of two in 64..512 and rope one in 16..64 with
    kv_lora_rank + rope <= 576 (q and four 32-row latent buffers, 384 bytes per channel, and a 16 KiB p
    ring when rope < 64, then fit Hopper's 227 KiB of shared memory; DeepSeek's 512 + 64 is the largest).
    float32 and other widths keep the portable kernel.

    >>> uses_wgmma(MLAConfig(64, 32, 8, 4, wgmma=True), torch.bfloat16, 512, 64)
    True
    >>> uses_wgmma(MLAConfig(64, 32, 8, 4, wgmma=True), torch.bfloat16, 256, 32)
    True
    >>> uses_wgmma(MLAConfig(64, 32, 8, 4, wgmma=True), torch.bfloat16, 512, 128)
    False
    >>> uses_wgmma(MLAConfig(64, 32, 8, 4, wgmma=True), torch.float32, 512, 64)
    False
    >>> uses_wgmma(MLAConfig(64, 32, 8, 4), torch.bfloat16, 512, 64)
    False
    """
    pow2 = lambda x: x > 0 and x & (x - 1) == 0  # noqa: E731
    return (
        config.wgmma
        and dtype in (torch.bfloat16, torch.float16)
        and pow2(kv_lora_rank)
        and 64 <= kv_lora_rank <= 512
        and pow2(rope)
        and 16 <= rope <= 64
        and kv_lora_rank + rope <= 576
    )


def programs_per_request(num_heads: int, config: MLAConfig) -> int:
    """Programs along the head axis of a DECODE launch (one query token per request): its head blocks.

    >>> programs_per_request(128, MLAConfig(block_h=64))
    2
    >>> programs_per_request(16, MLAConfig(block_h=64))
    1
    >>> programs_per_request(128, MLAConfig(block_h=32))
    4
    """
    return triton.cdiv(num_heads, rows_per_program(1, num_heads, config))


def merges_splits(max_splits: int, config: MLAConfig) -> bool:
    """Whether a DECODE launch with `max_splits` goes through the split scratch and the merge launch:
    always under the backend's SplitPolicy (ctas_per_sm 0, today's behaviour), and under the wave-aware
    policy only when it chose more than one split (one split finalizes in the kernel).

    >>> merges_splits(1, MLAConfig())
    True
    >>> merges_splits(1, MLAConfig(ctas_per_sm=1)), merges_splits(2, MLAConfig(ctas_per_sm=1))
    (False, True)
    """
    return config.ctas_per_sm == 0 or max_splits > 1


def mla_attention(
    q: torch.Tensor,
    kv_buf: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    fault: torch.Tensor,
    *,
    kv_lora_rank: int,
    sm_scale: float,
    config: MLAConfig,
    q_len: int = 1,
    qo_indptr: Optional[torch.Tensor] = None,
    max_splits: int = 1,
    min_split_len: int = 1,
    part_o: Optional[torch.Tensor] = None,
    part_lse: Optional[torch.Tensor] = None,
    custom_mask: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
    logit_cap: float = 0.0,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
    lse_out: Optional[torch.Tensor] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Absorbed-MLA attention of `q_len` query tokens per request into `o` (and `lse_out`).

    q `[T, Hq, kv_lora_rank + rope]` (nope channels first); kv_buf `[slots, 1, kv_lora_rank + rope]` (one
    latent row per slot, same dtype as q); o `[T, Hq, kv_lora_rank]`; kv_indptr `[bs+1]` / kv_indices:
    CSR int32 slots of each request's keys, its new tokens last; fault: the int32 fault buffer
    (`attn_core.ops.device_faults`); sinks `[Hq]` float32; lse_out `[T, Hq]` float32 natural log.

    - q_len 1 (DECODE, T = bs): split-KV; part_o `[bs, Hq, >= max_splits, kv_lora_rank]` and part_lse
      `[bs, Hq, >= max_splits]` float32 scratch; request r takes
      clamp(ceil(kv_len / min_split_len), 1, max_splits) splits (none and no scratch read when
      `merges_splits(max_splits, config)` is False).
    - 2 <= q_len <= MAX_FOLDED_Q_LEN (TARGET_VERIFY / DRAFT_EXTEND, every request with q_len tokens,
      T = bs * q_len): qo_indptr `[bs+1]` int32; causal, or `custom_mask` (uint8, per request a
      row-major `[q_len, kv_len]` block starting at mask_indptr[r], int64) in its place.
    """
    T, hq, width = q.shape
    rope = width - kv_lora_rank
    if o.shape != (T, hq, kv_lora_rank) or kv_buf.shape[-1] != width or kv_buf.dtype != q.dtype:
        raise InvalidArgumentError(
            "o/kv_buf",
            f"o [{T}, {hq}, {kv_lora_rank}] and a {q.dtype} latent buffer of width {width}",
            (tuple(o.shape), tuple(kv_buf.shape), kv_buf.dtype),
        )
    if not 1 <= q_len <= MAX_FOLDED_Q_LEN:
        raise InvalidArgumentError("q_len", f"1..{MAX_FOLDED_Q_LEN} query tokens per request", q_len)
    bs = T // q_len
    if bs == 0:
        return
    if bs * q_len != T:
        raise InvalidArgumentError("q", f"bs * q_len rows (q_len = {q_len})", T)
    split = q_len == 1 and merges_splits(max_splits, config)
    if split:
        if part_o is None or part_lse is None:
            raise InvalidArgumentError("part_o/part_lse", "split scratch for a decode launch", None)
        check_split_shapes(bs, max_splits, kv_indptr, part_o, part_lse, o, lse_out)
    else:
        if (q_len > 1 and (qo_indptr is None or qo_indptr.shape[0] < bs + 1)) or kv_indptr.shape[0] < bs + 1:
            found = None if qo_indptr is None else tuple(qo_indptr.shape)
            raise InvalidArgumentError("qo_indptr/kv_indptr", f"at least bs + 1 = {bs + 1} offsets each", found)
        if custom_mask is not None and (mask_indptr is None or mask_indptr.shape[0] < bs):
            found = None if mask_indptr is None else tuple(mask_indptr.shape)
            raise InvalidArgumentError("mask_indptr", f"at least {bs} offsets with a custom mask", found)
        if lse_out is not None and lse_out.shape[0] != T:
            raise InvalidArgumentError("lse_out", f"{T} rows", lse_out.shape[0])
        max_splits = 1
    use_mask = custom_mask is not None and q_len > 1
    qk_scale, cap_scale = score_scales(sm_scale, logit_cap, k_scale)
    # the Hopper kernel's grid has the requests on y; it reads whole tiles of the pool by TMA (common.tma_compatible)
    if uses_wgmma(config, q.dtype, kv_lora_rank, rope) and bs <= MAX_GRID_Y and tma_compatible(kv_buf):
        from attn_triton.kernels.mla_wgmma import (
            latent_descriptors,
            mla_wgmma_kernel,
        )  # Gluon: imported only where it runs

        block_h = WGMMA_BLOCK_H
        grid = (triton.cdiv(q_len * hq, block_h), bs, max_splits)
        nope_desc, rope_desc = latent_descriptors(kv_buf, kv_lora_rank)
        # num_warps: the default partition's (warpgroup 0; the worker adds 4)
        kernel, options = mla_wgmma_kernel, dict(num_warps=WGMMA_WARPS // 2, NOPE_DESC=nope_desc, ROPE_DESC=rope_desc)
    else:
        block_h = rows_per_program(q_len, hq, config)
        grid = (bs, triton.cdiv(q_len * hq, block_h), max_splits)
        kernel, options = _mla_kernel, dict(num_warps=config.num_warps, num_stages=config.num_stages)
    dummy = kv_indptr
    kernel[grid](
        q,
        kv_buf,
        o,
        lse_out if lse_out is not None and not split else o,
        part_o if split else o,
        part_lse if split else o,
        qo_indptr if qo_indptr is not None else dummy,
        kv_indptr,
        kv_indices,
        custom_mask if use_mask else dummy,
        mask_indptr if use_mask else dummy,
        sinks if sinks is not None and not split else o,
        fault,
        T,
        kv_indices.shape[0],
        kv_buf.shape[0],
        custom_mask.numel() if use_mask else 0,
        min_split_len,
        max_splits,
        qk_scale,
        cap_scale,
        float(v_scale),
        int(window or 0),
        hq,
        q.stride(0),
        q.stride(1),
        kv_buf.stride(0),
        o.stride(0),
        o.stride(1),
        lse_out.stride(0) if lse_out is not None else 0,
        part_o.stride(0) if split else 0,
        part_o.stride(1) if split else 0,
        part_o.stride(2) if split else 0,
        part_lse.stride(0) if split else 0,
        part_lse.stride(1) if split else 0,
        Q_LEN=q_len,
        BLOCK_H=block_h,
        BLOCK_N=config.block_n,
        RANK=kv_lora_rank,
        BLOCK_R=_pow2(kv_lora_rank),
        ROPE=rope,
        BLOCK_ROPE=_pow2(rope) if rope else 0,
        SPLIT=split,
        USE_MASK=use_mask,
        HAS_WINDOW=window is not None,
        LOGIT_CAP=logit_cap > 0,
        HAS_SINK=sinks is not None and not split,
        STORE_LSE=lse_out is not None and not split,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        LAZY=config.lazy_rescale,
        **options,
    )
    if split:
        merge_splits(
            part_o,
            part_lse,
            kv_indptr,
            kv_indices.shape[0],
            max_splits,
            min_split_len,
            o,
            sinks=sinks,
            lse_out=lse_out,
            v_scale=v_scale,
        )
