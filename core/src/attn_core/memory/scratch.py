"""Growable device scratch: named buffers a backend reuses step after step for its per-step metadata.

A backend's per-step metadata (key indices, page ids, query offsets, split-KV partial results) lives in
device buffers that would otherwise be allocated and freed every step. `DeviceScratch` keeps one buffer
per name, grown on demand to twice what was asked (at least `min_entries`), so once a workload's sizes
have settled a step allocates nothing on the device. It rests on two premises every backend here
keeps: one step's metadata is current at a time per backend, and the next step's writes are ordered on
the stream after the last step's reads.

Views of a buffer (its slices for a batch size) cost microseconds of host time each, so `carve` makes
them once per (name, key) and hands them out again until the buffer grows; a view handed out before a
growth keeps the old buffer alive and unchanged (metadata that holds it stays valid).

Worked example:
    s = DeviceScratch(torch.device("cuda"))
    ids = s.get("seq", 10)              # 1024 int32 entries (the floor); `s.get("seq", 7)` is that one again
    ids = s.get("seq", 5000)            # a new buffer of 10000 entries (twice the ask)
    kv = s.carve("kv", 3 + 40, 2, lambda buf: (buf[:3], buf[3:]))
    # the same tuple again for `s.carve("kv", n, 2, ...)` while n <= the buffer's 1024 entries
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, TypeVar

import torch

V = TypeVar("V")


class DeviceScratch:
    """Device buffers by name on `device`, each reused across steps and grown on demand (see the module
    docstring). `min_entries`: the smallest buffer made (default 1024)."""

    def __init__(self, device: torch.device, *, min_entries: int = 1024):
        self.device = device
        self.min_entries = min_entries
        self._bufs: dict[str, torch.Tensor] = {}
        self._views: dict[tuple[str, Hashable], tuple[torch.Tensor, Any]] = {}  # each key its own view type

    def get(self, name: str, n: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """The buffer `name`: at least `n` entries of `dtype` (a 1-D tensor; the same object while it
        holds n entries of that dtype, else a new one of max(min_entries, 2n) entries)."""
        buf = self._bufs.get(name)
        if buf is None or buf.shape[0] < n or buf.dtype != dtype:
            buf = self._bufs[name] = torch.empty(max(self.min_entries, 2 * n), dtype=dtype, device=self.device)
        return buf

    def carve(
        self, name: str, n: int, key: Hashable, make: Callable[[torch.Tensor], V], dtype: torch.dtype = torch.int32
    ) -> V:
        """`make(buffer)` for buffer `name` of at least `n` entries, made once per `key` (e.g. a batch
        size) and handed out again while the buffer stays the same object.

        Example: `s.carve("kv", bs + 1 + total, bs, lambda b: (b[: bs + 1], b[bs + 1 :]))` gives the
        same two views step after step for one batch size."""
        buf = self.get(name, n, dtype)
        hit = self._views.get((name, key))
        if hit is None or hit[0] is not buf:
            hit = self._views[(name, key)] = (buf, make(buf))
        return hit[1]
