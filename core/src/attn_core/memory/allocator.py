"""KV-slot allocators.

Slots are token positions in a per-layer KV pool; slot = page * page_size + offset. Page 0 (slots
0 .. page_size-1) is reserved as the padding dummy and is never handed out. Bookkeeping is on the host;
the slot tensors returned live on the allocator's device.

Ownership is per slot. A page is filled front to back: its *tail* is the last slot handed out and not
freed. Freeing some slots of a page keeps the others owned; the page goes back to the free list when its
last owned slot is freed (freed slots below the tail stay unused until then; freeing the tail slots
moves the tail back, so rejected draft tokens can be freed and the request continues its page).

Prefix forks (prefix caching, parallel sampling): several requests may share a cached prefix that ends
mid-page, at slot `last_loc`. Only one of them can continue that page in place: `alloc_extend` hands
slots after `last_loc` only while `last_loc` is its page's tail, and raises `PageTailError` (naming
`last_loc`) once another request has extended past it. A later fork calls `fork_partial_page`, which
gives it a fresh page whose first slots are copies-to-be of the prefix's partial page (copy-on-write:
the caller copies their K/V and points its `req_to_token` row at them), then extends from there. A
fresh page rather than in-place sharing keeps token i at page offset i % page_size, which every
page-table backend relies on.

Exhaustion returns None and leaves the allocator unchanged. Double free, freeing the reserved page and
out-of-range slots raise `KVSlotError` (a `KVCacheError` naming the argument) before anything changes.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from attn_core.contract.errors import InvalidArgumentError, KVCacheError

IntSeq = Union[Sequence[int], torch.Tensor]


class KVSlotError(InvalidArgumentError, KVCacheError):
    """A slot argument names a slot the caller may not use that way: out of range, in the reserved page,
    not owned (double free), or at the wrong page offset for its token."""


class PageTailError(KVSlotError):
    """`last_loc` is not the tail of its page: another request already extended the page past it (two
    forks of a prefix that ends mid-page). Use `PagedTokenAllocator.fork_partial_page` for this fork."""


def _as_list(x: IntSeq) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else [int(v) for v in x]


class PagedTokenAllocator:
    """Hands out KV slots page by page; each request's tokens fill its own pages in order (token i at
    page offset i % page_size).

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
        self._owned = torch.zeros((self.num_pages + 1) * self.page_size, dtype=torch.bool)
        self._live = [0] * (self.num_pages + 1)  # owned slots per page (0: the page is free)
        self._tail = [0] * (self.num_pages + 1)  # 1 + offset of the page's last owned slot
        self._live[0] = self._tail[0] = self.page_size  # the reserved page: never free, never extended

    def available_size(self) -> int:
        """Free slots (whole free pages times page_size)."""
        return len(self._free_pages) * self.page_size

    def _take_pages(self, n: int) -> Optional[list[int]]:
        if n > len(self._free_pages):
            return None
        return [self._free_pages.pop() for _ in range(n)]

    def _hand_out(self, slots: torch.Tensor) -> None:
        """Mark `slots` (int64, host; within pages, ascending from each page's tail) owned."""
        self._owned[slots] = True
        pages, counts = torch.unique_consecutive(slots // self.page_size, return_counts=True)
        for page, n in zip(pages.tolist(), counts.tolist()):
            self._live[page] += n
        last = torch.ones_like(slots, dtype=torch.bool)
        last[:-1] = slots[1:] // self.page_size != slots[:-1] // self.page_size
        for slot in slots[last].tolist():
            page = slot // self.page_size
            self._tail[page] = max(self._tail[page], slot % self.page_size + 1)

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
        slots = self._slots_of_pages(pages)
        if slots.numel():
            self._hand_out(slots)
        return slots.to(self.device)

    def _check_last_loc(self, i: int, p: int, loc: int, extends: bool, tails: dict[int, int]) -> None:
        """Request i continues the page of its token p-1 at slot `loc`: owned, at offset (p-1) % P, and
        (when it adds tokens) the page's tail, counting the requests before it in this call (`tails`)."""
        ps = self.page_size
        if not (ps <= loc < self._owned.numel() and loc % ps == (p - 1) % ps and bool(self._owned[loc])):
            raise KVSlotError(
                f"last_loc[{i}]", f"the allocated slot of token {p - 1} (offset {(p - 1) % ps} in its page)", loc
            )
        page = loc // ps
        tail = tails.get(page, self._tail[page])
        if extends and tail != loc % ps + 1:
            raise PageTailError(
                f"last_loc[{i}]",
                f"the last slot handed out in its page (slot {page * ps + tail - 1}); "
                "another request extended past it: fork the page with fork_partial_page",
                loc,
            )

    def alloc_extend(self, prefix_lens: IntSeq, seq_lens: IntSeq, last_loc: IntSeq) -> Optional[torch.Tensor]:
        """Slots for tokens prefix_len .. seq_len-1 of each request, concatenated in request order.

        A request first fills the rest of the page holding its last token (`last_loc`, the slot of
        token prefix_len-1; ignored when prefix_len is a multiple of page_size), then takes fresh pages.
        `last_loc` must be the tail of its page (see the module docstring): `PageTailError` otherwise,
        also when two requests of this call continue the same page. All or nothing: None when pages
        run out, and no change on any error.
        """
        prefix, seq, last = _as_list(prefix_lens), _as_list(seq_lens), _as_list(last_loc)
        if not (len(prefix) == len(seq) == len(last)):
            raise InvalidArgumentError(
                "prefix_lens/seq_lens/last_loc", "equal lengths", (len(prefix), len(seq), len(last))
            )
        ps = self.page_size
        new_pages_needed = 0
        tails: dict[int, int] = {}  # pages continued by earlier requests of this call -> their new tail
        for i, (p, s, loc) in enumerate(zip(prefix, seq, last)):
            if p < 0 or s < p:
                raise InvalidArgumentError(f"seq_lens[{i}]", f"seq_len >= prefix_len >= 0 (prefix {p})", s)
            if p % ps:
                self._check_last_loc(i, p, loc, s > p, tails)
                if s > p:
                    tails[loc // ps] = min(ps, loc % ps + 1 + s - p)
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
        slots = torch.cat(out)
        self._hand_out(slots)
        return slots.to(self.device)

    def alloc_decode(self, seq_lens: IntSeq, last_loc: IntSeq) -> Optional[torch.Tensor]:
        """One slot per request for its token at position seq_len-1 (seq_lens include the new token)."""
        seq = _as_list(seq_lens)
        return self.alloc_extend([s - 1 for s in seq], seq, last_loc)

    def fork_partial_page(self, prefix_len: int, last_loc: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Copy-on-write for a fork of a prefix of `prefix_len` tokens that ends mid-page at `last_loc`
        (the slot of token prefix_len-1), when the fork may not continue that page in place (another
        request extended past it: `PageTailError` from `alloc_extend`). Takes a fresh page and hands out
        its first r = prefix_len % page_size slots to the fork. Returns `(src, dst)`, int64 `[r]` each on
        the allocator's device: the prefix's slots of tokens prefix_len-r .. prefix_len-1 and the new
        slots at the same page offsets. The caller copies K/V from src to dst (every layer), writes dst
        into its `req_to_token` row at those positions, and continues with
        `alloc_extend([prefix_len], [seq_len], [dst[-1]])`. The prefix's slots stay owned by their
        owner. None (no change) when no page is free.

        Example (page_size 4): the prefix's tokens 0..5 sit in slots [8, 9, 10, 11, 20, 21] and another
        fork continued page 5 with slot 22; `fork_partial_page(6, 21)` takes page 7 and returns
        `(tensor([20, 21]), tensor([28, 29]))`; after the copy the fork's row reads
        [8, 9, 10, 11, 28, 29] and `alloc_extend([6], [8], [29])` gives it [30, 31].
        """
        ps = self.page_size
        r = prefix_len % ps
        if prefix_len < 1 or r == 0:
            raise InvalidArgumentError(
                "prefix_len", f"a prefix ending mid-page (not a multiple of page_size={ps})", prefix_len
            )
        if not (ps <= last_loc < self._owned.numel() and last_loc % ps == r - 1 and bool(self._owned[last_loc])):
            raise KVSlotError(
                "last_loc", f"the allocated slot of token {prefix_len - 1} (offset {r - 1} in its page)", last_loc
            )
        src = torch.arange(last_loc - r + 1, last_loc + 1, dtype=torch.int64)
        if not bool(self._owned[src].all()):
            raise KVSlotError("last_loc", f"a page whose {r} prefix slots up to it are all allocated", last_loc)
        pages = self._take_pages(1)
        if pages is None:
            return None
        dst = pages[0] * ps + torch.arange(r, dtype=torch.int64)
        self._hand_out(dst)
        return src.to(self.device), dst.to(self.device)

    def free(self, free_index: IntSeq) -> None:
        """Free these slots (each owned, none twice). A page returns to the free list when its last
        owned slot is freed; freeing a page's tail slots moves its tail back (see the module docstring)."""
        slots = _as_list(free_index.reshape(-1).cpu()) if isinstance(free_index, torch.Tensor) else _as_list(free_index)
        if not slots:
            return
        ps = self.page_size
        limit = self._owned.numel()
        bad = [s for s in slots if s < 0 or s >= limit]
        if bad:
            raise KVSlotError("free_index", f"slots in [0, {limit}) (out of range)", bad[:8])
        t = torch.tensor(slots, dtype=torch.int64)
        if bool((t < ps).any()):
            reserved = [s for s in slots if s < ps][:8]
            raise KVSlotError(
                "free_index", "no slot of the reserved page 0 (the padding dummy, never handed out)", reserved
            )
        t = t.sort().values
        dup = t[1:][t[1:] == t[:-1]]
        if dup.numel():
            raise KVSlotError("free_index", "each slot once (double free)", dup[:8].tolist())
        unowned = t[~self._owned[t]]
        if unowned.numel():
            raise KVSlotError("free_index", "allocated slots (double free)", unowned[:8].tolist())
        self._owned[t] = False
        pages, counts = torch.unique_consecutive(t // ps, return_counts=True)
        emptied = []
        for page, n in zip(pages.tolist(), counts.tolist()):
            self._live[page] -= n
            if self._live[page] == 0:
                self._tail[page] = 0
                emptied.append(page)
            else:
                owned = self._owned[page * ps : (page + 1) * ps].nonzero()
                self._tail[page] = int(owned[-1]) + 1
        self._free_pages.extend(reversed(emptied))

    def is_allocated(self, slot: int) -> bool:
        """Whether `slot` is handed out and not freed."""
        return 0 <= slot < self._owned.numel() and bool(self._owned[slot])

    def is_page_tail(self, slot: int) -> bool:
        """Whether `slot` is the last slot handed out in its page, i.e. `alloc_extend` may continue the
        page after it (False for the reserved page and for unallocated slots)."""
        return (
            self.is_allocated(slot)
            and slot >= self.page_size
            and self._tail[slot // self.page_size] == slot % self.page_size + 1
        )


class TokenAllocator(PagedTokenAllocator):
    """Token-granular allocator: a paged allocator with page_size 1."""

    def __init__(self, size: int, device: Union[str, torch.device] = "cpu"):
        super().__init__(size, page_size=1, device=device)
