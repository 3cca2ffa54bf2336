"""The oracle: dense attention of one request in float64, written plainly from DESIGN §3.

Independent of every backend (no pools, no metadata, no batching): the caller hands in the request's
dense keys and values.
"""

from __future__ import annotations

from typing import Optional

import torch


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one request.

    q `[Lq, Hq, D]`, k `[Lk, Hkv, D]`, v `[Lk, Hkv, Dv]`; key j sits at position j, query i at
    `q_positions[i]`. Visibility: `mask[i, j]` when given, else j <= q_positions[i] when causal, else
    every key; a window W further keeps keys with j >= q_positions[i] - W + 1. Returns the output
    `[Lq, Hq, Dv]` and natural-log LSE `[Lq, Hq]` (the sink joins the denominator), both float64.
    A query that sees no key (and has no sink) gets output 0 and LSE -inf.
    """
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    group = hq // hkv
    pos = q_positions.long().cpu()
    key_pos = torch.arange(lk)
    if mask is not None:
        visible = mask.bool().cpu().clone()
    elif causal:
        visible = key_pos[None, :] <= pos[:, None]
    else:
        visible = torch.ones(lq, lk, dtype=torch.bool)
    if window is not None:
        visible &= key_pos[None, :] >= pos[:, None] - window + 1

    out = torch.zeros(lq, hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((lq, hq), float("-inf"), dtype=torch.float64)
    for h in range(hq):
        kh = h // group
        scores = (q[:, h, :] @ k[:, kh, :].T) * scale
        if logit_cap > 0:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        for i in range(lq):
            s = scores[i][visible[i]]
            vals = v[:, kh, :][visible[i]]
            if sinks is not None:
                s = torch.cat([s, sinks[h].double().cpu().reshape(1)])
                vals = torch.cat([vals, torch.zeros(1, vals.shape[-1], dtype=torch.float64)])
            if s.numel() == 0:
                continue
            m = s.max()
            w = torch.exp(s - m)
            out[i, h] = (w[:, None] * vals).sum(0) / w.sum()
            lse[i, h] = m + torch.log(w.sum())
    return out, lse


def tolerance(dtype: torch.dtype) -> float:
    """Allowed relative error (max |out - ref| / max |ref|) for outputs of this dtype."""
    return {torch.float64: 1e-10, torch.float32: 1e-5}.get(dtype, 2e-2)


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
