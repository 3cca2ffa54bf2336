"""Chunked-prefix attention: which part of each request's cached prefix every chunk covers.

DeepSeek-style prefill without weight absorption needs the prefix's K/V decompressed from the latent
pool; doing that for a long prefix at once costs memory proportional to it. The engine instead
decompresses the prefix chunk by chunk; the backend attends the new tokens' queries to each chunk
(no mask: a prefix precedes every new token) and merges the partial results by their LSEs with the
new tokens' own causal attention.

Semantics (SGLang's prefix chunks): the batch shares one chunk capacity in tokens, so every request gets
the same chunk length `chunk_len = capacity // batch size`; chunk c covers prefix positions
`[c * chunk_len, (c + 1) * chunk_len)` of every request, clipped to the request's prefix (an empty range
for a request whose prefix ends earlier); there are `ceil(max prefix / chunk_len)` chunks (none without a
cached prefix). The plan is host-side and pure (no device, no sync); `chunk_slots` turns one chunk
into the pool slots the engine reads the latents from; `attend_with_prefix_chunks` runs the passes of
any backend and merges them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch

from attn_core.contract.errors import InvalidArgumentError
from attn_core.ops.merge_state import merge_state

Lengths = Union[Sequence[int], torch.Tensor]


@dataclass(frozen=True)
class PrefixChunk:
    """One chunk of the batch's cached prefixes (host int32 tensors; bs = batch size, N = num_tokens).

    starts `[bs]`: first prefix position of each request in the chunk (c * chunk_len for all);
    lens `[bs]`: the chunk's tokens of each request (0..chunk_len); cu_seqlens `[bs+1]`: their offsets in
    the chunk's packed K/V (what a ragged kernel takes as the key indptr); positions `[N]`: each packed
    token's position in its request (for rope); request `[N]`: the batch row each packed token belongs to.
    """

    index: int
    starts: torch.Tensor
    lens: torch.Tensor
    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    request: torch.Tensor
    max_len: int
    num_tokens: int


@dataclass(frozen=True)
class PrefixChunkPlan:
    """Every chunk of one batch, in order (empty when no request has a cached prefix)."""

    chunk_len: int
    chunks: tuple[PrefixChunk, ...]


def plan_prefix_chunks(prefix_lens: Lengths, capacity: int) -> PrefixChunkPlan:
    """Split each request's cached prefix (`prefix_lens[b]` tokens) into chunks that together hold at
    most `capacity` tokens: chunk_len = capacity // bs for every request, chunk c covering positions
    [c * chunk_len, (c + 1) * chunk_len) of each prefix that reaches it.

    Worked example: prefix_lens = [5, 0, 9], capacity = 10 -> chunk_len = 3, ceil(9 / 3) = 3 chunks:
        chunk 0: starts [0, 0, 0], lens [3, 0, 3], cu_seqlens [0, 3, 3, 6],
                 positions [0, 1, 2, 0, 1, 2], request [0, 0, 0, 2, 2, 2]
        chunk 1: starts [3, 3, 3], lens [2, 0, 3], cu_seqlens [0, 2, 2, 5],
                 positions [3, 4, 3, 4, 5], request [0, 0, 2, 2, 2]
        chunk 2: starts [6, 6, 6], lens [0, 0, 3], cu_seqlens [0, 0, 0, 3],
                 positions [6, 7, 8], request [2, 2, 2]
    Raises `InvalidArgumentError` for negative lengths or a capacity below the batch size (a chunk must
    hold at least one token of every request).
    """
    lens = torch.as_tensor(prefix_lens, dtype=torch.int64).reshape(-1).cpu()
    bs = lens.shape[0]
    if bs and int(lens.min()) < 0:
        raise InvalidArgumentError("prefix_lens", "lengths >= 0", lens.tolist())
    if capacity < max(1, bs):
        raise InvalidArgumentError("capacity", f">= the batch size ({bs}) tokens", capacity)
    chunk_len = capacity // max(1, bs)
    longest = int(lens.max()) if bs else 0
    chunks = []
    for c in range(-(-longest // chunk_len)):
        start = c * chunk_len
        n = (lens - start).clamp(min=0, max=chunk_len)
        cu = torch.zeros(bs + 1, dtype=torch.int64)
        torch.cumsum(n, 0, out=cu[1:])
        total = int(cu[-1])
        request = torch.repeat_interleave(torch.arange(bs), n)
        positions = start + torch.arange(total) - cu[:-1][request]
        chunks.append(
            PrefixChunk(
                index=c,
                starts=torch.full((bs,), start, dtype=torch.int32),
                lens=n.to(torch.int32),
                cu_seqlens=cu.to(torch.int32),
                positions=positions.to(torch.int32),
                request=request.to(torch.int32),
                max_len=int(n.max()),
                num_tokens=total,
            )
        )
    return PrefixChunkPlan(chunk_len, tuple(chunks))


def chunk_slots(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, chunk: PrefixChunk) -> torch.Tensor:
    """The pool slots of a chunk's tokens, in its packed order: int64 `[num_tokens]` on the table's
    device, `req_to_token[req_pool_indices[request[i]], positions[i]]` (two small host-to-device copies).

    Example: rows [4, 9], req_to_token[4, :6] = [40..45], req_to_token[9, :6] = [90..95], a chunk with
    request [0, 0, 1] and positions [3, 4, 3] -> [43, 44, 93]."""
    dev = req_to_token.device
    rows = req_pool_indices.to(dev, torch.int64)[chunk.request.to(dev, torch.int64, non_blocking=True)]
    return req_to_token[rows, chunk.positions.to(dev, torch.int64, non_blocking=True)].to(torch.int64)


#: (output [T, H, Dv], natural-log LSE [T, H] float32) of one attention pass
Partial = tuple[torch.Tensor, torch.Tensor]


def attend_with_prefix_chunks(
    chunks: Sequence[PrefixChunk], attend_new: Callable[[], Partial], attend_chunk: Callable[[PrefixChunk], Partial]
) -> Partial:
    """The new tokens' attention over their prefix and themselves, from one pass over the new tokens
    (`attend_new`: causal over the step's K/V) and one pass per prefix chunk (`attend_chunk(chunk)`: no
    mask, over that chunk's K/V), merged by LSE (`attn_core.ops.merge_state`, into the first pass's
    tensors). Any backend supplies the passes with its own kernels; a query with no key in a chunk has
    LSE -inf there, which the merge ignores. Returns (output `[T, H, Dv]`, natural-log LSE `[T, H]`).

    Example: chunks = plan_prefix_chunks([5, 0, 9], 10).chunks (3 chunks) -> attend_new() once, then
    attend_chunk(chunks[0]), attend_chunk(chunks[1]), attend_chunk(chunks[2]), each merged in turn."""
    o, lse = attend_new()
    for chunk in chunks:
        o_c, lse_c = attend_chunk(chunk)
        merge_state(o, lse, o_c, lse_c, out=o, out_lse=lse)
    return o, lse


__all__ = [
    "Partial",
    "PrefixChunk",
    "PrefixChunkPlan",
    "attend_with_prefix_chunks",
    "chunk_slots",
    "plan_prefix_chunks",
]
