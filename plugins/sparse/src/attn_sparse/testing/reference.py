"""Float64 references of attn-sparse's two backends, written plainly from their definitions (the backends'
module docstrings), one request at a time, independent of pools, plans and kernels.

- `double_sparsity_reference`: one DECODE query of one request over its keys: dense below the threshold
  (or with at most heavy_token_num keys), else per q head the heavy_token_num keys of largest approximate
  score (computed here from the keys' heavy channels, not read from a label cache), exact attention over
  those.
- `dual_chunk_reference`: queries of one request over its keys 0..p, the score of key j computed with the
  query variant of j's chunk relative to the query's (own chunk: q, previous: q_succ, earlier: q_inter),
  one softmax over all visible keys (no merging: the backend's exact merge must reproduce this).

Both return the output `[.., Hq, Dv]` and the natural-log LSE `[.., Hq]` in float64 on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _softmax_rows(scores: torch.Tensor, logit_cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, lse) of float64 scores `[..., n]` (-inf where masked), after the logit cap. A row with
    no visible key gets weights 0 and LSE -inf."""
    if logit_cap > 0:  # masked scores stay -inf
        scores = torch.where(torch.isfinite(scores), logit_cap * torch.tanh(scores / logit_cap), scores)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.where(torch.isfinite(lse)[..., None], torch.exp(scores - lse[..., None]), 0.0)
    return weights, lse


@dataclass(frozen=True)
class DoubleSparsityResult:
    """The reference's output `[Hq, Dv]`, LSE `[Hq]`, the positions each q head attended to (ascending), and
    per q head the gap between the k-th and (k+1)-th approximate scores (inf when dense): a test can
    check that its data has no near-tie at the cut, where float rounding could pick another key."""

    out: torch.Tensor
    lse: torch.Tensor
    kept: list[torch.Tensor]
    margins: torch.Tensor


def double_sparsity_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    channels: torch.Tensor,
    *,
    scale: float,
    heavy_token_num: int,
    sparse_decode_threshold: int,
    logit_cap: float = 0.0,
) -> DoubleSparsityResult:
    """One DECODE query q `[Hq, D]` of a request whose keys (the new one included, as cached) are k
    `[L, Hkv, D]`, v `[L, Hkv, Dv]`; `channels` `[Hkv, C]` the layer's heavy channels."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    channels = channels.long().cpu()
    L, hkv = k.shape[0], k.shape[1]
    hq = q.shape[0]
    group = hq // hkv
    dense = L < sparse_decode_threshold or L <= heavy_token_num
    outs, lses, kept, margins = [], [], [], []
    for h in range(hq):
        g = h // group
        if dense:
            keep = torch.arange(L)
            margins.append(float("inf"))
        else:
            ch = channels[g]
            approx = k[:, g, ch] @ q[h, ch]  # [L]: sum over the heavy channels of q * k
            order = torch.sort(-approx, stable=True).indices  # largest first, ties: lower position first
            ranked = approx[order]
            margins.append(float(ranked[heavy_token_num - 1] - ranked[heavy_token_num]))
            keep = torch.sort(order[:heavy_token_num]).values
        scores = (k[keep, g] @ q[h]) * scale
        w, lse = _softmax_rows(scores, logit_cap)
        outs.append(w @ v[keep, g])
        lses.append(lse)
        kept.append(keep)
    return DoubleSparsityResult(torch.stack(outs), torch.stack(lses), kept, torch.tensor(margins, dtype=torch.float64))


def dual_chunk_part(query_pos: torch.Tensor, key_pos: torch.Tensor, chunk_len: int) -> torch.Tensor:
    """`[Lq, Lk]` part of each (query, key) pair: 0 own chunk, 1 previous chunk, 2 an earlier chunk, -1 a
    key after the query (not visible). Example: chunk_len 4, query at 9, keys 0..9 -> [2, 2, 2, 2, 1, 1, 1, 1,
    0, 0]."""
    cq = (query_pos // chunk_len)[:, None]
    ck = (key_pos // chunk_len)[None, :]
    part = torch.where(ck == cq, 0, torch.where(ck == cq - 1, 1, 2))
    return torch.where(key_pos[None, :] <= query_pos[:, None], part, -1)


def dual_chunk_reference(
    q: torch.Tensor,
    q_succ: torch.Tensor,
    q_inter: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    chunk_len: int,
    scale: float,
    logit_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries q, q_succ, q_inter `[Lq, Hq, D]` at `q_positions` of one request whose key j (position j) is
    k[j] `[Lk, Hkv, D]`, v[j] `[Lk, Hkv, Dv]`: output `[Lq, Hq, Dv]`, LSE `[Lq, Hq]`. A variant given as None
    must not be needed (its scores are NaN, which no comparison passes)."""
    q_succ, q_inter = (torch.full_like(q, float("nan")) if x is None else x for x in (q_succ, q_inter))
    variants = torch.stack([q.double(), q_succ.double(), q_inter.double()]).cpu()  # [3, Lq, Hq, D]
    k, v = k.double().cpu(), v.double().cpu()
    hq, hkv = q.shape[1], k.shape[1]
    kh = k.repeat_interleave(hq // hkv, dim=1)  # [Lk, Hq, D]
    vh = v.repeat_interleave(hq // hkv, dim=1)
    part = dual_chunk_part(q_positions.long().cpu(), torch.arange(k.shape[0]), chunk_len)  # [Lq, Lk]
    every = torch.einsum("pqhd,khd->phqk", variants, kh) * scale  # [3, Hq, Lq, Lk]: each variant with each key
    chosen = torch.gather(every, 0, part.clamp(min=0).expand(1, hq, -1, -1)).squeeze(0)  # [Hq, Lq, Lk]
    scores = chosen.masked_fill((part < 0)[None], float("-inf"))
    w, lse = _softmax_rows(scores, logit_cap)
    return torch.einsum("hqk,khd->qhd", w, vh), lse.T
