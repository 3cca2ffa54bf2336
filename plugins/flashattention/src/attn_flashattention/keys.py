"""Key lists: a step's queries and keys in the form FA4's varlen call takes them, built once per step on
the device (no host sync: every size comes from the batch's host copies).

FA4 reads paged K/V through `page_table` `[n, width]` (int32, contiguous): row b lists the pages of
sequence b, and it reads only its first `seqused_k[b]` keys (page `p // page_size`, offset `p % page_size`
of key p). A sequence's queries are rows `cu_seqlens_q[b] .. cu_seqlens_q[b+1]` of q; with `causal` they
are the last of its keys (query i of n sees keys 0 .. len - n + i).

Three kinds of list (`KeyList`):
- per page: each request's keys from the start of its `req_to_token` row, at the pool's page size
  (`page_lists`; self attention, and cross attention over the encoder tokens, which start a row);
- per token: each request's keys from a column that need not start a page (`token_lists`: decoder self
  attention of encoder-decoder batches, whose keys follow the encoder tokens), the pool viewed with
  page size 1 (a page id is then a slot id);
- per query: one sequence per query, listing the keys its verify mask lets it see in position order
  (`tree_key_lists`: TARGET_VERIFY with a custom mask, also read per token, not causal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from attn_core.ops.kv_indices import exclusive_cumsum, page_table_from_req_to_token, rows_in_table, slots_in_pool
from attn_core.ops.kv_indices import pages_for as pages_holding


@dataclass(frozen=True)
class KeyList:
    """The query and key arguments of one FA4 call.

    cu_seqlens_q: int32 `[n + 1]` on the device, query offsets of the n sequences in q's rows.
    max_seqlen_q: host int, at least every sequence's query count (FA4's scheduling bound).
    seqused_k: int32 `[n]` on the device, keys of each sequence.
    page_table: int32 `[n, width]` on the device, contiguous, page ids of each sequence (entries past its
        keys are never read).
    page_size: tokens per page of the table: the pool's, or 1 (a page id is a slot id).
    causal: each sequence's queries are its last keys (bottom-right causal); False: every query sees all
        of its sequence's keys.
    """

    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    seqused_k: torch.Tensor
    page_table: torch.Tensor
    page_size: int
    causal: bool


def pages_for(tokens: int, page_size: int) -> int:
    """Pages holding `tokens` tokens, at least 1 (FA4 takes no empty table). Example: pages_for(33, 16) == 3,
    pages_for(0, 16) == 1."""
    return max(1, pages_holding(tokens, page_size))


def query_offsets(q_lens: torch.Tensor) -> torch.Tensor:
    """int32 `[n + 1]` offsets of `q_lens` query rows per sequence. Example: [3, 0, 2] -> [0, 3, 3, 5]."""
    return exclusive_cumsum(q_lens, torch.int32)


def page_lists(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    page_size: int,
    width: int,
    num_slots: Optional[int] = None,
    fault: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """int32 `[n, width]` page ids of each request's first `lens` keys, from the start of its row
    (`req_to_token[rows[b]]`; 0 past its end). Relies on the allocator's layout: key i sits at offset
    i % page_size of its page. With `num_slots` and `fault` (the backend's fault word) a row outside the
    table or a slot outside the pool gives the dummy page 0 and is recorded (no out-of-bounds read).

    Example (page_size 2): row [8, 9, 4, 5, 6, 7], lens 5, width 3 -> first slots of pages 8, 4, 6 -> [[4, 2, 3]].
    """
    return page_table_from_req_to_token(req_to_token, rows, lens, page_size, width, num_slots=num_slots, fault=fault)


def token_lists(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    start: torch.Tensor,
    lens: torch.Tensor,
    width: int,
    num_slots: Optional[int] = None,
) -> torch.Tensor:
    """int32 `[n, width]` slot ids of each request's keys `start[b] .. start[b] + lens[b] - 1` of its row
    (0 past its end): a table for the pool viewed with page size 1. A device row outside the table (refused
    by the step check, raised at the next step) or a slot outside a pool of `num_slots` gives the dummy slot 0.

    Example: row [10, 11, 12, 13, 14], start 2, lens 3, width 4 -> [[12, 13, 14, 0]].
    """
    dev = req_to_token.device
    cols = torch.arange(width, device=dev, dtype=torch.int64)
    at = (start.to(torch.int64)[:, None] + cols[None, :]).clamp(0, req_to_token.shape[1] - 1)
    safe, ok = rows_in_table(rows, req_to_token.shape[0])
    slots = req_to_token[safe[:, None], at]
    valid = (cols[None, :] < lens.to(torch.int64)[:, None]) & ok[:, None] & slots_in_pool(slots, num_slots)
    return torch.where(valid, slots, torch.zeros_like(slots)).to(torch.int32)


def tree_key_lists(
    custom_mask: torch.Tensor,
    mask_indptr: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    q_req: torch.Tensor,
    q_idx: torch.Tensor,
    q_lens: torch.Tensor,
    width: int,
    window: Optional[int] = None,
    num_slots: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One key list per query of a TARGET_VERIFY step with a custom mask: (slot ids int32 `[T, width]`,
    key counts int32 `[T]`), the slots of the keys query t may see in position order (then the slots of the
    ones it may not, never read).

    custom_mask: bool, request after request a row-major `[q_lens[r], seq_lens[r]]` mask starting at
    `mask_indptr[r]` (SpecInfo's layout). Query t is query `q_idx[t]` of request `q_req[t]` (int64, both
    `[T]`), at position seq_lens - q_lens + q_idx. `window` W keeps only keys at positions >= position - W + 1.
    `width` (host) >= every seq_len. A device row outside the table or a slot outside a pool of `num_slots`
    is never read: such keys count as not visible.

    Example: one request, row [5, 6, 7], seq_len 3, two queries, mask [[1, 1, 0], [1, 0, 1]] ->
    slots [[5, 6, 7], [5, 7, 6]], counts [2, 2] (query 1 skips key 1).
    """
    dev = req_to_token.device
    req = q_req.to(torch.int64)
    seq = seq_lens.to(torch.int64)[req][:, None]
    cols = torch.arange(width, device=dev, dtype=torch.int64)[None, :]
    at = mask_indptr.to(torch.int64)[req][:, None] + q_idx.to(torch.int64)[:, None] * seq + cols
    visible = (cols < seq) & custom_mask.reshape(-1)[at.clamp(0, max(custom_mask.numel() - 1, 0))]
    if window is not None:
        position = seq - q_lens.to(torch.int64)[req][:, None] + q_idx.to(torch.int64)[:, None]
        visible &= cols >= position - window + 1
    safe, ok = rows_in_table(rows, req_to_token.shape[0])
    slots = req_to_token[safe[req][:, None], cols.clamp(max=req_to_token.shape[1] - 1)]
    readable = ok[req][:, None] & slots_in_pool(slots, num_slots)
    visible &= readable
    slots = torch.where(readable, slots, torch.zeros_like(slots))
    order = torch.sort((~visible).to(torch.uint8), dim=1, stable=True).indices  # visible keys first, in order
    return torch.gather(slots, 1, order).to(torch.int32), visible.sum(dim=1).to(torch.int32)


def verify_queries(q_lens_host: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, index within the request) of every query of a step whose requests carry `q_lens_host`
    queries (host int `[bs]`), as int64 `[T]` on `device` (one host-to-device copy each, no sync).

    Example: q_lens [2, 1] -> requests [0, 0, 1], indices [0, 1, 0]."""
    lens = q_lens_host.to(torch.int64)
    req = torch.repeat_interleave(torch.arange(lens.shape[0]), lens)
    start = torch.repeat_interleave(exclusive_cumsum(lens, torch.int64)[:-1], lens)
    idx = torch.arange(req.shape[0]) - start
    return req.to(device, non_blocking=True), idx.to(device, non_blocking=True)


@dataclass
class TreeVerify:
    """A TARGET_VERIFY step with a custom mask: what listing each query's keys needs (see
    `tree_key_lists` for the fields), and the lists made so far, one per window (None: no window).

    `offsets` int32 `[T + 1]` (0, 1, ..., T: each query its own sequence); `width` host int >= every
    seq_len. `keys(window)` builds a window's lists on first use; given `out` (a table `[T, width]` and
    counts `[T]`, e.g. CUDA-graph buffers) it writes them there and the `KeyList` reads those.
    """

    custom_mask: torch.Tensor
    mask_indptr: torch.Tensor
    req_to_token: torch.Tensor
    rows: torch.Tensor
    seq_lens: torch.Tensor
    q_req: torch.Tensor
    q_idx: torch.Tensor
    q_lens: torch.Tensor
    width: int
    offsets: torch.Tensor
    lists: dict = field(default_factory=dict)
    num_slots: Optional[int] = None  # the pool's slot count: slots outside it are never read

    def build(self, window: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(table, counts) of `window` from the current inputs (new tensors)."""
        inputs = (self.custom_mask, self.mask_indptr, self.req_to_token, self.rows, self.seq_lens)
        return tree_key_lists(*inputs, self.q_req, self.q_idx, self.q_lens, self.width, window, self.num_slots)

    def keys(self, window: Optional[int], out: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> KeyList:
        """The `KeyList` of `window`, built (into `out` when given) the first time it is asked for."""
        found = self.lists.get(window)
        if found is None:
            table, counts = self.build(window)
            if out is not None:
                out[0].copy_(table)
                out[1].copy_(counts)
                table, counts = out
            found = self.lists[window] = KeyList(self.offsets, 1, counts, table, 1, causal=False)
        return found
