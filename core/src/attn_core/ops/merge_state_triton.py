"""Triton kernel of `merge_state` (see `attn_core.ops.merge_state` for the math and conventions;
the argument checks are `attn_core.ops.merge_state_torch`'s).

One program per (token, head) merges the two `[D]` rows in float32. Importing this module imports
Triton; with `TRITON_INTERPRET=1` set before the import the kernel runs on CPU tensors (used by the
tests).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from attn_core.contract.errors import InvalidArgumentError
from attn_core.ops.merge_state_torch import check_merge_args


@triton.jit
def _merge_state_kernel(
    o_a,
    lse_a,
    o_b,
    lse_b,
    out,
    out_lse,
    num_heads,
    head_dim,
    stride_a_t,
    stride_a_h,
    stride_b_t,
    stride_b_h,
    stride_o_t,
    stride_o_h,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    la = tl.load(lse_a + t * num_heads + h)
    lb = tl.load(lse_b + t * num_heads + h)
    m = tl.maximum(la, lb)
    m = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m)
    wb = tl.exp(lb - m)
    total = wa + wb
    safe_total = tl.where(total > 0, total, 1.0)  # both sides empty: no division by or log of 0
    inv = tl.where(total > 0, 1.0 / safe_total, 0.0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    xa = tl.load(o_a + t * stride_a_t + h * stride_a_h + d, mask=dmask, other=0.0).to(tl.float32)
    xb = tl.load(o_b + t * stride_b_t + h * stride_b_h + d, mask=dmask, other=0.0).to(tl.float32)
    # where(), not a product: an empty side (weight 0) may hold garbage and 0 * NaN is NaN
    merged = tl.where(wa > 0, xa * (wa * inv), 0.0) + tl.where(wb > 0, xb * (wb * inv), 0.0)
    tl.store(out + t * stride_o_t + h * stride_o_h + d, merged.to(out.dtype.element_ty), mask=dmask)
    tl.store(out_lse + t * num_heads + h, tl.where(total > 0, m + tl.log(safe_total), float("-inf")))


def merge_state_triton(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    out_lse: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path of `merge_state`; returns `(out, out_lse)`.

    o rows need a unit stride along D; LSE tensors must be contiguous. float64 is not supported here
    (use the torch path).
    """
    check_merge_args(o_a, lse_a, o_b, lse_b, out, out_lse)
    if o_a.dtype == torch.float64:
        raise InvalidArgumentError("o_a", "float16, bfloat16 or float32 for the Triton path", o_a.dtype)
    T, H, D = o_a.shape
    if out is None:
        out = torch.empty_like(o_a)
    if out_lse is None:
        out_lse = torch.empty((T, H), dtype=torch.float32, device=o_a.device)
    for name, t in (("o_a", o_a), ("o_b", o_b), ("out", out)):
        if D > 1 and t.stride(2) != 1:
            raise InvalidArgumentError(name, "unit stride along head_dim", t.stride())
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b), ("out_lse", out_lse)):
        if not t.is_contiguous():
            raise InvalidArgumentError(name, "a contiguous tensor", t.stride())
    if T == 0 or H == 0:
        return out, out_lse
    _merge_state_kernel[(T, H)](
        o_a,
        lse_a,
        o_b,
        lse_b,
        out,
        out_lse,
        H,
        D,
        o_a.stride(0),
        o_a.stride(1),
        o_b.stride(0),
        o_b.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_D=triton.next_power_of_2(max(D, 1)),
    )
    return out, out_lse
