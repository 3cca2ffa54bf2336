"""The position rule of dual chunk attention (Qwen2.5-1M's `dual_chunk_attention_config`: chunk_size,
local_size), for the engine's rotary embedding.

Keys are cut into chunks of `chunk_len = chunk_size - local_size` positions. Every key, and the query of
the intra-chunk part, is rotated at its position inside its chunk; the two other query variants at
positions that keep the relative distances within the model's trained range:

    key, query (intra):  p % chunk_len
    query_succ:          min(p % chunk_len + chunk_len, chunk_size)     (previous chunk)
    query_inter:         min(2 * chunk_len - 1, chunk_size)              (every earlier chunk; one value)

So a query and a key of the same chunk see their true distance, and so do a query at in-chunk position
i <= local_size and a key of the previous chunk (i + chunk_len - j % chunk_len); farther pairs see clamped ones.

attn applies no rotary embedding (the engine owns RoPE, docs/engine-authors.md): the engine rotates q three
times and k once at these positions and hands attn `q`, `q_succ`, `q_inter` and `k`.

Worked example: chunk_size 10, local_size 2 (chunk_len 8), positions [0, 7, 8, 21]: key / query [0, 7, 0, 5],
query_succ [8, 10, 8, 10] (0 + 8, min(15, 10), ...), query_inter [10, 10, 10, 10] (min(15, 10)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_core.contract.errors import InvalidArgumentError


def chunk_length(chunk_size: int, local_size: int) -> int:
    """chunk_size - local_size, after checking both are ints with 0 <= local_size < chunk_size
    (`InvalidArgumentError` naming the argument). Example: chunk_length(8192, 1024) == 7168."""
    for name, value in (("chunk_size", chunk_size), ("local_size", local_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(name, "an int", value)
    if chunk_size < 1:
        raise InvalidArgumentError("chunk_size", "an int >= 1", chunk_size)
    if not 0 <= local_size < chunk_size:
        raise InvalidArgumentError("local_size", f"an int in [0, chunk_size={chunk_size})", local_size)
    return chunk_size - local_size


@dataclass(frozen=True)
class DualChunkPositions:
    """Rotary positions of the module docstring, each shaped like the token positions given (int64)."""

    key: torch.Tensor
    query: torch.Tensor
    query_succ: torch.Tensor
    query_inter: torch.Tensor


def dual_chunk_positions(positions: torch.Tensor, chunk_size: int, local_size: int) -> DualChunkPositions:
    """The rotary positions of tokens at `positions` (e.g. `ForwardBatch.positions`, any integer shape, on
    any device; no host sync) under dual chunk attention."""
    chunk_len = chunk_length(chunk_size, local_size)
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise InvalidArgumentError("positions", "an integer tensor", positions.dtype)
    in_chunk = torch.remainder(positions.to(torch.int64), chunk_len)
    inter = torch.full_like(in_chunk, min(2 * chunk_len - 1, chunk_size))
    return DualChunkPositions(
        key=in_chunk,
        query=in_chunk,
        query_succ=torch.clamp(in_chunk + chunk_len, max=chunk_size),
        query_inter=inter,
    )
