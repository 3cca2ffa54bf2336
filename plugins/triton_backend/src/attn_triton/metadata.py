"""The Triton backend's per-step index data and the functions that fill it.

Every index tensor is produced on the device by attn-core's `kv_indices_triton` (one launch per key
set); the host reads only the batch's `*_cpu` fields and `seq_lens_sum` to size allocations and grids.
The kernel never writes past a buffer sized from those host numbers, whatever the device lengths say,
and records what it refused in the backend's fault buffer (`attn_core.ops.device_faults`).
The same fill functions serve eager steps (scratch or fresh tensors) and CUDA-graph replays (views of
persistent buffers, see `graph.py`). The step's main key index and the decode split scratch live in an
`attn_core.memory.scratch.DeviceScratch` (`main_kv`, `split_views`); the step's other key sets (cross,
local, window, cascade) get fresh tensors (`new_kv`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attn_core.batching.local_attention import local_decode_starts, make_local_attention_virtual_batches
from attn_core.contract.batch import ForwardBatch
from attn_core.memory.scratch import DeviceScratch
from attn_core.memory.window_pool import SlidingWindowKVPool
from attn_core.ops.kv_indices_triton import kv_indices_triton
from attn_core.ops.step_checks import PendingStepCheck


@dataclass
class KVIndex:
    """CSR over each request's keys: indptr `[bs+1]` int32, indices int32 slots (its length is the
    capacity the index kernel respects)."""

    indptr: torch.Tensor
    indices: torch.Tensor


@dataclass
class CascadeKeys:
    """A cascade step (`attn_core.batching.cascade`): the shared prefix's keys as one request (`prefix`, its
    queries: every row of the step, qo_indptr `[0, T]`) and each request's keys after the prefix
    (`suffix`, CSR over the batch's requests)."""

    prefix: KVIndex
    qo_indptr: torch.Tensor
    suffix: KVIndex


@dataclass
class LocalExtend:
    """An extend-like step split into the virtual requests of chunked local attention
    (`attn_core.batching.local_attention`): their q rows (qo_indptr `[V+1]` int32, `max_q_len` host int) and keys."""

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
    step_check: Optional[PendingStepCheck] = None,
) -> None:
    """Write `kv` (and the optional q / mask offsets) for the batch in one kernel launch; out-of-range
    rows, lengths and ids past `capacity` entries of `kv.indices` (default: all of them) are refused and
    recorded in `fault`. `step_check` (`AttentionBackend.take_step_check`): run in the same launch."""
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
        step_check=step_check,
    )


def new_kv(bs: int, total: int, device: torch.device) -> KVIndex:
    """Fresh (uninitialized) index tensors for `bs` requests and `total` keys: one allocation, sliced
    (the step's host time is mostly fixed per-call costs)."""
    buf = torch.empty(bs + 1 + max(total, 1), dtype=torch.int32, device=device)
    return KVIndex(indptr=buf[: bs + 1], indices=buf[bs + 1 :])


def main_kv(scratch: DeviceScratch, bs: int, total: int) -> KVIndex:
    """The step's main key index (`[bs+1]` indptr and the rest of the buffer as indices) carved from the
    reused int32 buffer "kv" of `scratch`: the same views step after step for one batch size until the
    buffer grows. indices is the whole rest of the buffer, so a step of `total` keys fills it with
    `fill_kv(..., capacity=total)`, which keeps the index kernel inside the first `total` entries
    whatever the device lengths say.

    Example: with a 1024-entry buffer, `main_kv(s, 2, 10)` gives indptr `[3]` and indices `[1021]`;
    `main_kv(s, 2, 12)` the same views again."""
    return scratch.carve(
        "kv", bs + 1 + max(total, 1), bs, lambda buf: KVIndex(indptr=buf[: bs + 1], indices=buf[bs + 1 :])
    )


