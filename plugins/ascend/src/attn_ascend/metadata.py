"""Per-step metadata of the ascend backend and the pure helpers that build it.

The operators take sequence lengths on the host (ATB PagedAttention's context_lens is a CPU int32
tensor; the fused-infer operator's actual_seq_lengths[_kv] are int lists), so metadata keeps them as
host data built from the batch's `_cpu` fields; `forward` never reads a device tensor back. Block tables
and page counts are attn-core's (`attn_core.ops.kv_indices.page_table_from_req_to_token`, `pages_for`).
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


def host_metadata(seq_lens: list[int], q_lens: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Rows that carry new tokens: (their indices, their key counts, cumulative new-token counts).

    Example: seq_lens [7, 4, 9], q_lens [3, 0, 2] -> ([0, 2], [7, 9], [3, 5])."""
    keep = [i for i, n in enumerate(q_lens) if n > 0]
    return keep, [seq_lens[i] for i in keep], list(accumulate(q_lens[i] for i in keep))
