"""The ragged op's kernel (`attn_core.contract.ragged`): packed sequences without a KV cache, each attending to
its own rows only; non-causal by default (vision towers, encoders), causal on request.

Grid `[tiles, Hq]` over a work list built once per batch on the host (`ragged_tiles`: one entry per live
block of BLOCK_M rows of a sequence, the most keys first, so the long programs start first and no program
is spent past a short sequence's end); program (t, h) owns tile t's rows for q head h and loops over its
sequence's key rows BLOCK_N at a time, read straight from the packed k / v (contiguous rows: no gather);
the blocks of one sequence and head run next to each other, their K/V shared in L2. Non-causal: every key tile but
the sequence's last is whole and runs unmasked; causal: the tiles before the block's first row run
unmasked, the diagonal ones masked.

Head dims that are not a power of two (ViTs use 72, 80, 96) run in one channel block padded to the next
power of two (`BLOCK_D`, at least 16); the channels past D are masked to 0 on load and never stored.
(An earlier form split such a head dim into a power-of-two part and a remainder part, each with its own dot
and accumulator: on an H100 it gave wrong outputs at d80 and an illegal memory access at d96, where the
interpreter agreed with the reference; it stays out until it can be checked on hardware.)

Softmax in base 2 (`common.softmax_terms`), the score scale folded into one FMA, lazy rescaling of
the accumulators (`RaggedConfig.lazy_rescale`, as `common.lazy_softmax_step`) optional; the LSE leaves in
natural log. Bounds: cu_seqlens is clamped into the T rows (`common.offset_range`), a clamped offset
recorded as QUERY_ROWS in the fault buffer (`attn_core.ops.device_faults`), so no offset can make the
kernel read or write outside q / k / v / out; so is a sequence longer than the grid covers (a device
cu_seqlens that disagrees with the host's max_seqlen: its rows past the grid stay unwritten). Key offsets
inside a sequence are int32 unless max_seqlen times the row stride reaches 2^31 (`OFF64`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import triton
import triton.language as tl

from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.ragged import RaggedBatch
from attn_triton.kernels.common import (
    FAULT_QUERY_ROWS,
    LN2_K,
    LOG2E,
    check_lazy_rescale,
    finalize,
    offset_range,
    softmax_terms,
)


@dataclass(frozen=True)
class RaggedConfig:
    """Tiles of the ragged kernel: BLOCK_M rows x BLOCK_N keys a step, `num_warps`, `num_stages` software
    pipeline stages; `lazy_rescale` 0 rescales the accumulators on every key tile, K in 1..8 only when a
    row's running max grew by more than K (base 2)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    lazy_rescale: int = 0

    def __post_init__(self):
        check_lazy_rescale("RaggedConfig.lazy_rescale", self.lazy_rescale)
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise InvalidArgumentError(f"RaggedConfig.{name}", "a power of two >= 16", v)


def ragged_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> RaggedConfig:
    """Default tiles: small ones under the CPU interpreter; on a GPU in 16 bits 128 x 64 tiles, 8 warps (two
    warpgroups of 64 rows), 3 stages, the rescale on every tile: compiled for sm_90 they use warpgroup MMAs
    without spills at head dims up to 128 (4 warps spill at d96 and d128: tests/test_triton_compile_sm90.py);
    64 x 32 with 4 warps for float32 or head dims past 128. Timed on an H200 (2026-11-29,
    benchmarks/ragged_vs_peers.py at d80, 16 heads, 4 images of 1024-4096 patches, bf16): 582 us, the fastest
    of the five tiles swept; the same tiles with lazy rescaling (slack 4, the former default) 730 us, 128 x 128
    with lazy rescaling 657 us, 64 x 64 with 4 warps 598 us. The other ViT head dims were not timed.

    >>> ragged_config(80, torch.bfloat16, torch.device("cuda"))
    RaggedConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, lazy_rescale=0)
    """
    if device.type != "cuda":
        return RaggedConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
    if dtype == torch.float32 or head_dim > 128:
        return RaggedConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    return RaggedConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, lazy_rescale=0)


