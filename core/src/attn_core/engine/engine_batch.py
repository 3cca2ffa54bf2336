"""Engine-shaped steps: a `ForwardBatch` from what a paged engine (vLLM and the like) holds each step.

A paged engine keeps, per step, the cumulative query lengths `query_start_loc` `[bs + 1]`, each
request's key count `seq_lens` `[bs]` (cached + new), its block table `[bs, max_blocks]` (the engine's
page ids; slot = block · page_size + offset) and the slot of every new token (`slot_mapping`), plus host
copies of the two length tensors. `EngineBatches.build` turns those into the `ForwardBatch` every attn
backend takes, without a host sync and without copying the engine's tensors:

- the request→slot table is the block table expanded in place into a persistent `[max_requests,
  max_context_len]` table (`req_to_token_pool`, give it to the `BackendContext`): row r, column i =
  block_table[r, i // P] · P + i % P, written by one device op over the columns the longest request
  needs; `req_pool_indices` is a slice of a persistent `arange` (row r is request r of the step);
- `out_cache_loc` is `slot_mapping[:T]`, `extend_start_loc` is `query_start_loc[:-1]` (views), the
  extend lengths and prefix lengths are computed on the device, their host copies from the host copies;
- the mode is derived from the host copies (`attn_core.step_mode`: DECODE, MIXED or EXTEND).

Everything the backend's metadata reads stays at fixed addresses (the table, the arange), so the same
builder serves CUDA-graph replays. The engine keeps writing new K/V itself if it wants to (then calls
`forward(..., save_kv_cache=False)`), or lets attn do it: `backend.save_kv(k, v, layer, batch)` (the
pool's checked `set_kv_buffer` at `out_cache_loc`), or `forward(..., save_kv_cache=True)`.

Worked example (page_size 4): two requests, the first decoding its 6th token, the second prefilling 3
tokens: query_start_loc [0, 1, 4], seq_lens [6, 3], block_table [[7, 2], [5, 0]], slot_mapping
[9, 20, 21, 22] -> MIXED; table rows [28, 29, 30, 31, 8, 9, 10, 11] and [20, 21, 22, 23, 0, 1, 2, 3];
extend_seq_lens [1, 3], extend_prefix_lens [5, 0], out_cache_loc [9, 20, 21, 22].
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from attn_core.contract.backend import AttentionBackend
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.validation import host_length_stats
from attn_core.engine.step_builder import step_mode
from attn_core.memory.kv_pool import KVPool
from attn_core.memory.pools import ReqToTokenPool

_INDEX_DTYPES = (torch.int32, torch.int64)


def _tensor(name: str, x, shape: tuple, device: Optional[torch.device], dtypes: tuple) -> torch.Tensor:
    """`x` when it is a tensor of `shape` (-1: any size), one of `dtypes`, on `device` (None: the CPU),
    else `InvalidArgumentError` naming `name`."""
    want_dev = torch.device("cpu") if device is None else device
    if not isinstance(x, torch.Tensor):
        raise InvalidArgumentError(name, f"a tensor of shape {shape}", type(x).__name__)
    if x.dtype not in dtypes:
        raise InvalidArgumentError(f"{name}.dtype", f"one of {[str(d) for d in dtypes]}", x.dtype)
    if x.dim() != len(shape) or any(w != -1 and n != w for n, w in zip(x.shape, shape)):
        raise InvalidArgumentError(f"{name}.shape", str(shape).replace("-1", "any"), tuple(x.shape))
    if x.device != want_dev:
        raise InvalidArgumentError(f"{name}.device", str(want_dev), x.device)
    return x


def expand_block_table(block_table: torch.Tensor, page_size: int, out: torch.Tensor, num_blocks: int) -> None:
    """Write the slots of the first `num_blocks` blocks of every row of `block_table` `[bs, >= num_blocks]`
    into `out[:bs, :num_blocks * page_size]` (int32): column i of row r = block_table[r, i // P] · P + i % P.
    One device op, no sync. Example: P 2, block_table [[3, 1]], num_blocks 2 -> out[0, :4] = [6, 7, 2, 3]."""
    bs = block_table.shape[0]
    if bs == 0 or num_blocks == 0:
        return
    offsets = torch.arange(page_size, dtype=out.dtype, device=out.device)
    view = out[:bs, : num_blocks * page_size].view(bs, num_blocks, page_size)
    torch.add(block_table[:, :num_blocks, None].to(out.dtype) * page_size, offsets, out=view)


class EngineBatches:
    """Builds `ForwardBatch`es from a paged engine's per-step tensors (see the module docstring) over one
    KV pool (typically an `attn_core.memory.EngineKVPool` over the engine's cache).

    `req_to_token_pool` is the request→slot table the batches use (`[max_requests, max_context_len]`
    rounded up to whole pages, int32): pass it to the `BackendContext` so CUDA-graph metadata reads it.
    """

    def __init__(
        self, kv_pool: KVPool, *, max_requests: int, max_context_len: int, device: Union[str, torch.device, None] = None
    ):
        if max_requests < 1:
            raise InvalidArgumentError("max_requests", ">= 1", max_requests)
        if max_context_len < 1:
            raise InvalidArgumentError("max_context_len", ">= 1", max_context_len)
        self.kv_pool = kv_pool
        self.page_size = kv_pool.page_size
        dev = torch.device(device) if device is not None else kv_pool.device
        if dev.type == "cuda" and dev.index is None:  # tensors report their index: compare like with like
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        width = -(-max_context_len // self.page_size) * self.page_size
        self.req_to_token_pool = ReqToTokenPool(max_requests, width, self.device)
        self.max_requests = max_requests
        self._rows = torch.arange(max_requests, dtype=torch.int64, device=self.device)

    def build(
        self,
        *,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_start_loc_cpu: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        mode: Union[ForwardMode, str, None] = None,
        attn_backend: Optional[AttentionBackend] = None,
        check_indices: Optional[bool] = None,
    ) -> ForwardBatch:
        """The step's `ForwardBatch`. Tensors: `query_start_loc` int32 `[bs + 1]` and `seq_lens` int32 `[bs]`
        on the device with their CPU copies, `block_table` int32/int64 `[bs, max_blocks]` and
        `slot_mapping` int32/int64 `[>= T]` on the device (T = query_start_loc_cpu[-1]; later entries,
        e.g. an engine's padding, are ignored). `mode` None derives DECODE / MIXED / EXTEND.

        Raises `InvalidArgumentError` naming the argument for a wrong dtype, shape or device, host lengths
        that disagree (query lengths < 0 or > seq_lens, query_start_loc_cpu[0] != 0), more requests than
        `max_requests`, keys beyond the block table or the table width; with `check_indices` (default: on
        CPU tensors, where reading them costs no sync) also a block id outside the pool's pages among the
        blocks holding attended keys, or a slot outside [1, num_slots) among the first T slots.
        """
        dev = self.device
        qsl_cpu = _tensor("query_start_loc_cpu", query_start_loc_cpu, (-1,), None, _INDEX_DTYPES)
        bs = qsl_cpu.shape[0] - 1
        if bs < 0:
            raise InvalidArgumentError("query_start_loc_cpu.shape", "(bs + 1,) with bs >= 0", tuple(qsl_cpu.shape))
        if bs > self.max_requests:
            raise InvalidArgumentError("query_start_loc", f"at most max_requests={self.max_requests} requests", bs)
        seq_cpu = _tensor("seq_lens_cpu", seq_lens_cpu, (bs,), None, _INDEX_DTYPES)
        _tensor("query_start_loc", query_start_loc, (bs + 1,), dev, (torch.int32,))
        _tensor("seq_lens", seq_lens, (bs,), dev, (torch.int32,))
        _tensor("block_table", block_table, (bs, -1), dev, _INDEX_DTYPES)
        _tensor("slot_mapping", slot_mapping, (-1,), dev, _INDEX_DTYPES)
        q_cpu = (qsl_cpu[1:] - qsl_cpu[:-1]).to(torch.int32)
        seq32 = seq_cpu.to(torch.int32)
        prefix_cpu = seq32 - q_cpu
        T = int(qsl_cpu[-1]) if bs else 0
        if bs and int(qsl_cpu[0]) != 0:
            raise InvalidArgumentError("query_start_loc_cpu", "offsets starting at 0", int(qsl_cpu[0]))
        longest = 0
        if bs:
            q_min = host_length_stats(q_cpu)[0]
            p_min = host_length_stats(prefix_cpu)[0]
            if q_min < 0 or p_min < 0:
                raise InvalidArgumentError(
                    "query_start_loc_cpu/seq_lens_cpu",
                    "0 <= query length <= seq_len per request",
                    (q_cpu.tolist(), seq_cpu.tolist()),
                )
            longest = host_length_stats(seq32)[1]
        if slot_mapping.shape[0] < T:
            raise InvalidArgumentError(
                "slot_mapping.shape", f"at least {T} slots (one per new token)", tuple(slot_mapping.shape)
            )
        P = self.page_size
        blocks = -(-longest // P)
        if blocks > block_table.shape[1]:
            raise InvalidArgumentError(
                "block_table.shape",
                f"at least {blocks} blocks per request (keys up to {longest})",
                tuple(block_table.shape),
            )
        table = self.req_to_token_pool.req_to_token
        if blocks * P > table.shape[1]:
            raise InvalidArgumentError("seq_lens_cpu", f"keys within max_context_len={table.shape[1]}", longest)
        if check_indices if check_indices is not None else dev.type == "cpu":
            self._check_indices(block_table, slot_mapping[:T], seq32, blocks)
        expand_block_table(block_table, P, table, blocks)
        mode = step_mode(prefix_cpu.tolist(), q_cpu.tolist()) if mode is None else ForwardMode.parse(mode)
        batch = ForwardBatch(
            forward_mode=mode,
            batch_size=bs,
            req_pool_indices=self._rows[:bs],
            seq_lens=seq_lens,
            seq_lens_cpu=seq32,
            seq_lens_sum=int(seq32.sum()),
            out_cache_loc=slot_mapping[:T],
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.kv_pool,
            attn_backend=attn_backend,
        )
        if mode.is_decode():
            if T != bs:
                raise InvalidArgumentError("mode", f"a mode with {T} tokens for {bs} requests", mode.name)
            return batch
        q_dev = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int32)
        batch.extend_seq_lens, batch.extend_seq_lens_cpu = q_dev, q_cpu
        batch.extend_prefix_lens, batch.extend_prefix_lens_cpu = seq_lens - q_dev, prefix_cpu
        batch.extend_start_loc = query_start_loc[:-1]
        batch.extend_num_tokens = T
        return batch

    def _check_indices(self, block_table: torch.Tensor, slots: torch.Tensor, seq: torch.Tensor, blocks: int) -> None:
        """Block ids holding attended keys within the pool's pages, new tokens' slots in [1, num_slots)
        (one read of the device tensors)."""
        pages = self.kv_pool.num_slots // self.page_size
        if blocks:
            used = (
                torch.arange(blocks, device=block_table.device)[None, :] * self.page_size
                < seq.to(block_table.device)[:, None]
            )
            ids = block_table[:, :blocks][used]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= pages):
                found = (int(ids.min()), int(ids.max()))
                raise InvalidArgumentError(
                    "block_table", f"block ids in [0, {pages}) (the KV pool's pages) for every attended key", found
                )
        if slots.numel():
            lo, hi = int(slots.min()), int(slots.max())
            if lo < 1 or hi >= self.kv_pool.num_slots:
                raise InvalidArgumentError(
                    "slot_mapping",
                    f"slots in [1, {self.kv_pool.num_slots}) for the {slots.numel()} new tokens",
                    (lo, hi),
                )
