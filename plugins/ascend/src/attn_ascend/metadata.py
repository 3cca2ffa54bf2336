"""Per-step metadata of the ascend backend and the pure helpers that build it.

The operators take sequence lengths on the host (ATB PagedAttention's context_lens is a CPU int32
tensor; the fused-infer operator's actual_seq_lengths[_kv] are int lists), so metadata keeps them as
host data built from the batch's `_cpu` fields; `forward` never reads a device tensor back.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch


@dataclass
class AscendMetadata:
    """What every layer of one step reads.

    block_tables: int32 `[rows, max_pages]` on the device, page ids of each row's KV (row = request,
        requests without new tokens dropped in extend modes).
    seq_lens_cpu: int32 `[rows]` on the host, keys per row (the paged-attention operator's context_lens).
    seq_lens: the same as a list (the fused-infer operator's actual_seq_lengths_kv).
    q_cumsum: cumulative new-token counts per row (the fused-infer operator's TND actual_seq_lengths).
    graph_mode: the metadata points at persistent graph buffers.
    """

    block_tables: torch.Tensor
    seq_lens_cpu: torch.Tensor
    seq_lens: list[int]
    q_cumsum: list[int]
    graph_mode: bool = False


def pages_for(tokens: int, page_size: int) -> int:
    """Pages holding `tokens` tokens. Example: pages_for(129, 128) == 2, pages_for(0, 16) == 0."""
    return -(-tokens // page_size)


def page_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, max_len: int, page_size: int) -> torch.Tensor:
    """Block table of the requests in rows `req_pool_indices` of `req_to_token` (int32 slot ids
    `[max_reqs, max_context_len]`): page id = slot of each page's first token // page_size, for the
    first `max_len` tokens. Returns int32 `[len(req_pool_indices), pages_for(max_len, page_size)]` on
    req_to_token's device (entries past a request's own length are whatever its row holds there).

    Example: page_size 2, row [8, 9, 4, 5, 6, 7], max_len 5 -> first slots of pages 8, 4, 6 -> [[4, 2, 3]].
    """
    cols = req_to_token[req_pool_indices.long(), : pages_for(max_len, page_size) * page_size : page_size]
    return torch.div(cols, page_size, rounding_mode="floor").to(torch.int32)


def host_metadata(seq_lens: list[int], q_lens: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Rows that carry new tokens: (their indices, their key counts, cumulative new-token counts).

    Example: seq_lens [7, 4, 9], q_lens [3, 0, 2] -> ([0, 2], [7, 9], [3, 5])."""
    keep = [i for i, n in enumerate(q_lens) if n > 0]
    return keep, [seq_lens[i] for i in keep], list(accumulate(q_lens[i] for i in keep))
