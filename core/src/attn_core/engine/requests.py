"""Request handles for engines: `RequestPool` gives each running request a row of the request→slot
table and the KV slots of its tokens, across every step, until the request is freed.

Conventions:
- `Request.kv_len` counts the request's tokens that have KV slots: the tokens cached by earlier steps
  plus, once a step is built (`attn_core.build_step`), that step's new tokens. A token the engine has
  just sampled has no KV yet; it is one of the next step's new tokens.
- Slots are handed out by the allocator page-aware: a request's token i sits at page offset
  i % page_size, its new tokens first filling the page holding its last token.
- Prefix sharing: `fork(parent, n)` gives a new request whose first tokens share the parent's cached
  pages (nothing is copied). Only whole pages are shared, so a fork's next token always starts a fresh
  page and never writes into a page another request reads; with page_size P the child gets
  `n // P * P` cached tokens and the engine runs the rest of its prompt as new tokens.
- Rollback (speculative decoding): `truncate(req, kv_len)` drops tokens from the end; their slots stay
  with the request as spares that its next tokens reuse (they are exactly the slots those positions
  would get), and go back to the allocator when the request is freed.

Pages shared by several requests are reference-counted here; a page goes back to the allocator (through
its public `free`, with the slots the last holder owns in it) when its last holder is freed.

Stale batches: every change of a request's tokens (a step built for it, `truncate`, `fork` of it,
`free`) moves its row's *generation* on. A batch built by `build_step` remembers the generation of each
of its requests (`RequestGuard`), and the backend's `init_forward_metadata` refuses it with
`StaleRequestError` once any of them moved on: a freed request's K/V would land in slots the allocator
already handed back, a truncated one's at positions it no longer owns. Token counts are integers:
`truncate(req, 2.5)` or 2.5 new tokens raise `InvalidArgumentError` (never silently 2).

Worked example (page_size 4): request A runs an 6-token prompt: slots [4, 5, 6, 7, 8, 9] (pages 1, 2).
`fork(A, 6)` gives B with kv_len 4 sharing page 1 (slots 4..7); B's next 2 prompt tokens get page 3
(slots 12, 13). Freeing A frees page 2; page 1 is freed with B.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np
import torch

from attn_core.contract.errors import InvalidArgumentError, KVCacheError, StaleRequestError
from attn_core.memory.allocator import PagedTokenAllocator
from attn_core.memory.kv_pool import KVPool
from attn_core.memory.pools import ReqToTokenPool
from attn_core.memory.window_pool import SlidingWindowAllocator


def token_count(name: str, value: Any, minimum: int = 0) -> int:
    """`value` as a Python int >= `minimum`, or `InvalidArgumentError` naming `name`: a count of tokens is
    an integer (int, numpy or 0-d integer tensor), never a float or a bool. Example: token_count("n", 3)
    is 3; token_count("n", 2.5) raises ("n: expected an integer >= 0, found 2.5")."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        if not value.dtype.is_floating_point and value.dtype != torch.bool:
            value = int(value)
    if isinstance(value, (bool, np.bool_)):
        n = None
    else:
        try:
            n = operator.index(value)
        except TypeError:
            n = None
    if n is None or n < minimum:
        raise InvalidArgumentError(name, f"an integer >= {minimum}", value)
    return n


@dataclass(eq=False)
class Request:
    """A running request: its row of the request→slot table and the slots of its tokens.

    `slots[i]` is the slot of token i (host ints); `slots[kv_len:]` are spares kept after a
    `truncate`. Read-only for the engine: change it through its `RequestPool`.
    """

    rid: int
    row: int
    kv_len: int = 0
    slots: list[int] = field(default_factory=list)


