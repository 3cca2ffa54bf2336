"""`attend`: one part of attention over a step's plan, as an output and its LSE, whatever the split count.

With one split the kernel writes the output directly; with more it writes float32 partials that
`merge_splits` merges (split-K). Used by both backends for their dense paths and by dual chunk for each part.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn_sparse.kernels.merge import merge_splits
from attn_sparse.kernels.ranged import launch_ranged
from attn_sparse.plan import StepPlan


def attend(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    plan: StepPlan,
    *,
    part: int,
    chunk_len: int,
    scale: float,
    logit_cap: float,
    out_dtype: torch.dtype,
    want_lse: bool,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Attention of the step's q rows (`[T, Hq, D]`) over the keys of `part` (`attn_sparse.kernels.ranged`):
    the output `[T, Hq, Dv]` in `out_dtype` and, with `want_lse`, the natural-log LSE float32 `[T, Hq]`
    (-inf for a row that saw no key, whose output is 0)."""
    T, hq = q.shape[0], q.shape[1]
    dv = v_buf.shape[2]
    out = torch.empty((T, hq, dv), dtype=out_dtype, device=q.device)
    lse = torch.empty((T, hq), dtype=torch.float32, device=q.device) if want_lse else None
    args = dict(part=part, chunk_len=chunk_len, scale=scale, logit_cap=logit_cap)
    if plan.splits == 1:
        launch_ranged(q, k_buf, v_buf, plan, out=out, lse=lse, splits=1, **args)
        return out, lse
    partial_o = torch.empty((T, hq, plan.splits, dv), dtype=torch.float32, device=q.device)
    partial_lse = torch.empty((T, hq, plan.splits), dtype=torch.float32, device=q.device)
    launch_ranged(q, k_buf, v_buf, plan, out=partial_o, lse=partial_lse, splits=plan.splits, **args)
    merge_splits(partial_o, partial_lse, out, lse)
    return out, lse
