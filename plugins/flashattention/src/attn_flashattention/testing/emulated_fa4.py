"""FlashAttention-4's varlen forward over paged K/V, written in plain torch (float64) from what its source
says it does, for tests on machines without a Hopper GPU.

Nothing here ran on a GPU or was checked against FA4's kernels: every rule below is read from
flash-attn-4 4.0.0b36 (`flash_attn/cute/interface.py`: `flash_attn_varlen_func` and `_flash_attn_fwd`'s
argument checks; `mask.py`, `block_info.py`: the causal and window masks; `softmax.py`: LSE and sinks;
`paged_kv.py`, `flash_fwd_sm90.py`: paged loads) for the arguments attn-flashattention passes, on the
SM90 path (compute capability 9.0):

- q `[total_q, Hq, D]` with `cu_seqlens_q` int32 `[batch + 1]` (contiguous); K, V paged
  `[num_pages, page_size, Hkv, D]` with `page_table` int32 `[batch, max_pages]` (last dim contiguous) and
  `seqused_k` int32 `[batch]`; `cu_seqlens_k` is refused with a page table. q, K, V one dtype, float16 or
  bfloat16 (fp8 is SM100 only); head dims multiples of 8 (16 bytes) from 8 to 256; Hq a multiple of Hkv
  (query head h reads KV head h // (Hq / Hkv)). `num_splits` must be 1 (no split-KV on SM90).
- Sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1 of q; its keys are keys 0 ..
  seqused_k[b] - 1, key p at page `page_table[b, p // page_size]`, row `p % page_size`. No other entry of
  the table and no other row of the pool is read (pages a sequence does not use may hold NaN).
- Masks, for query i of sq over sk keys, offset = sk - sq: `causal` keeps keys j <= i + offset;
  `window_size` (left, right) keeps offset + i - left <= j <= offset + i + right (None: unbounded);
  `causal` sets right to 0, and (None, 0) is plain causal; (-1, -1) means no window.
- Scores: s = softmax_scale * q.k (default 1 / sqrt(D)); `softcap` c > 0 (0: off) maps s to c tanh(s / c)
  (the scale applies first). `learnable_sink` `[Hq]` (float16, bfloat16 or float32): one extra logit per
  query head in natural-log units, unscaled, in the softmax denominator only.
- Output `[total_q, Hq, Dv]` in q's dtype; with `return_lse` the natural-log LSE, head-major
  `[Hq, total_q]` float32 (the sink included); else None. A query that sees no key gets output 0 and
  LSE -inf (its sink's logit with a sink).

Where FA4's source leaves a case to the caller, the emulation picks the strict reading and raises
`EmulatedFa4Error` (an input the kernel may mishandle must not pass here): `cu_seqlens_q` not starting
at 0, decreasing or not ending at total_q; a seqused_k past its table row; a page id outside the pool
for a key that is read; `max_seqlen_q` below a sequence's query count (FA4 sizes its scheduler from it);
and a page of exactly one key tile (FA4 then loads pages whole by TMA, so rows past a sequence's end
must be finite, which attn's pools do not promise): `sm90_tile_n` gives FA4's tile.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

#: dtypes FA4's SM90 forward takes for q, K and V (one dtype for all three)
SM90_DTYPES = (torch.float16, torch.bfloat16)
SINK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class EmulatedFa4Error(RuntimeError):
    """An input FA4 asserts against, or one its kernel may mishandle (see the module docstring)."""


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise EmulatedFa4Error(msg)


def sm90_tile_n(head_dim: int, causal: bool, local: bool) -> int:
    """The key tile FA4 4.0.0b36 picks on SM90 (`_tile_size_fwd_sm90`): 128 up to head dim 128 (144 at
    96 without a mask), at 192: 96 with a window, else 128; at 256: 64 with a window, else 80.

    Example: sm90_tile_n(128, True, False) == 128; sm90_tile_n(256, False, True) == 64."""
    if head_dim <= 64:
        return 128
    if head_dim <= 96:
        return 128 if causal or local else 144
    if head_dim <= 128:
        return 128
    if head_dim <= 192:
        return 96 if local else 128
    return 64 if local else 80


def resolve_window(
    causal: bool, left: Optional[int], right: Optional[int]
) -> tuple[bool, bool, Optional[int], Optional[int]]:
    """(causal, local, left, right) as FA4 resolves them (`_resolve_causal_local_window`).

    Example: resolve_window(True, 3, None) == (False, True, 3, 0); resolve_window(True, None, None) ==
    (True, False, None, None); resolve_window(False, -1, -1) == (False, False, None, None)."""
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    if left is None and right is None:
        return causal, False, None, None
    if left is None and right == 0:
        return True, False, None, None
    return False, True, left, right


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qv: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    min_seqlen_k: Optional[int] = None,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    gather_kv_indices: Optional[torch.Tensor] = None,
    page_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[Optional[int], Optional[int]] = (None, None),
    learnable_sink: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    block_sparse_tensors=None,
    aux_tensors=None,
    aux_scalars=None,
    return_lse: bool = False,
    **unused,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """FA4's `flash_attn_varlen_func` for paged K/V (see the module docstring): returns (out, lse or None)."""
    for name, value in (
        ("qv", qv),
        ("gather_kv_indices", gather_kv_indices),
        ("score_mod", score_mod),
        ("mask_mod", mask_mod),
    ):
        _need(value is None, f"{name} is not emulated")
    _need(
        block_sparse_tensors is None and aux_tensors is None and seqused_q is None,
        "block sparsity / aux tensors are not emulated",
    )
    _need(num_splits == 1, f"num_splits={num_splits}: SplitKV not supported on SM 9.0")
    _need(cu_seqlens_q is not None and page_table is not None, "the emulation serves varlen q over paged K/V only")
    _need(cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k")
    _need(
        q.dim() == 3 and k.dim() == 4 and v.dim() == 4,
        f"q [total_q, H, D], k/v [pages, page, Hkv, D]: {q.shape}, {k.shape}",
    )
    total_q, hq, d = q.shape
    num_pages, page_size, hkv, _ = v.shape
    dv = v.shape[-1]
    _need(
        tuple(k.shape) == (num_pages, page_size, hkv, d),
        f"k shape {tuple(k.shape)} != {(num_pages, page_size, hkv, d)}",
    )
    _need(v.dtype in SM90_DTYPES, f"dtype {v.dtype}: SM90 takes float16/bfloat16 (FP8 is only supported on SM100)")
    _need(q.dtype == k.dtype == v.dtype, f"q, k, v must have the same dtype: {q.dtype}, {k.dtype}, {v.dtype}")
    for name, dim in (("head_dim", d), ("head_dim_v", dv)):
        _need(8 <= dim <= 256 and dim % 8 == 0, f"{name} {dim} not supported on SM90 (8..256, divisible by 8)")
    _need(hq % hkv == 0, "num_head must be divisible by num_head_kv")
    batch = cu_seqlens_q.shape[0] - 1
    _need(
        page_table.dtype == torch.int32 and page_table.stride(-1) == 1,
        "page_table must be int32, contiguous in the last dim",
    )
    _need(
        page_table.dim() == 2 and page_table.shape[0] == batch,
        f"page_table shape {tuple(page_table.shape)}: (batch={batch}, pages)",
    )
    for name, t, n in (("cu_seqlens_q", cu_seqlens_q, batch + 1), ("seqused_k", seqused_k, batch)):
        _need(t is not None and t.dtype == torch.int32 and t.shape == (n,), f"{name} must be int32 of shape ({n},)")
        _need(t.stride(0) == 1, f"{name} must be contiguous")
    devices = {t.device for t in (q, k, v, cu_seqlens_q, seqused_k, page_table)}
    _need(len(devices) == 1, f"inputs on several devices: {devices}")
    if learnable_sink is not None:
        _need(tuple(learnable_sink.shape) == (hq,), f"learnable_sink shape {tuple(learnable_sink.shape)} != ({hq},)")
        _need(learnable_sink.dtype in SINK_DTYPES, f"learnable_sink dtype {learnable_sink.dtype}")
    causal, local, left, right = resolve_window(causal, *window_size)
    tile_n = sm90_tile_n(d, causal, local)
    _need(page_size != tile_n, f"page_size {page_size} == the key tile {tile_n}: FA4 loads whole pages by TMA")

    offsets = [int(x) for x in cu_seqlens_q.tolist()]
    used = [int(x) for x in seqused_k.tolist()]
    _need(offsets[0] == 0 and offsets[-1] == total_q, f"cu_seqlens_q {offsets} must run from 0 to total_q={total_q}")
    _need(all(a <= b for a, b in zip(offsets, offsets[1:])), f"cu_seqlens_q {offsets} decreases")
    if max_seqlen_q is not None:
        longest = max((b - a for a, b in zip(offsets, offsets[1:])), default=0)
        _need(longest <= max_seqlen_q, f"max_seqlen_q={max_seqlen_q} below a sequence of {longest} queries")
    width = page_table.shape[1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    sink = None if learnable_sink is None else learnable_sink.to(torch.float64)
    out = torch.zeros(total_q, hq, dv, dtype=torch.float64, device=q.device)
    lse = torch.full((total_q, hq), float("-inf"), dtype=torch.float64, device=q.device)
    group = hq // hkv
    for b in range(batch):
        sk, (q0, q1) = used[b], (offsets[b], offsets[b + 1])
        _need(
            0 <= sk <= width * page_size, f"seqused_k[{b}]={sk} outside its table row of {width} pages of {page_size}"
        )
        if q1 == q0:
            continue
        pos = torch.arange(sk, device=q.device)
        pages = page_table[b, pos // page_size].to(torch.int64) if sk else pos
        _need(
            bool(((pages >= 0) & (pages < num_pages)).all()),
            f"sequence {b} reads a page outside the pool of {num_pages}",
        )
        kb = k[pages, pos % page_size].to(torch.float64).repeat_interleave(group, dim=1)  # [sk, Hq, D]
        vb = v[pages, pos % page_size].to(torch.float64).repeat_interleave(group, dim=1)
        qb = q[q0:q1].to(torch.float64)
        sq = q1 - q0
        s = torch.einsum("qhd,khd->hqk", qb, kb) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        j = pos[None, :]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
        if causal:
            keep &= j <= i
        if local:
            if left is not None:
                keep &= j >= i - left
            if right is not None:
                keep &= j <= i + right
        s = s.masked_fill(~keep[None], float("-inf"))
        m = s.amax(dim=-1) if sk else torch.full((hq, sq), float("-inf"), dtype=torch.float64, device=q.device)
        if sink is not None:
            m = torch.maximum(m, sink[:, None])
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        w = torch.exp(s - m_safe[..., None])
        denom = w.sum(dim=-1) + (torch.exp(sink[:, None] - m_safe) if sink is not None else 0.0)
        o = torch.einsum("hqk,khd->qhd", w, vb)
        seen = (denom > 0).T
        out[q0:q1] = torch.where(seen[..., None], o / denom.T.clamp_min(1e-300)[..., None], 0.0)
        lse[q0:q1] = torch.where(seen, (m_safe + torch.log(denom)).T, float("-inf"))
    return out.to(q.dtype), (lse.T.contiguous().to(torch.float32) if return_lse else None)
