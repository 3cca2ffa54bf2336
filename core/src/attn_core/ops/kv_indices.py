"""KV-index builders in plain torch (device-agnostic, no host sync when sizes are passed in).

These are the reference and the CPU path; plugins may add faster versions and test against these.

Worked example (page_size 1): two requests in rows 3 and 0 with kv lengths 2 and 3,
req_to_token[3, :2] = [7, 8], req_to_token[0, :3] = [4, 5, 6]:
    kv_indptr  = [0, 2, 5]
    kv_indices = [7, 8, 4, 5, 6]
"""

from __future__ import annotations

from typing import Optional

import torch


def exclusive_cumsum(lens: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """[n] lengths → [n+1] offsets starting at 0."""
    out = torch.zeros(lens.shape[0] + 1, dtype=dtype, device=lens.device)
    out[1:] = torch.cumsum(lens, dim=0)
    return out


def kv_indptr_from_lens(kv_lens: torch.Tensor) -> torch.Tensor:
    """CSR row pointer `[bs+1]` int32 of per-request KV lengths."""
    return exclusive_cumsum(kv_lens, torch.int32)


def kv_indices_from_req_to_token(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    total: int,
    kv_start: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Concatenate each request's slots `req_to_token[row, start : start + len]` (int32 `[total]`).

    `total` = kv_indptr[-1], passed in from the host so no sync happens. `kv_start` (per request,
    default 0) skips leading tokens, e.g. encoder tokens for a decoder self-attention layer.
    """
    device = req_to_token.device
    tok = torch.arange(total, device=device, dtype=torch.int64)
    owner = torch.searchsorted(kv_indptr[1:].to(torch.int64), tok, right=True)
    col = tok - kv_indptr.to(torch.int64)[owner]
    if kv_start is not None:
        col = col + kv_start.to(torch.int64)[owner]
    rows = req_pool_indices.to(torch.int64)[owner]
    return req_to_token[rows, col].to(torch.int32)


def page_table_from_req_to_token(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    max_pages: int,
) -> torch.Tensor:
    """`[bs, max_pages]` int32 page ids of each request's KV (0, the dummy page, past its end).

    Relies on the allocator's layout: token i of a request sits at offset i % page_size of its page.
    """
    cols = torch.arange(max_pages, device=req_to_token.device, dtype=torch.int64) * page_size
    cols = cols.clamp(max=req_to_token.shape[1] - 1)
    rows = req_pool_indices.to(torch.int64)
    pages = req_to_token[rows[:, None], cols[None, :]] // page_size
    valid = cols[None, :] < kv_lens.to(torch.int64)[:, None]
    return torch.where(valid, pages, torch.zeros_like(pages)).to(torch.int32)


def positions_from_lens(prefix_lens: torch.Tensor, extend_lens: torch.Tensor, total: int) -> torch.Tensor:
    """int64 `[total]`: token i of request r sits at position prefix_lens[r] + i."""
    starts = exclusive_cumsum(extend_lens, torch.int64)
    tok = torch.arange(total, device=extend_lens.device, dtype=torch.int64)
    owner = torch.searchsorted(starts[1:], tok, right=True)
    return prefix_lens.to(torch.int64)[owner] + tok - starts[owner]


def extend_start_loc_from_lens(extend_lens: torch.Tensor) -> torch.Tensor:
    """int32 `[bs]`: offset of each request's first new token in the flattened token dimension."""
    return exclusive_cumsum(extend_lens, torch.int32)[:-1]
