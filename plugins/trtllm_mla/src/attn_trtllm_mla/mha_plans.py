"""Per-step plan of `trtllm_mha` (built once per step, shared by every layer).

- DECODE, and TARGET_VERIFY (every request the same draft count: `q_len_per_req`) -> the decode kernel:
  block tables of every request, key counts (including the new tokens), the longest request.
- EXTEND, MIXED, DRAFT_EXTEND -> the context kernel over the requests with new tokens: their block tables,
  key counts, cumulative query and key offsets and host maxima.

Block tables are attn-core's (`attn_core.ops.kv_indices.page_table_from_req_to_token`): int32 `[n, width]`,
page j of a request in column j, the dummy page 0 past its last page (never read: `seq_lens` bounds the
kernels), width the longest request's page count. Lengths come from the batch's host copies: one
host-to-device copy per context plan, no device sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attn_core.ops.kv_indices import page_table_from_req_to_token, pages_for


@dataclass(frozen=True)
class MhaPlan:
    """`kernel` "decode" or "context"; int32 `block_tables` `[n, width]` and `seq_lens` `[n]` on the device;
    decode: `q_len` queries per request, `max_seq_len` (the longest request, or the graph table's capacity);
    context: `cum_seq_lens_q` / `cum_seq_lens_kv` `[n + 1]`, `max_q_len`, `max_kv_len`."""

    kernel: str
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
    q_len: int = 1
    cum_seq_lens_q: Optional[torch.Tensor] = None
    cum_seq_lens_kv: Optional[torch.Tensor] = None
    max_q_len: int = 0


@dataclass
class MhaMetadata:
    """One step's plan and the kernel it feeds (`path`, for attn-core's debug switch); `plan` is None for an
    extend step without new tokens."""

    path: str
    plan: Optional[MhaPlan]


def table_width(tokens: int, page_size: int) -> int:
    """Columns of a block table for requests of at most `tokens` keys: their pages, at least 1 (a table has a
    column). Example: (70, 32) -> 3; (0, 16) -> 1."""
    return max(1, pages_for(tokens, page_size))


def block_tables(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    width: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """attn-core's block table of `rows` with `seq_lens` keys, `[len(rows), width]` int32, written into the
    first rows of `out` (a CUDA graph's fixed buffer) when given."""
    table = page_table_from_req_to_token(req_to_token, rows, seq_lens, page_size, width)
    if out is None:
        return table
    out[: table.shape[0]].copy_(table)
    return out[: table.shape[0]]


def decode_q_len(mode_is_decode: bool, mode_is_verify: bool, q_lens: list[int]) -> Optional[int]:
    """Queries per request when the decode kernel serves the step (DECODE: 1; TARGET_VERIFY with the same
    count for every request: that count), else None (the context kernel serves).
    Examples: (True, False, [1, 1]) -> 1; (False, True, [4, 4]) -> 4; (False, True, [4, 2]) -> None."""
    if mode_is_decode:
        return 1
    if mode_is_verify and q_lens and len(set(q_lens)) == 1 and q_lens[0] > 0:
        return q_lens[0]
    return None
