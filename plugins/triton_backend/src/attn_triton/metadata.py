"""Per-step metadata of the Triton backend and the functions that fill it.

Every index tensor is produced on the device by attn-core's `kv_indices_triton` (one launch per key
set); the host reads only the batch's `*_cpu` fields and `seq_lens_sum` to size allocations and grids.
The kernel never writes past a buffer sized from those host numbers, whatever the device lengths say,
and records what it refused in the backend's fault buffer (`attn_core.ops.device_faults`).
The same fill functions serve eager steps (fresh tensors) and CUDA-graph replays (views of persistent
buffers, see `graph.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attn_core.ops.kv_indices_triton import kv_indices_triton


@dataclass
class KVIndex:
    """CSR over each request's keys: indptr `[bs+1]` int32, indices int32 slots (its length is the
    capacity the index kernel respects)."""

    indptr: torch.Tensor
    indices: torch.Tensor


@dataclass
class DecodeMetadata:
    """DECODE step: keys of self attention (and of cross attention), the split parameters and the split
    scratch shared by layers.

    part_o `[bs, Hq, max_splits, Dv]` and part_lse `[bs, Hq, max_splits]` float32 hold stage-1 results."""

    kv: KVIndex
    cross: Optional[KVIndex]
    splits: Splits
    part_o: torch.Tensor
    part_lse: torch.Tensor
    #: keys of chunked local layers (each request's keys from the start of its query's chunk), when the
    #: context has an attention_chunk_size
    local_kv: Optional[KVIndex] = None
    #: keys of window layers kept in a SlidingWindowKVPool (window slots, from each request's oldest
    #: key still inside the pool's window), when the step's pool is one
    window_kv: Optional[KVIndex] = None
    #: cascade steps (ForwardBatch.cascade_prefix_len > 0)
    cascade: Optional[CascadeKeys] = None


@dataclass
class ExtendMetadata:
    """Extend-like step: q rows per request (qo_indptr `[bs+1]` int32, `max_q_len` host int), keys, and
    for TARGET_VERIFY the custom mask (uint8 view of the bool mask) with its int64 offsets."""

    qo_indptr: torch.Tensor
    max_q_len: int
    kv: KVIndex
    cross: Optional[KVIndex]
    custom_mask: Optional[torch.Tensor] = None
    mask_indptr: Optional[torch.Tensor] = None
    #: the step as virtual requests for chunked local layers, when the context has an attention_chunk_size
    local: Optional[LocalExtend] = None
    #: keys of window layers kept in a SlidingWindowKVPool (see DecodeMetadata.window_kv)
    window_kv: Optional[KVIndex] = None
    #: cascade steps (ForwardBatch.cascade_prefix_len > 0)
    cascade: Optional[CascadeKeys] = None


@dataclass
class CascadeKeys:
    """A cascade step (`attn_core.cascade`): the shared prefix's keys as one request (`prefix`, its
    queries: every row of the step, qo_indptr `[0, T]`) and each request's keys after the prefix
    (`suffix`, CSR over the batch's requests)."""

    prefix: KVIndex
    qo_indptr: torch.Tensor
    suffix: KVIndex


@dataclass
class LocalExtend:
    """An extend-like step split into the virtual requests of chunked local attention
    (`attn_core.local_attention`): their q rows (qo_indptr `[V+1]` int32, `max_q_len` host int) and keys."""

    qo_indptr: torch.Tensor
    max_q_len: int
    kv: KVIndex


@dataclass(frozen=True)
class Splits:
    """Decode split parameters handed to the decode kernel: request r takes
    clamp(ceil(kv_len_r / min_split_len), 1, max_splits) splits (computed on the device)."""

    max_splits: int
    min_split_len: int


def fill_kv(
    kv: KVIndex,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    fault: torch.Tensor,
    *,
    kv_start: Optional[torch.Tensor] = None,
    q_lens: Optional[torch.Tensor] = None,
    qo_indptr: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
    capacity: Optional[int] = None,
) -> None:
    """Write `kv` (and the optional q / mask offsets) for the batch in one kernel launch; out-of-range
    rows, lengths and ids past `capacity` entries of `kv.indices` (default: all of them) are refused and
    recorded in `fault`."""
    kv_indices_triton(
        req_to_token,
        req_pool_indices,
        kv_lens,
        kv.indices,
        kv_indptr=kv.indptr,
        kv_start=kv_start,
        q_lens=q_lens,
        qo_indptr=qo_indptr,
        mask_indptr=mask_indptr,
        fault=fault,
        capacity=capacity,
    )


def new_kv(bs: int, total: int, device: torch.device) -> KVIndex:
    """Fresh (uninitialized) index tensors for `bs` requests and `total` keys: one allocation, sliced
    (the step's host time is mostly fixed per-call costs)."""
    buf = torch.empty(bs + 1 + max(total, 1), dtype=torch.int32, device=device)
    return KVIndex(indptr=buf[: bs + 1], indices=buf[bs + 1 :])


class IndexScratch:
    """The int32 buffer of a step's main CSR key index (`DecodeMetadata.kv` / `ExtendMetadata.kv`), kept
    across steps and grown on demand (by a quarter more than asked, so growing contexts reallocate
    rarely): a step reuses the previous step's buffer instead of allocating and freeing one, on the same
    premise as `SplitScratch` (one step's metadata is current at a time per backend; its kernels and the
    next step's index kernel run in stream order). The step's other key sets (cross, local, window,
    cascade), which live alongside it, get fresh tensors (`new_kv`).

    The views of a batch size are made once and handed out again until the buffer grows (a view costs
    microseconds of host time per step): indices is the whole rest of the buffer, so a step of `total`
    keys must fill it with `fill_kv(..., capacity=total)`, which keeps the index kernel inside the first
    `total` entries whatever the device lengths say.

    Example: `s.kv(2, 10)` gives indptr `[3]` and indices `[13]`, views of one buffer of 16 entries;
    `s.kv(2, 12)` later returns the same views, `s.kv(4, 40)` grows the buffer to 56 entries."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer: Optional[torch.Tensor] = None
        self.capacity = 0
        self._views: dict[int, KVIndex] = {}

    def kv(self, bs: int, total: int) -> KVIndex:
        """Views for `bs` requests and at least `total` keys (see the class doc for the capacity)."""
        need = bs + 1 + max(total, 1)
        if need > self.capacity:
            self.capacity = need + need // 4
            self.buffer = torch.empty(self.capacity, dtype=torch.int32, device=self.device)
            self._views.clear()  # metadata holding the old views keeps the old buffer alive
        view = self._views.get(bs)
        if view is None:
            buf = self.buffer
            view = self._views[bs] = KVIndex(indptr=buf[: bs + 1], indices=buf[bs + 1 :])
        return view


class SplitScratch:
    """Float32 scratch of the decode splits, `[bs, Hq, max_splits, Dv]` outputs and `[bs, Hq, max_splits]`
    LSEs, kept across steps (layers and steps run in stream order on one backend) and grown on demand.
    The views of each (bs, max_splits) are made once and handed out again until the buffers grow (a
    view costs microseconds of host time per step; the buffers are shared by every step anyway)."""

    def __init__(self, num_q_heads: int, v_head_dim: int, device: torch.device):
        self.hq, self.dv, self.device = num_q_heads, v_head_dim, device
        self.capacity = 0  # (request, split) pairs
        self.o = self.lse = None
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def reserve(self, pairs: int) -> None:
        if pairs > self.capacity:
            self.o = torch.empty(pairs * self.hq * self.dv, dtype=torch.float32, device=self.device)
            self.lse = torch.empty(pairs * self.hq, dtype=torch.float32, device=self.device)
            self.capacity = pairs
            self._views.clear()  # views of the old buffers stay valid for metadata that holds them

    def views(self, bs: int, max_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(part_o, part_lse) views for a batch of `bs` requests with up to `max_splits` splits each."""
        views = self._views.get((bs, max_splits))
        if views is not None:
            return views
        if bs * max_splits > self.capacity:
            self.reserve(max(bs * max_splits, 2 * self.capacity))
        hq, dv, ms = self.hq, self.dv, max_splits
        part_o = torch.as_strided(self.o, (bs, hq, ms, dv), (hq * ms * dv, ms * dv, dv, 1))
        part_lse = torch.as_strided(self.lse, (bs, hq, ms), (hq * ms, ms, 1))
        views = self._views[(bs, max_splits)] = (part_o, part_lse)
        return views
