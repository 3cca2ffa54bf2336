"""Merge two partial attention results over disjoint key sets (docs/design.md §3.2 conventions).

If `(o_a, lse_a)` is attention of some queries over key set A and `(o_b, lse_b)` over a disjoint set
B, then attention over A ∪ B is

    lse = log(exp(lse_a) + exp(lse_b))
    o   = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

Shapes: o `[T, H, D]` (any float dtype), lse `[T, H]` float32, natural log. A side whose LSE is -inf
saw no key: its output is ignored (it may hold garbage, even NaN) and the other side passes through
unchanged; when both sides are empty the result is output 0, LSE -inf. Never NaN.

`merge_state` runs the Triton kernel (`attn_core.ops.merge_state_triton`) for CUDA tensors when
Triton is importable and the plain torch version otherwise.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from attn_core.ops.merge_state_torch import merge_state_torch


def triton_available() -> bool:
    """Whether the Triton path can be used (Triton importable)."""
    return importlib.util.find_spec("triton") is not None


def merge_state(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    out_lse: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from the two partial results.

    o_a, o_b `[T, H, D]`; lse_a, lse_b `[T, H]` float32 natural log. Writes into `out` / `out_lse`
    when given and returns `(out, out_lse)`: output in o_a's dtype, LSE float32.
    """
    if o_a.is_cuda and triton_available():
        from attn_core.ops.merge_state_triton import merge_state_triton

        return merge_state_triton(o_a, lse_a, o_b, lse_b, out, out_lse)
    return merge_state_torch(o_a, lse_a, o_b, lse_b, out, out_lse)
