"""The oracle: dense attention of one request in float64, written plainly from docs/design.md §3.2.

Independent of every backend (no pools, no metadata, no batching): the caller hands in the request's
dense keys and values. The arithmetic runs in float64 on the tensors' own device (so GPU-sized checks
stay fast), in query chunks that bound the score tensor, and the results come back on the CPU.
"""

from __future__ import annotations

from typing import Optional

import torch

#: Largest float64 score block (elements) one chunk of queries may build: 32M elements = 256 MiB.
_MAX_SCORE_ELEMENTS = 1 << 25


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    scale: float,
    causal: bool = True,
    window: Optional[int] = None,
    logit_cap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    bidirectional_span: Optional[tuple[int, int]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one request.

    q `[Lq, Hq, D]`, k `[Lk, Hkv, D]`, v `[Lk, Hkv, Dv]`; key j sits at position j, query i at
    `q_positions[i]`. Visibility: `mask[i, j]` when given, else j <= q_positions[i] when causal, else
    every key; with `bidirectional_span` (a, b) and causal, a query at a <= p < b also sees the keys at
    a <= j < b; a window W further keeps keys with j >= q_positions[i] - W + 1, a chunk size C (chunked
    local attention) keys with j >= (q_positions[i] // C) * C. Returns the output
    `[Lq, Hq, Dv]` and natural-log LSE `[Lq, Hq]` (the sink joins the denominator), both float64 on
    the CPU. A query that sees no key (and has no sink) gets output 0 and LSE -inf.
    """
    dev = q.device
    q, k, v = q.to(dev, torch.float64), k.to(dev, torch.float64), v.to(dev, torch.float64)
    lq, hq, _ = q.shape
    lk, hkv, dv = v.shape[0], v.shape[1], v.shape[2]
    group = hq // hkv
    # one key/value head per query head: [Hq, Lk, D]
    kh = k.permute(1, 0, 2).repeat_interleave(group, dim=0)
    vh = v.permute(1, 0, 2).repeat_interleave(group, dim=0)
    pos = q_positions.to(dev, torch.int64)
    key_pos = torch.arange(lk, device=dev)
    if mask is not None:
        visible = mask.to(dev, torch.bool).clone()
    elif causal:
        visible = key_pos[None, :] <= pos[:, None]
        if bidirectional_span is not None:
            a, b = bidirectional_span
            query_inside = (pos >= a) & (pos < b)
            key_inside = (key_pos >= a) & (key_pos < b)
            visible |= query_inside[:, None] & key_inside[None, :]
    else:
        visible = torch.ones(lq, lk, dtype=torch.bool, device=dev)
    if window is not None:
        visible &= key_pos[None, :] >= pos[:, None] - window + 1
    if chunk_size is not None:
        visible &= key_pos[None, :] >= (pos[:, None] // chunk_size) * chunk_size
    sink = None if sinks is None else sinks.to(dev, torch.float64).reshape(hq, 1)

    out = torch.zeros(lq, hq, dv, dtype=torch.float64, device=dev)
    lse = torch.full((lq, hq), float("-inf"), dtype=torch.float64, device=dev)
    step = max(1, _MAX_SCORE_ELEMENTS // max(1, hq * lk))
    for i0 in range(0, lq, step):
        i1 = min(lq, i0 + step)
        scores = torch.einsum("qhd,hkd->hqk", q[i0:i1], kh) * scale  # [Hq, n, Lk]
        if logit_cap > 0:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        scores = scores.masked_fill(~visible[None, i0:i1], float("-inf"))
        m = scores.amax(dim=-1)  # [Hq, n]
        if sink is not None:
            m = torch.maximum(m, sink)
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        w = torch.exp(scores - m_safe[..., None])
        denom = w.sum(dim=-1)
        if sink is not None:
            denom = denom + torch.exp(sink - m_safe)
        o = torch.einsum("hqk,hkd->qhd", w, vh)
        seen = denom > 0
        out[i0:i1] = torch.where(seen.T[..., None], o / denom.T.clamp_min(1e-300)[..., None], 0.0)
        lse[i0:i1] = torch.where(seen, m_safe + torch.log(denom), float("-inf")).T
    return out.cpu(), lse.cpu()


def tolerance(dtype: torch.dtype) -> float:
    """Allowed relative error (max |out - ref| / max |ref|) for outputs of this dtype."""
    return {torch.float64: 1e-10, torch.float32: 1e-5}.get(dtype, 2e-2)


def fp8_kv_tolerance(q_dtype: torch.dtype) -> float:
    """Allowed relative output error of a case with q in `q_dtype` and an fp8 (float8_e4m3fn) KV cache,
    the reference being computed on the cache's *dequantized* values (stored · scale, in float64).

    Derivation for an fp8 (float8_e4m3fn) cache: an e4m3 value has 4 significant bits (3 mantissa bits,
    so neighbours lie a relative 2^-3 apart), which fp16 (11), bf16 (8) and fp32 (24) hold exactly: the
    cast fp8 → compute dtype adds no error. The one extra rounding a kernel may do is the product with
    the scale, x̂ = q·s, in its compute dtype: at most half an ulp, 2^-9 relative in bf16 (2^-24 in fp32),
    far inside the bar of the q dtype (2e-2 half precision, 1e-5 fp32), and the scores and the P·V sum
    are computed as for a non-fp8 cache. So the tolerance is the q dtype's: the e4m3 rounding itself
    (≤ 2^-4 relative per element, half the 2^-3 step; `attn_core.memory.fp8.e4m3_error_bound`) is
    judged separately, by comparing the dequantized cache with the original K/V, not by loosening this
    bar.

    Example: `fp8_kv_tolerance(torch.float32) == 1e-5`, `fp8_kv_tolerance(torch.float16) == 2e-2`."""
    return tolerance(q_dtype)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|; infinite when out has a NaN/inf where ref is finite."""
    out, ref = out.double().cpu(), ref.double().cpu()
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(out), finite) or not torch.equal(out[~finite], ref[~finite]):
        return float("inf")
    if not finite.any():
        return 0.0
    scale = ref[finite].abs().max().clamp_min(1e-6)
    return float((out[finite] - ref[finite]).abs().max() / scale)
