"""KV-slot allocators.

Slots are token positions in a per-layer KV pool; slot = page * page_size + offset. Page 0 (slots
0 .. page_size-1) is reserved as the padding dummy and is never handed out. Bookkeeping is on the host;
the slot tensors returned live on the allocator's device.

Exhaustion returns None and leaves the allocator unchanged. Double free, freeing the reserved page
and out-of-range slots raise `KVCacheError` before anything changes.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from attn_core.errors import InvalidArgumentError, KVCacheError

IntSeq = Union[Sequence[int], torch.Tensor]

def _as_list(x: IntSeq) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else [int(v) for v in x]


class PagedTokenAllocator:
    """Hands out KV slots page by page; each request's tokens fill its own pages in order.

    `size` is the number of usable slots (a multiple of page_size); the pool behind it needs
    `size + page_size` slots (page 0 reserved).
    """

    def __init__(self, size: int, page_size: int = 1, device: Union[str, torch.device] = "cpu"):
        if page_size < 1 or (page_size & (page_size - 1)):
            raise InvalidArgumentError("page_size", "a power of two >= 1", page_size)
        if size < page_size or size % page_size:
            raise InvalidArgumentError("size", f"a positive multiple of page_size={page_size}", size)
        self.size = size
        self.page_size = page_size
        self.device = torch.device(device)
        self.num_pages = size // page_size
        self.clear()

    def clear(self) -> None:
        """Free everything."""
        # Pages 1..num_pages; pop from the end hands out low page ids first.
        self._free_pages = list(range(self.num_pages, 0, -1))
        self._is_free = [False] + [True] * self.num_pages

    def available_size(self) -> int:
        """Free slots (whole free pages times page_size)."""
        return len(self._free_pages) * self.page_size

    def _take_pages(self, n: int) -> Optional[list[int]]:
        if n > len(self._free_pages):
            return None
        pages = [self._free_pages.pop() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def _slots_of_pages(self, pages: list[int]) -> torch.Tensor:
        base = torch.tensor(pages, dtype=torch.int64) * self.page_size
        return (base[:, None] + torch.arange(self.page_size, dtype=torch.int64)).reshape(-1)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """`need_size` slots in whole pages (need_size must be a multiple of page_size)."""
        if need_size < 0 or need_size % self.page_size:
            raise InvalidArgumentError("need_size", f"a non-negative multiple of page_size={self.page_size}", need_size)
        pages = self._take_pages(need_size // self.page_size)
        if pages is None:
            return None
        return self._slots_of_pages(pages).to(self.device)

    def alloc_extend(self, prefix_lens: IntSeq, seq_lens: IntSeq, last_loc: IntSeq) -> Optional[torch.Tensor]:
        """Slots for tokens prefix_len .. seq_len-1 of each request, concatenated in request order.

        A request first fills the rest of the page holding its last token (`last_loc`, the slot of
        token prefix_len-1; ignored when prefix_len is 0), then takes fresh pages.
        """
        prefix, seq, last = _as_list(prefix_lens), _as_list(seq_lens), _as_list(last_loc)
        if not (len(prefix) == len(seq) == len(last)):
            raise InvalidArgumentError("prefix_lens/seq_lens/last_loc", "equal lengths", (len(prefix), len(seq), len(last)))
        ps = self.page_size
        new_pages_needed = 0
        for p, s, loc in zip(prefix, seq, last):
            if p < 0 or s < p:
                raise InvalidArgumentError("seq_lens", f"seq_len >= prefix_len >= 0 (prefix {p})", s)
            if p % ps and not (ps <= loc < (self.num_pages + 1) * ps and loc % ps == (p - 1) % ps and not self._is_free[loc // ps]):
                raise InvalidArgumentError("last_loc", f"the allocated slot of token {p - 1} (offset {(p - 1) % ps} in its page)", loc)
            new_pages_needed += -(-s // ps) - -(-p // ps)
        pages = self._take_pages(new_pages_needed)
        if pages is None:
            return None
        out: list[torch.Tensor] = []
        cursor = 0
        for p, s, loc in zip(prefix, seq, last):
            if s == p:
                continue
            head = 0
            if p % ps:  # finish the partly filled page
                head = min(ps - p % ps, s - p)
                out.append(torch.arange(loc + 1, loc + 1 + head, dtype=torch.int64))
            n_pages = -(-s // ps) - -(-p // ps)
            if n_pages:
                fresh = self._slots_of_pages(pages[cursor : cursor + n_pages])[: s - p - head]
                out.append(fresh)
                cursor += n_pages
        if not out:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(out).to(self.device)

    def alloc_decode(self, seq_lens: IntSeq, last_loc: IntSeq) -> Optional[torch.Tensor]:
        """One slot per request for its token at position seq_len-1 (seq_lens include the new token)."""
        seq = _as_list(seq_lens)
        return self.alloc_extend([s - 1 for s in seq], seq, last_loc)

    def free(self, free_index: torch.Tensor) -> None:
        """Free the pages holding these slots. Every page must be allocated now."""
        slots = _as_list(free_index.reshape(-1).cpu()) if isinstance(free_index, torch.Tensor) else _as_list(free_index)
        if not slots:
            return
        limit = (self.num_pages + 1) * self.page_size
        bad = [s for s in slots if s < 0 or s >= limit]
        if bad:
            raise KVCacheError(f"free: slots out of range [0, {limit}): {bad[:8]}")
        pages = sorted({s // self.page_size for s in slots})
        if pages[0] == 0:
            raise KVCacheError("free: slot(s) in reserved page 0 (the padding dummy) cannot be freed")
        double = [p for p in pages if self._is_free[p]]
        if double:
            raise KVCacheError(f"free: page(s) {double[:8]} are already free (double free)")
        for p in pages:
            self._is_free[p] = True
        self._free_pages.extend(reversed(pages))

    def is_allocated(self, slot: int) -> bool:
        return not self._is_free[slot // self.page_size]


class TokenAllocator(PagedTokenAllocator):
    """Token-granular allocator: a paged allocator with page_size 1."""

    def __init__(self, size: int, device: Union[str, torch.device] = "cpu"):
        super().__init__(size, page_size=1, device=device)
