"""torch_native's ragged op (`attn_core.contract.ragged`): each packed sequence's dense attention over its own
rows, in float32 (float64 for float32 inputs, as the paged path), in query chunks that keep the score
tensor under a byte budget. The sequence bounds come from the batch's host copy: no sync."""

from __future__ import annotations

from typing import Optional, Union

import torch

from attn_core.contract.ragged import RaggedBatch


def dense_ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ragged: RaggedBatch,
    scaling: float,
    return_lse: bool,
    max_score_bytes: int,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """q `[T, Hq, D]`, k `[T, Hkv, D]`, v `[T, Hkv, Dv]` → `[T, Hq·Dv]` in q's dtype (and the natural-log
    LSE `[T, Hq]` float32). Sequence i's rows cu[i] … cu[i+1]-1 attend to the same rows (to rows at or
    before their own offset when `ragged.causal`).

    Example: cu_seqlens [0, 2, 5]: rows 0-1 attend to rows 0-1, rows 2-4 to rows 2-4."""
    T, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    group = hq // hkv
    cd = torch.float64 if q.dtype in (torch.float32, torch.float64) else torch.float32
    out = torch.zeros((T, hkv, group, dv), dtype=cd, device=q.device)
    lse: Optional[torch.Tensor] = (
        torch.empty((T, hkv, group), dtype=torch.float32, device=q.device) if return_lse else None
    )
    bounds = ragged.cu_seqlens_cpu.tolist()
    for s0, s1 in zip(bounds, bounds[1:]):
        n = s1 - s0
        if n == 0:
            continue
        keys, vals = k[s0:s1].to(cd), v[s0:s1].to(cd)  # [n, Hkv, D]
        chunk = max(1, max_score_bytes // max(1, hq * n * 4))
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            qc = q[s0 + c0 : s0 + c1].to(cd).view(c1 - c0, hkv, group, d)
            s = torch.einsum("qkgd,nkd->kgqn", qc, keys) * scaling
            if ragged.causal:
                later = torch.arange(n, device=q.device)[None, :] > torch.arange(c0, c1, device=q.device)[:, None]
                s = s.masked_fill(later, float("-inf"))
            m = s.amax(dim=-1)
            e = torch.exp(s - m[..., None])
            denom = e.sum(dim=-1)
            o = torch.einsum("kgqn,nkd->qkgd", e, vals) / denom.permute(2, 0, 1)[..., None]
            out[s0 + c0 : s0 + c1] = o
            if lse is not None:
                lse[s0 + c0 : s0 + c1] = (torch.log(denom) + m).permute(2, 0, 1).to(torch.float32)
    o = out.reshape(T, hq * dv).to(q.dtype)
    return (o, lse.reshape(T, hq)) if lse is not None else o
