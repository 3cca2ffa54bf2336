"""The plain-torch path of `merge_state` and the argument checks both paths share (see
`attn_core.ops.merge_state` for the math and the conventions).

Worked example (one token, one head, D 1): o_a [[[2.0]]], lse_a [[0.0]], o_b [[[4.0]]], lse_b [[0.0]]
(equal weights) give out [[[3.0]]] and out_lse [[log 2]] = [[0.6931]]; with lse_b [[-inf]] (B saw no
key) out is o_a and out_lse lse_a.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn_core.contract.errors import InvalidArgumentError

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_merge_args(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: Optional[torch.Tensor],
    out_lse: Optional[torch.Tensor],
) -> None:
    """Typed errors for mismatched shapes, dtypes or devices (shared by both paths)."""
    if o_a.dim() != 3:
        raise InvalidArgumentError("o_a", "a [T, H, D] tensor", tuple(o_a.shape))
    if o_a.dtype not in _FLOAT_DTYPES:
        raise InvalidArgumentError("o_a", f"a float dtype among {_FLOAT_DTYPES}", o_a.dtype)
    T, H, _ = o_a.shape
    if o_b.shape != o_a.shape or o_b.dtype != o_a.dtype:
        raise InvalidArgumentError(
            "o_b", f"shape {tuple(o_a.shape)} and dtype {o_a.dtype} like o_a", (tuple(o_b.shape), o_b.dtype)
        )
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(lse.shape) != (T, H) or lse.dtype != torch.float32:
            raise InvalidArgumentError(name, f"float32 of shape ({T}, {H})", (tuple(lse.shape), lse.dtype))
    if out is not None and (out.shape != o_a.shape or out.dtype != o_a.dtype):
        raise InvalidArgumentError(
            "out", f"shape {tuple(o_a.shape)} and dtype {o_a.dtype}", (tuple(out.shape), out.dtype)
        )
    if out_lse is not None and (tuple(out_lse.shape) != (T, H) or out_lse.dtype != torch.float32):
        raise InvalidArgumentError("out_lse", f"float32 of shape ({T}, {H})", (tuple(out_lse.shape), out_lse.dtype))
    for name, t in (("o_b", o_b), ("lse_a", lse_a), ("lse_b", lse_b), ("out", out), ("out_lse", out_lse)):
        if t is not None and t.device != o_a.device:
            raise InvalidArgumentError(name, f"a tensor on {o_a.device} like o_a", t.device)


def merge_state_torch(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    out_lse: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of `merge_state` (any device); returns `(out, out_lse)`."""
    check_merge_args(o_a, lse_a, o_b, lse_b, out, out_lse)
    cd = torch.float64 if o_a.dtype == torch.float64 else torch.float32
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a = torch.exp(lse_a - m)  # exactly 0 for an empty side (lse -inf)
    w_b = torch.exp(lse_b - m)
    total = w_a + w_b
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    # where(), not a product: 0 * garbage of an empty side would be NaN
    part_a = torch.where((w_a > 0)[..., None], o_a.to(cd) * (w_a * inv).to(cd)[..., None], 0.0)
    part_b = torch.where((w_b > 0)[..., None], o_b.to(cd) * (w_b * inv).to(cd)[..., None], 0.0)
    merged = (part_a + part_b).to(o_a.dtype)
    merged_lse = m + torch.log(total)
    if out is None:
        out = merged
    else:
        out.copy_(merged)
    if out_lse is None:
        out_lse = merged_lse
    else:
        out_lse.copy_(merged_lse)
    return out, out_lse
