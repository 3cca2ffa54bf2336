"""P·V for torch attention code (emulations of vendor kernels, reference paths) in which keys a row does
not see add exactly nothing to it, whatever their values hold (docs/design.md §3.2).

`p @ v` adds p · v for every key, and 0 · Inf = NaN: a key masked for one row (p = 0) whose V holds Inf
or NaN turns that row into NaN. `masked_pv` zeroes the V entries that are not finite before the product
and gives NaN to the rows that *see* such a key (their exact output is not finite either), the same rule
as the Triton helper `attn_core.ops.masked_values_triton.finite_values` and the torch_native backend.
"""

from __future__ import annotations

import torch


def masked_pv(p: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`p` `[H, Sq, Sk]` probabilities (0 for keys a row does not see), `v` `[H, Sk, Dv]`, `visible` bool
    `[Sq, Sk]` or `[H, Sq, Sk]` (which row sees which key) -> `[H, Sq, Dv]` in `p`'s dtype: `p @ v` with
    non-finite V entries zeroed, and NaN in every row that sees a key whose V held Inf / NaN. A row that
    sees no key is 0 whatever `p` holds there (a softmax over nothing but -inf gives NaN).

    Example: p [[[1, 0], [0.5, 0.5]]], v [[[1], [inf]]], visible [[T, F], [T, T]] -> [[[1], [nan]]]
    (row 0 does not see key 1, so its Inf adds nothing; row 1 sees it)."""
    finite = torch.isfinite(v)
    bad_key = (~finite.all(dim=-1)).to(p.dtype)  # [H, Sk]
    clean = torch.where(finite, v, torch.zeros((), dtype=v.dtype, device=v.device)).to(p.dtype)
    vis = visible.expand(p.shape)
    p = torch.where(vis.any(-1, keepdim=True), p, torch.zeros((), dtype=p.dtype, device=p.device))
    sees_bad = (vis.to(p.dtype) @ bad_key[..., None])[..., 0] > 0  # [H, Sq]
    return (p @ clean).masked_fill(sees_bad[..., None], float("nan"))


__all__ = ["masked_pv"]
