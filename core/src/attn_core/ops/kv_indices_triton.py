"""Triton kernel of `attn_core.ops.kv_indices.build_kv_indices`: one launch writes every request's
KV slot (or page) ids, so a backend's per-step metadata costs one kernel instead of a chain of torch ops.

One program per request: it sums the page counts of the requests before it (so no indptr has to be
built on the device first), then copies `req_to_token[row, start + j * page_size] // page_size` for its
pages. Importing this module imports Triton; with `TRITON_INTERPRET=1` set before the import the kernel
runs on CPU tensors (used by the tests).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from attn_core.errors import InvalidArgumentError


@triton.jit(do_not_specialize=["stride_row", "bs"])  # fewer launch-time checks; no recompiles per batch size
def _kv_indices_kernel(
    req_to_token,
    stride_row,
    req_pool_indices,
    kv_lens,
    kv_start,
    out,
    bs,
    PAGE_SIZE: tl.constexpr,
    HAS_START: tl.constexpr,
    BLOCK_BS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    before = tl.arange(0, BLOCK_BS)
    lens_before = tl.load(kv_lens + before, mask=(before < r) & (before < bs), other=0)
    out_start = tl.sum((lens_before + PAGE_SIZE - 1) // PAGE_SIZE, axis=0).to(tl.int64)
    n = (tl.load(kv_lens + r) + PAGE_SIZE - 1) // PAGE_SIZE
    row = tl.load(req_pool_indices + r).to(tl.int64)
    base = req_to_token + row * stride_row
    if HAS_START:
        base += tl.load(kv_start + r).to(tl.int64)
    for j in range(0, n, BLOCK):
        offs = j + tl.arange(0, BLOCK)
        keep = offs < n
        slot = tl.load(base + offs.to(tl.int64) * PAGE_SIZE, mask=keep, other=0)
        tl.store(out + out_start + offs, (slot // PAGE_SIZE).to(tl.int32), mask=keep)


def kv_indices_triton(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    out: torch.Tensor,
    page_size: int = 1,
    kv_start: Optional[torch.Tensor] = None,
) -> None:
    """Write the ids into `out` (int32, at least sum of pages long); arguments as in `build_kv_indices`."""
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return
    if req_to_token.stride(1) != 1:
        raise InvalidArgumentError("req_to_token", "a tensor with contiguous rows", tuple(req_to_token.stride()))
    _kv_indices_kernel[(bs,)](
        req_to_token,
        req_to_token.stride(0),
        req_pool_indices,
        kv_lens,
        kv_start if kv_start is not None else kv_lens,
        out,
        bs,
        PAGE_SIZE=page_size,
        HAS_START=kv_start is not None,
        BLOCK_BS=triton.next_power_of_2(bs),
        BLOCK=128,
    )