def channel_block(head_dim: int) -> int:
    """The kernel's channel block for a head dim: the next power of two, at least 16 (see the module docstring).

    >>> [channel_block(d) for d in (8, 64, 72, 80, 96, 128, 200)]
    [16, 64, 128, 128, 128, 128, 256]
    """
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit
def _online_softmax(m_i, l_i, acc, s, s_scale, MASKED: tl.constexpr, LAZY: tl.constexpr):
    """One online-softmax step over scores `s` [M, N] (base-2 logits s * s_scale; -inf where masked):
    `common.softmax_terms` when LAZY is 0, else `common.lazy_softmax_step`'s rule (move the reference only
    when a row's max grew by more than LAZY). Returns (m, l, acc rescaled, p)."""
    if LAZY > 0:
        m_tile = tl.max(s, 1) * s_scale
        grow = tl.where(m_tile > m_i, m_tile - m_i, 0.0)
        if tl.max(grow, 0) > LAZY:
            m_new = tl.maximum(m_i, m_tile)
            alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        p = tl.exp2(s * s_scale - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
        l_i = l_i + tl.sum(p, 1)
    else:
        m_i, l_i, alpha, p = softmax_terms(m_i, l_i, s, s_scale, MASKED)
        acc = acc * alpha[:, None]
    return m_i, l_i, acc, p


@triton.jit
def _key_tile(
    acc,
    m_i,
    l_i,
    q,
    k_rows,
    v_rows,
    start,
    n,
    offs_m,
    offs_n,
    offs_d,
    stride_kt,
    stride_vt,
    qk_scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PREC: tl.constexpr,
    LAZY: tl.constexpr,
    OFF64: tl.constexpr,
):
    """Attend the keys start … start+BLOCK_N-1 of the sequence (n rows; k_rows / v_rows point at its first
    key's row of this KV head): MASKED loads only keys < n (and, CAUSAL, hides keys after each row); channels
    past D (BLOCK_D > D) load as 0."""
    key = start + offs_n
    if OFF64:
        k_off = key.to(tl.int64)[:, None] * stride_kt
        v_off = key.to(tl.int64)[:, None] * stride_vt
    else:
        k_off = key[:, None] * stride_kt
        v_off = key[:, None] * stride_vt
    k_ptr = k_rows + k_off + offs_d[None, :]
    v_ptr = v_rows + v_off + offs_d[None, :]
    n_ok = key < n
    if MASKED:
        kv_ok = n_ok[:, None] & (offs_d[None, :] < D)
        k = tl.load(k_ptr, mask=kv_ok, other=0.0)
    elif BLOCK_D > D:
        kv_ok = offs_d[None, :] < D
        k = tl.load(k_ptr, mask=kv_ok, other=0.0)
    else:
        k = tl.load(k_ptr)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if MASKED:
        ok = n_ok[None, :]
        if CAUSAL:
            ok = ok & (key[None, :] <= offs_m[:, None])
        qk = tl.where(ok, qk, float("-inf"))
    m_i, l_i, acc, p = _online_softmax(m_i, l_i, acc, qk, qk_scale, MASKED, LAZY)
    if MASKED or BLOCK_D > D:
        v = tl.load(v_ptr, mask=kv_ok, other=0.0)
    else:
        v = tl.load(v_ptr)
    acc += tl.dot(p.to(q.dtype), v, input_precision=DOT_PREC)
    return acc, m_i, l_i


@triton.jit
def _ragged_kernel(
    Q,
    K,
    V,
    OUT,
    LSE,
    CU_SEQLENS,
    TILES,
    FAULT,
    num_tokens,
    num_tiles,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    STORE_LSE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    LAZY: tl.constexpr,
    OFF64: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.load(TILES + t)  # the tile's sequence, m block, and the m blocks the host gave that sequence
    mb = tl.load(TILES + num_tiles + t)
    blocks = tl.load(TILES + 2 * num_tiles + t)
    beg, n, clamped = offset_range(CU_SEQLENS, s, num_tokens)
    if (mb == 0) & (h == 0):
        # offsets outside the T rows, or a sequence longer than its tiles cover (rows left unwritten)
        tl.store(FAULT + FAULT_QUERY_ROWS, 1, mask=clamped | (n > blocks * BLOCK_M))
    if mb * BLOCK_M >= n:
        return
    kv_head = h // GROUP
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    m_ok = offs_m < n
    rows = (beg + offs_m).to(tl.int64)
    q_ptr = Q + rows[:, None] * stride_qt + h * stride_qh
    q = tl.load(q_ptr + offs_d[None, :], mask=m_ok[:, None] & d_ok, other=0.0)
    k_rows = K + beg.to(tl.int64) * stride_kt + kv_head * stride_kh
    v_rows = V + beg.to(tl.int64) * stride_vt + kv_head * stride_vh

    if CAUSAL:
        hi = tl.minimum(n, (mb + 1) * BLOCK_M)
        full_end = tl.minimum(mb * BLOCK_M, n) // BLOCK_N * BLOCK_N
    else:
        hi = n
        full_end = n // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _key_tile(
            acc,
            m_i,
            l_i,
            q,
            k_rows,
            v_rows,
            start,
            n,
            offs_m,
            offs_n,
            offs_d,
            stride_kt,
            stride_vt,
            qk_scale,
            D,
            BLOCK_D,
            False,
            CAUSAL,
            DOT_PREC,
            LAZY,
            OFF64,
        )
    for start in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = _key_tile(
            acc,
            m_i,
            l_i,
            q,
            k_rows,
            v_rows,
            start,
            n,
            offs_m,
            offs_n,
            offs_d,
            stride_kt,
            stride_vt,
            qk_scale,
            D,
            BLOCK_D,
            True,
            CAUSAL,
            DOT_PREC,
            LAZY,
            OFF64,
        )

    out, lse2 = finalize(m_i, l_i, acc)
    o_ptr = OUT + rows[:, None] * stride_ot + h * stride_oh
    tl.store(o_ptr + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=m_ok[:, None] & d_ok)
    if STORE_LSE:
        tl.store(LSE + rows * stride_lt + h, lse2 * LN2_K, mask=m_ok)


def ragged_tiles(
    seq_lens: Sequence[int], block_m: int, causal: bool, device: Union[str, torch.device] = "cpu"
) -> torch.Tensor:
    """The kernel's work list: int32 `[3, tiles]` on `device` — per live program its sequence, its m block
    and its sequence's number of m blocks — the most keys first (non-causal: its sequence's length; causal:
    up to its last row), ties in sequence order, so the longest programs start first and short ones fill the
    tail (no program of the grid is spent on a block past its sequence's end).

    >>> ragged_tiles([100, 0, 300], 128, False).tolist()
    [[2, 2, 2, 0], [0, 1, 2, 0], [3, 3, 3, 1]]
    >>> ragged_tiles([300], 128, True).tolist()
    [[0, 0, 0], [2, 1, 0], [3, 3, 3]]
    """
    tiles = []
    for i, n in enumerate(seq_lens):
        blocks = -(-int(n) // block_m)
        for mb in range(blocks):
            keys = min(int(n), (mb + 1) * block_m) if causal else int(n)
            tiles.append((-keys, i, mb, blocks))
    tiles.sort()
    table = torch.tensor([[t[1] for t in tiles], [t[2] for t in tiles], [t[3] for t in tiles]], dtype=torch.int32)
    return table.reshape(3, len(tiles)).to(device, non_blocking=True)


def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    tiles: torch.Tensor,
    fault: torch.Tensor,
    *,
    sm_scale: float,
    config: RaggedConfig,
    causal: bool = False,
    lse_out: Optional[torch.Tensor] = None,
) -> None:
    """Attention of packed sequences into `o` (and `lse_out`).

    q `[T, Hq, D]`, k / v `[T, Hkv, D]` (any row and head strides; channels contiguous), o `[T, Hq, D]`;
    sequence i owns rows cu_seqlens[i] … cu_seqlens[i+1]-1 (cu_seqlens int32 `[n + 1]` on the device);
    `max_seqlen` the longest (host int); `tiles` the work list `ragged_tiles` made for these lengths with
    `config.block_m` and `causal`; lse_out `[T, Hq]` float32 natural log; fault: the int32 fault buffer
    (`attn_core.ops.device_faults`). Heads of q, k and v must have the same D (v_head_dim = head_dim)."""
    T, hq, d = q.shape
    hkv = k.shape[1]
    num_tiles = tiles.shape[1]
    if T == 0 or num_tiles == 0 or max_seqlen <= 0:
        return
    if (
        tuple(v.shape) != tuple(k.shape)
        or tuple(o.shape) != (T, hq, d)
        or (lse_out is not None and tuple(lse_out.shape) != (T, hq))
    ):
        found = (tuple(k.shape), tuple(v.shape), tuple(o.shape))
        raise InvalidArgumentError("k/v/o", f"k and v of one shape, o of shape {(T, hq, d)}", found)
    if not sm_scale > 0:
        raise InvalidArgumentError("sm_scale", "> 0", sm_scale)
    grid = (num_tiles, hq)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1))
    _ragged_kernel[grid](
        q,
        k,
        v,
        o,
        lse_out if lse_out is not None else o,
        cu_seqlens,
        tiles,
        fault,
        T,
        num_tiles,
        sm_scale * LOG2E,
        *strides,
        lse_out.stride(0) if lse_out is not None else 0,
        GROUP=hq // hkv,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        D=d,
        BLOCK_D=channel_block(d),
        CAUSAL=causal,
        STORE_LSE=lse_out is not None,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        LAZY=config.lazy_rescale,
        OFF64=max_seqlen * max(k.stride(0), v.stride(0)) >= 2**31,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def attend_ragged(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ragged: RaggedBatch,
    fault: torch.Tensor,
    *,
    sm_scale: float,
    config: RaggedConfig,
    tiles: Optional[torch.Tensor] = None,
    return_lse: bool = False,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The ragged op of `attn_core.contract.ragged` on this kernel: q `[T, Hq, D]`, k / v `[T, Hkv, D]` (views with
    any row / head strides) → `[T, Hq·D]` in q's dtype (and the natural-log LSE `[T, Hq]` float32). `tiles`:
    the batch's work list (`ragged_tiles`, built once per batch by the backend), else made here."""
    if tiles is None:
        tiles = ragged_tiles(ragged.seq_lens_cpu.tolist(), config.block_m, ragged.causal, q.device)
    T, hq, d = q.shape
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    o = q.new_empty((T, hq, d))
    lse = torch.empty((T, hq), dtype=torch.float32, device=q.device) if return_lse else None
    ragged_attention(
        q,
        k,
        v,
        o,
        ragged.cu_seqlens,
        ragged.max_seqlen,
        tiles,
        fault,
        sm_scale=sm_scale,
        config=config,
        causal=ragged.causal,
        lse_out=lse,
    )
    o = o.view(T, hq * d)
    return (o, lse) if return_lse else o


__all__ = ["RaggedConfig", "attend_ragged", "ragged_attention", "ragged_config", "ragged_tiles", "channel_block"]
