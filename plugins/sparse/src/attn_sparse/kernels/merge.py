"""Merge the split partial results of the attention kernels (split-K) into the output and its LSE.

Row t, head h has S partial outputs o_s (float32) over disjoint key sets, with natural-log LSEs l_s; the
merged result is lse = log(sum_s exp(l_s)) and o = sum_s exp(l_s - lse) * o_s (attn-core's `merge_state`
rule for two parts, generalized to S). A split whose LSE is -inf saw no key: it is not read (its output may
be anything). A row with no key anywhere gets output 0 and LSE -inf. A split whose LSE is NaN (it saw a NaN
score) makes its row's output and LSE NaN, as one unsplit pass would (docs/design.md §3.2: a value a row
sees reaches it, whatever it is).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_splits_kernel(
    PO,
    stride_pt,
    stride_ph,
    stride_ps,
    PL,
    stride_lt,
    stride_lh,
    OUT,
    stride_ot,
    stride_oh,
    LSE,
    stride_et,
    stride_eh,
    v_dim,
    num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    lse = tl.load(PL + t * stride_lt + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    # a split that saw a NaN score has a NaN LSE: the row is NaN (a max over the splits skips NaN on a GPU,
    # and NaN > -inf is false, so the split would otherwise drop out of the merge)
    nan_split = tl.max((lse != lse).to(tl.int32), 0) > 0
    lse = tl.where(lse != lse, float("-inf"), lse)
    m = tl.max(lse, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(lse > float("-inf"), tl.exp(lse - m_use), 0.0)
    total = tl.sum(w, 0)
    d = tl.arange(0, BLOCK_DV)
    parts = tl.load(
        PO + t * stride_pt + h * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=(w > 0)[:, None] & (d[None, :] < v_dim),
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    out = tl.where(nan_split, float("nan"), out)
    tl.store(OUT + t * stride_ot + h * stride_oh + d, out.to(OUT.dtype.element_ty), mask=d < v_dim)
    if STORE_LSE:
        merged = tl.where(total > 0, m_use + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
        tl.store(LSE + t * stride_et + h * stride_eh, tl.where(nan_split, float("nan"), merged))


def merge_splits(
    partial_o: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor] = None
) -> None:
    """Write into `out` `[T, H, Dv]` (any float dtype) the merge of `partial_o` float32 `[T, H, S, Dv]` with
    `partial_lse` float32 `[T, H, S]` (unit stride along S), and the merged LSE into `lse` (float32
    `[T, H]`) when given.

    Example: two splits of one row with LSEs (log 1, log 3) and outputs (a, b) merge to (a + 3 b) / 4, LSE log 4.
    """
    T, H, S, dv = partial_o.shape
    if T == 0 or H == 0:
        return
    _merge_splits_kernel[(T, H)](
        partial_o,
        partial_o.stride(0),
        partial_o.stride(1),
        partial_o.stride(2),
        partial_lse,
        partial_lse.stride(0),
        partial_lse.stride(1),
        out,
        out.stride(0),
        out.stride(1),
        lse if lse is not None else partial_lse,
        lse.stride(0) if lse is not None else 0,
        lse.stride(1) if lse is not None else 0,
        dv,
        S,
        BLOCK_S=triton.next_power_of_2(max(S, 2)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        STORE_LSE=lse is not None,
        num_warps=4 if partial_o.is_cuda else 1,
    )