def split_views(
    scratch: DeviceScratch, bs: int, max_splits: int, num_q_heads: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode splits' float32 scratch for `bs` requests with up to `max_splits` splits each:
    part_o `[bs, Hq, max_splits, Dv]` and part_lse `[bs, Hq, max_splits]`, contiguous views of the
    buffers "split_o" / "split_lse" of `scratch` (shared by every layer and step: they run in stream
    order on one backend), made once per (bs, max_splits) until the buffers grow."""
    hq, dv, ms = num_q_heads, v_head_dim, max_splits
    key = (bs, ms)
    part_o = scratch.carve(
        "split_o",
        bs * hq * ms * dv,
        key,
        lambda b: torch.as_strided(b, (bs, hq, ms, dv), (hq * ms * dv, ms * dv, dv, 1)),
        torch.float32,
    )
    part_lse = scratch.carve(
        "split_lse", bs * hq * ms, key, lambda b: torch.as_strided(b, (bs, hq, ms), (hq * ms, ms, 1)), torch.float32
    )
    return part_o, part_lse


# ---- the step's other key sets (fresh tensors) ------------------------------------------------------
def cross_kv(b: ForwardBatch, r2t: torch.Tensor, fault: torch.Tensor) -> KVIndex:
    """Each request's encoder tokens (the first encoder_lens entries of its row)."""
    kv = new_kv(b.batch_size, int(b.encoder_lens_cpu.sum()), r2t.device)
    fill_kv(kv, r2t, b.req_pool_indices, b.encoder_lens, fault)
    return kv


def cascade_keys(b: ForwardBatch, r2t: torch.Tensor, fault: torch.Tensor) -> CascadeKeys:
    """A cascade step's key indices: the shared prefix once (the first request's row) for all the
    step's queries, and each request's keys after it."""
    p, bs, dev = b.cascade_prefix_len, b.batch_size, r2t.device
    prefix = new_kv(1, p, dev)
    fill_kv(prefix, r2t, b.req_pool_indices[:1], torch.full((1,), p, dtype=torch.int32, device=dev), fault)
    suffix = new_kv(bs, b.seq_lens_sum - bs * p, dev)
    start = torch.full((bs,), p, dtype=torch.int32, device=dev)
    fill_kv(suffix, r2t, b.req_pool_indices, (b.seq_lens - p).to(torch.int32), fault, kv_start=start)
    qo_indptr = torch.tensor([0, b.num_tokens], dtype=torch.int32).to(dev, non_blocking=True)
    return CascadeKeys(prefix, qo_indptr, suffix)


def window_kv(b: ForwardBatch, r2t: torch.Tensor, pool: SlidingWindowKVPool, fault: torch.Tensor) -> KVIndex:
    """Keys of window-pool layers: request r's keys from position max(0, first query - window + 1)
    (older ones may be released) to its last, as window slots. The kernels' causal and window masks
    depend only on positions relative to the request's last key, so the shorter key list is exact."""
    w = pool.window
    if b.forward_mode.is_decode():
        q_dev, q_cpu = 1, 1
    else:
        q_dev, q_cpu = b.extend_seq_lens, b.extend_seq_lens_cpu
    starts = (b.seq_lens - q_dev - w + 1).clamp_min(0)
    total = int((b.seq_lens_cpu - (b.seq_lens_cpu - q_cpu - w + 1).clamp_min(0)).sum())
    kv = new_kv(b.batch_size, total, r2t.device)
    col = starts if b.encoder_lens is None else starts + b.encoder_lens
    fill_kv(kv, r2t, b.req_pool_indices, (b.seq_lens - starts).to(torch.int32), fault, kv_start=col.to(torch.int32))
    kv.indices[:total] = pool.window_slots(kv.indices[:total])
    return kv


def local_decode_kv(chunk: int, b: ForwardBatch, r2t: torch.Tensor, fault: torch.Tensor) -> KVIndex:
    """Keys of chunked local layers (chunk size `chunk`) in DECODE: request r's keys from the start of
    the chunk holding its position seq_len-1 (one request each, no virtual batch)."""
    starts = local_decode_starts(chunk, b.seq_lens)
    total = int((b.seq_lens_cpu - local_decode_starts(chunk, b.seq_lens_cpu)).sum())
    kv = new_kv(b.batch_size, total, r2t.device)
    col = starts if b.encoder_lens is None else starts + b.encoder_lens
    fill_kv(kv, r2t, b.req_pool_indices, (b.seq_lens - starts).to(torch.int32), fault, kv_start=col.to(torch.int32))
    return kv


def local_extend(chunk: int, b: ForwardBatch, r2t: torch.Tensor, fault: torch.Tensor) -> LocalExtend:
    """The step as the virtual requests of chunked local attention (chunk size `chunk`): host lists from
    the batch's `*_cpu` data, one host→device copy, one index launch."""
    vb = make_local_attention_virtual_batches(chunk, b)
    n, device = vb.num_virtual, r2t.device
    host = torch.tensor([vb.req_indices, vb.kv_starts, vb.kv_lens, vb.q_lens], dtype=torch.int32).reshape(4, n)
    dev = host.to(device, non_blocking=True)
    req = dev[0].long()
    col = dev[1] if b.encoder_lens is None else dev[1] + b.encoder_lens[req]
    kv = new_kv(n, vb.num_keys, device)
    qo_indptr = torch.empty(n + 1, dtype=torch.int32, device=device)
    fill_kv(
        kv,
        r2t,
        b.req_pool_indices[req],
        dev[2],
        fault,
        kv_start=col.to(torch.int32),
        q_lens=dev[3],
        qo_indptr=qo_indptr,
    )
    return LocalExtend(qo_indptr, vb.max_q_len, kv)