class RequestPool:
    """The running requests over one request→slot table and one KV-slot allocator.

    `req_to_token_pool` is a `ReqToTokenPool` (on the device the backends run on); `allocator` a
    `PagedTokenAllocator` / `TokenAllocator`, best on the CPU (its bookkeeping is on the host: one on
    the GPU costs a device sync per step); `token_to_kv_pool` is put on every batch built.
    """

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: Union[PagedTokenAllocator, SlidingWindowAllocator],
        token_to_kv_pool: Optional[KVPool] = None,
    ) -> None:
        kv_ps = getattr(token_to_kv_pool, "page_size", allocator.page_size)
        if kv_ps != allocator.page_size:
            raise InvalidArgumentError("token_to_kv_pool", f"page_size {allocator.page_size} as the allocator's", kv_ps)
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.token_to_kv_pool = token_to_kv_pool
        self.page_size = allocator.page_size
        self._live: dict[int, Request] = {}  # row -> request
        self._page_refs: dict[int, int] = {}  # page -> number of requests holding it
        self._ids = itertools.count()
        #: generation of each row (host int64 `[rows]`): moves on whenever the row's request changes
        self.generations = np.zeros(req_to_token_pool.size, dtype=np.int64)

    def _touch(self, req: Request) -> None:
        """The request's tokens changed: batches built before now are stale."""
        self.generations[req.row] += 1

    # ---- lifecycle --------------------------------------------------------------------------------
    def add(self) -> Request:
        """A new request with no tokens (takes a row; raises `KVCacheError` when none is free)."""
        rows = self.req_to_token_pool.alloc(1)
        if rows is None:
            raise KVCacheError(f"out of request rows ({self.req_to_token_pool.size} in use)")
        req = Request(rid=next(self._ids), row=rows[0])
        self._live[req.row] = req
        return req

    def fork(self, parent: Request, num_tokens: int) -> Request:
        """A new request whose first tokens are the parent's first `num_tokens` cached tokens, sharing
        their whole pages (copies nothing). Its `kv_len` is num_tokens rounded down to a page multiple;
        the engine runs the prompt from there on as new tokens."""
        self.check_live(parent, "parent")
        num_tokens = token_count("num_tokens", num_tokens)
        if not 0 <= num_tokens <= parent.kv_len:
            raise InvalidArgumentError("num_tokens", f"0..{parent.kv_len} (the parent's kv_len)", num_tokens)
        shared = num_tokens // self.page_size * self.page_size
        child = self.add()
        self._touch(parent)
        if shared:
            slots = parent.slots[:shared]
            self.req_to_token_pool.write(child.row, 0, torch.tensor(slots, dtype=torch.int64))
            for page in {s // self.page_size for s in slots}:
                self._page_refs[page] += 1
            child.slots = list(slots)
            child.kv_len = shared
        return child

    def truncate(self, req: Request, kv_len: int) -> None:
        """Drop the request's tokens kv_len.. (e.g. rejected draft tokens); their slots become spares
        its next tokens reuse. Raises when a dropped token sits in a page another request shares."""
        self.check_live(req)
        kv_len = token_count("kv_len", kv_len)
        if not 0 <= kv_len <= req.kv_len:
            raise InvalidArgumentError("kv_len", f"0..{req.kv_len} (the request's kv_len)", kv_len)
        shared = [s for s in req.slots[kv_len : req.kv_len] if self._page_refs[s // self.page_size] > 1]
        if shared:
            raise InvalidArgumentError("kv_len", "a length that keeps every token of pages shared with a fork", kv_len)
        req.kv_len = kv_len
        self._touch(req)

    def free(self, req: Request) -> None:
        """Return the request's row and every page no other request holds."""
        self.check_live(req)
        ps = self.page_size
        released: list[int] = []
        for page in sorted({s // ps for s in req.slots}):
            self._page_refs[page] -= 1
            if self._page_refs[page] == 0:
                del self._page_refs[page]
                released.append(page)
        if released:
            gone = set(released)
            self.allocator.free(torch.tensor([s for s in req.slots if s // ps in gone], dtype=torch.int64))
        self.req_to_token_pool.free(req.row)
        del self._live[req.row]
        self._touch(req)
        req.slots, req.kv_len = [], 0

    # ---- slots for a step -------------------------------------------------------------------------
    def extend(self, reqs: list[Request], counts: list[int]) -> torch.Tensor:
        """Give each request `counts[i]` new tokens: slots (spares first, then from the allocator, all or
        nothing: `KVCacheError` leaves everything unchanged), written into its row at columns
        kv_len.., and kv_len advanced. Returns the new slots int64 `[sum(counts)]` on the host, in
        request order (a step's `out_cache_loc`)."""
        max_len = self.req_to_token_pool.max_context_len
        counts = [token_count(f"counts[{i}]", n) for i, n in enumerate(counts)]
        prefix, seq, last, spare_used = [], [], [], []
        for i, (r, n) in enumerate(zip(reqs, counts)):
            if r.kv_len + n > max_len:
                raise InvalidArgumentError(
                    f"counts[{i}]", f"0..{max_len - r.kv_len} (max_context_len {max_len} - kv_len)", n
                )
            take = min(n, len(r.slots) - r.kv_len)
            spare_used.append(take)
            p = r.kv_len + take
            prefix.append(p)
            seq.append(r.kv_len + n)
            last.append(r.slots[p - 1] if p else 0)
        fresh = self.allocator.alloc_extend(prefix, seq, last)
        if fresh is None:
            need = sum(counts) - sum(spare_used)
            free = self.allocator.available_size()
            raise KVCacheError(f"out of KV slots: need {need} tokens (page_size {self.page_size}), {free} slots free")
        fresh_slots: list[int] = fresh.cpu().tolist()
        out: list[int] = []
        rows: list[int] = []
        cols: list[int] = []
        cursor = 0
        for r, n, take in zip(reqs, counts, spare_used):
            new = r.slots[r.kv_len : r.kv_len + take] + fresh_slots[cursor : cursor + n - take]
            cursor += n - take
            for s in new[take:]:
                page = s // self.page_size
                if page not in self._page_refs:
                    self._page_refs[page] = 1
            if take < n:  # every spare used: the fresh slots follow them
                r.slots.extend(new[take:])
            rows += [r.row] * n
            cols += range(r.kv_len, r.kv_len + n)
            r.kv_len += n
            self._touch(r)
            out += new
        slots = torch.tensor(out, dtype=torch.int64)
        if out:
            table = self.req_to_token_pool.req_to_token
            idx = torch.tensor([rows, cols], dtype=torch.int64).to(table.device)
            table[idx[0], idx[1]] = slots.to(table.device, table.dtype)
        return slots

    # ---- inspection -------------------------------------------------------------------------------
    def check_live(self, req: Request, name: str = "req") -> None:
        """Raise `InvalidArgumentError` unless `req` is a running request of this pool."""
        if not isinstance(req, Request) or self._live.get(req.row) is not req:
            raise InvalidArgumentError(name, "a running request of this RequestPool (not freed)", req)

    @property
    def num_requests(self) -> int:
        """Running requests."""
        return len(self._live)

    def guard(self, reqs: list[Request]) -> RequestGuard:
        """A `RequestGuard` of these (live) requests as they are now: a batch built from them carries it."""
        rows = np.fromiter((r.row for r in reqs), dtype=np.int64, count=len(reqs))
        return RequestGuard(self, rows, self.generations[rows].copy())


@dataclass(frozen=True, eq=False)
class RequestGuard:
    """The requests a batch was built from, as row generations (`RequestPool.generations`) at build time.
    `check()` raises `StaleRequestError` naming the first request (its index in the batch) whose row has
    moved on since: freed, truncated, forked or given another step. One numpy comparison of `[bs]`
    arrays per step (a few microseconds at any batch size); no device work."""

    pool: RequestPool
    rows: np.ndarray
    generations: np.ndarray

    def check(self) -> None:
        now = self.pool.generations[self.rows]
        if not np.array_equal(now, self.generations):
            i = int(np.flatnonzero(now != self.generations)[0])
            expected = "a batch whose requests are as it was built (not freed, truncated, forked or stepped since)"
            found = f"request in row {int(self.rows[i])} changed since"
            raise StaleRequestError(f"forward_batch.requests[{i}]", expected, found)
