"""Eager per-step device buffers shared by the FlashInfer backends (plain torch; runs on CPU too)."""

from __future__ import annotations

import torch


class DeviceScratch:
    """Int32 device buffers by name (a key list's page ids, its layout, query offsets, ...), one per name,
    reused step after step (the writes of a step are ordered on the stream after the reads of the last)
    and grown by doubling, so a step allocates nothing on the device once the sizes have settled.

    Example: `s = DeviceScratch(dev); a = s.get("seq", 10)` gives a buffer of 1024 entries (the floor);
    `s.get("seq", 5000)` then a new one of 10000; `s.get("seq", 7)` that same one again."""

    MIN_ENTRIES = 1024

    def __init__(self, device: torch.device):
        self.device = device
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, which: str, n: int) -> torch.Tensor:
        """The buffer `which`, at least `n` int32 entries long."""
        buf = self._bufs.get(which)
        if buf is None or buf.shape[0] < n:
            buf = self._bufs[which] = torch.empty(max(self.MIN_ENTRIES, 2 * n), dtype=torch.int32, device=self.device)
        return buf
