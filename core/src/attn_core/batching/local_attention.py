"""Chunked local attention (Llama-4 style local layers) as virtual batches.

In a layer with `attention_chunk_size` C, a query at decoder position p sees the keys at positions
(p // C) * C … p: causal attention inside its own chunk of C positions, nothing before it. A backend
whose kernel only knows "causal over a request's keys" serves it by splitting each request into
*virtual requests*, one per chunk its new tokens touch: the virtual request's keys are the chunk's keys
up to its last new token, and its queries the new tokens inside that chunk (they are the last keys of
the virtual request, so the plain causal rule of the kernel is the chunked rule of the layer).

Everything here reads host data only (Python ints, `*_cpu` tensors), so it never waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from attn_core.batching.batch_utils import query_lens
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.errors import InvalidArgumentError


@dataclass(frozen=True)
class LocalVirtualBatch:
    """Virtual requests of a step for chunked local attention (all tuples have one entry per virtual
    request, in order: the requests' order, then the chunks' order, so the virtual requests' query rows
    are the batch's query rows in the same order).

    - `req_indices`: the batch request each one comes from;
    - `q_lens`, `q_start_loc`: its new tokens and the q row of the first one (rows of the batch's q);
    - `kv_starts`, `kv_lens`: decoder position of its first key (the chunk start, a multiple of C) and
      its key count (chunk start … its last new token);
    - page form, for page-table kernels: `page_starts` (index of its first page in the request's page
      list: kv_start // page_size), `page_offsets` (kv_start % page_size: keys of the first page to skip;
      0 for every virtual request when C is a multiple of page_size) and `num_pages`
      (ceil((page_offset + kv_len) / page_size)).
    """

    attn_chunk_size: int
    page_size: int
    req_indices: tuple[int, ...]
    q_lens: tuple[int, ...]
    q_start_loc: tuple[int, ...]
    kv_starts: tuple[int, ...]
    kv_lens: tuple[int, ...]
    page_starts: tuple[int, ...]
    page_offsets: tuple[int, ...]
    num_pages: tuple[int, ...]

    @property
    def num_virtual(self) -> int:
        return len(self.req_indices)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def num_keys(self) -> int:
        """Total keys over the virtual requests (size of a CSR index over them)."""
        return sum(self.kv_lens)

    def page_table(self, page_table: torch.Tensor) -> torch.Tensor:
        """The virtual requests' page tables from the batch's `[batch_size, max_pages]` one (row r: the
        page ids of request r in order): `[num_virtual, max(num_pages)]`, row v holding pages
        `page_starts[v]` … `page_starts[v] + num_pages[v] - 1` of request `req_indices[v]`, 0 (the
        reserved dummy page) after them. Same device and dtype as `page_table`; one gather.

        Example (page_size 2, the first example of `make_local_attention_virtual_batches`): request 0's
        pages `[7, 3, 9]` and request 1's `[4, 5, 6, 8, 2]` give rows `[7, 3]`, `[9, 0]`, `[2, 0]`.
        """
        if page_table.dim() != 2:
            raise InvalidArgumentError("page_table", "a 2-D tensor [batch_size, max_pages]", tuple(page_table.shape))
        need = max((s + n for s, n in zip(self.page_starts, self.num_pages)), default=0)
        if need > page_table.shape[1] or (self.req_indices and max(self.req_indices) >= page_table.shape[0]):
            raise InvalidArgumentError(
                "page_table",
                f"at least {max(self.req_indices, default=-1) + 1} rows of {need} pages",
                tuple(page_table.shape),
            )
        width = max(self.num_pages, default=0)
        j = torch.arange(width)
        cols = torch.tensor(self.page_starts, dtype=torch.int64)[:, None] + j[None, :]
        valid = j[None, :] < torch.tensor(self.num_pages, dtype=torch.int64)[:, None]
        rows = torch.tensor(self.req_indices, dtype=torch.int64)[:, None].expand_as(cols)
        cols = torch.where(valid, cols, 0)
        dev = page_table.device
        out = page_table[rows.to(dev), cols.to(dev)]
        return torch.where(valid.to(dev), out, torch.zeros_like(out))


def _check_chunk(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(name, "an int >= 1", value)
    return value


def make_local_attention_virtual_batches(
    attn_chunk_size: int,
    batch: Union[ForwardBatch, Sequence[int]],
    seq_lens: Optional[Sequence[int]] = None,
    page_size: int = 1,
) -> LocalVirtualBatch:
    """Split every request of a step into one virtual request per chunk of `attn_chunk_size` (C)
    positions that its new tokens touch (see the module docstring).

    `batch`: a `ForwardBatch` (query lengths and `seq_lens_cpu` are read from it) or the query lengths,
    with `seq_lens` (keys per request, the new tokens included) then required. A request of query length
    n and seq_len s has new tokens at positions s-n … s-1; the chunk c it touches gives a virtual request
    with keys c*C … min(s, (c+1)*C) - 1 and the new tokens among them. Requests without new tokens give
    none. `page_size` P only shapes the page form (`page_starts`, `page_offsets`, `num_pages`).

    Worked example: C = 4, P = 2, query lengths `[3, 1]`, seq_lens `[6, 9]`.
        request 0, new tokens at positions 3, 4, 5: chunk 0 holds position 3 (keys 0..3), chunk 1
            positions 4, 5 (keys 4..5);
        request 1, new token at position 8: chunk 2 (keys 8..8).
        → req_indices (0, 0, 1), q_lens (1, 2, 1), q_start_loc (0, 1, 3), kv_starts (0, 4, 8),
          kv_lens (4, 2, 1), page_starts (0, 2, 4), page_offsets (0, 0, 0), num_pages (2, 1, 1).
    With C = 3 (not a multiple of P) the same batch gives: request 0's positions 3, 4, 5 all in chunk 1
    (keys 3..5), request 1's position 8 in chunk 2 (keys 6..8) → req_indices (0, 1), q_lens (3, 1),
    q_start_loc (0, 3), kv_starts (3, 6), kv_lens (3, 3), page_starts (1, 3), page_offsets (1, 0),
    num_pages (2, 2).
    """
    chunk = _check_chunk("attn_chunk_size", attn_chunk_size)
    ps = _check_chunk("page_size", page_size)
    q = query_lens(batch)
    if isinstance(batch, ForwardBatch):
        if seq_lens is not None:
            raise InvalidArgumentError(
                "seq_lens", "None when a ForwardBatch is given (its seq_lens_cpu are used)", "a sequence"
            )
        s = [int(n) for n in batch.seq_lens_cpu.tolist()]
    else:
        if seq_lens is None:
            raise InvalidArgumentError("seq_lens", "the keys per request when query lengths are given", None)
        s = [int(n) for n in seq_lens]
    if len(s) != len(q):
        raise InvalidArgumentError("seq_lens", f"{len(q)} lengths (one per request)", len(s))
    bad = [i for i, (n, k) in enumerate(zip(q, s)) if n > k]
    if bad:
        raise InvalidArgumentError(f"seq_lens[{bad[0]}]", f">= its query length {q[bad[0]]}", s[bad[0]])

    out: dict[str, list[int]] = {k: [] for k in ("req", "ql", "qs", "ks", "kl", "pst", "pof", "np")}
    row = 0
    for r, (n, k) in enumerate(zip(q, s)):
        first = k - n  # position of the first new token
        while first < k:
            start = first // chunk * chunk
            last = min(k, start + chunk)  # one past the last new token of this chunk
            out["req"].append(r)
            out["ql"].append(last - first)
            out["qs"].append(row)
            out["ks"].append(start)
            out["kl"].append(last - start)
            out["pst"].append(start // ps)
            out["pof"].append(start % ps)
            out["np"].append(-(-(start % ps + last - start) // ps))
            row += last - first
            first = last
    return LocalVirtualBatch(
        chunk,
        ps,
        tuple(out["req"]),
        tuple(out["ql"]),
        tuple(out["qs"]),
        tuple(out["ks"]),
        tuple(out["kl"]),
        tuple(out["pst"]),
        tuple(out["pof"]),
        tuple(out["np"]),
    )


def local_decode_starts(attn_chunk_size: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """Position of the first key each DECODE query sees in a chunked local layer: the start of the chunk
    holding its position seq_len - 1, i.e. `(seq_lens - 1) // C * C` (same device and dtype; no sync).
    A DECODE step needs no virtual batch: each request stays one request, its keys start there.

    Example: C = 4, seq_lens `[6, 9, 4]` → `[4, 8, 0]`.
    """
    chunk = _check_chunk("attn_chunk_size", attn_chunk_size)
    return torch.div(seq_lens - 1, chunk, rounding_mode="floor").clamp_min(0) * chunk
