"""`StepPlan`: the per-step index tables every kernel of attn-sparse reads, built once per step (eagerly from
a `ForwardBatch`, or in persistent buffers for CUDA graphs by `GraphPlans`) and shared by every layer.

- keys: request r's key j (position j, j < kv_len[r]) is in KV slot `kv_indices[kv_indptr[r] + j]`, built by
  attn-core's `build_kv_indices` (on a GPU its Triton kernel bounds-checks rows, lengths and slots on the
  device and records refusals in the backend's `DeviceFaultFlags`);
- queries: request r's new tokens are q rows q_start[r] .. q_start[r] + q_len[r] - 1, at positions
  seq_len[r] - q_len[r] .. seq_len[r] - 1;
- tiles: tile i covers new tokens tile_tok[i] .. tile_tok[i] + block_t - 1 of request tile_req[i]
  (`attn_sparse.config.TileGeometry`); DECODE has one tile per request.

Worked example (EXTEND, block_t 8): requests with 20 and 5 new tokens after 3 and 0 cached ones give
q_start [0, 20], q_len [20, 5], seq_len [23, 5], tile_req [0, 0, 0, 1], tile_tok [0, 8, 16, 0].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attn_core.contract.batch import ForwardBatch
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.ops.kv_indices import build_kv_indices
from attn_sparse.config import SplitPolicy, TileGeometry, tile_geometry


@dataclass
class StepPlan:
    """The tables of the module docstring (int32 device tensors), the tile shape, the split count and a
    host bound on every request's seq_len (`max_seq_len`; the context's max_context_len for a graph)."""

    num_tokens: int
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    q_start: torch.Tensor
    q_len: torch.Tensor
    seq_len: torch.Tensor
    tile_req: torch.Tensor
    tile_tok: torch.Tensor
    geometry: TileGeometry
    splits: int
    max_seq_len: int

    @property
    def batch_size(self) -> int:
        return self.q_len.shape[0]

    @property
    def num_tiles(self) -> int:
        return self.tile_req.shape[0]


@dataclass(frozen=True)
class PlanShape:
    """What a plan depends on besides the batch: KV heads, q heads per KV head, the pool's slot count, the
    split policy, whether the kernels run on a GPU, and the device fault buffer (None: not recorded)."""

    num_kv_heads: int
    group: int
    num_slots: int
    policy: SplitPolicy
    on_gpu: bool
    fault: Optional[torch.Tensor] = None


def host_tiles(extend_lens: list[int], block_t: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_req, tile_tok) int32 on `device` for requests of `extend_lens` new tokens (the host copies),
    tiles of `block_t` tokens: built on the host and copied once, so device lengths that disagree with
    their host copies (the step check's fault, raised one step late) cannot change the table's size, and
    the kernels bound every row by the step's tokens.

    >>> [t.tolist() for t in host_tiles([20, 5, 0], 8, "cpu")]
    [[0, 0, 0, 1], [0, 8, 16, 0]]
    """
    reqs, toks = [], []
    for r, n in enumerate(extend_lens):
        for t in range(0, int(n), block_t):
            reqs.append(r)
            toks.append(t)
    table = torch.tensor([reqs, toks], dtype=torch.int32).to(device, non_blocking=True)
    return table[0], table[1]


def plan_step(batch: ForwardBatch, req_to_token: torch.Tensor, shape: PlanShape) -> StepPlan:
    """The plan of an eager step (any mode with tokens), from the batch's device tensors and host copies;
    no device sync."""
    bs, dev = batch.batch_size, batch.seq_lens.device
    decode = batch.forward_mode.is_decode()
    kv_indptr = torch.empty(bs + 1, dtype=torch.int32, device=dev)
    kv_indices = build_kv_indices(
        req_to_token,
        batch.req_pool_indices,
        batch.seq_lens,
        batch.seq_lens_sum,
        indptr_out=kv_indptr,
        num_slots=shape.num_slots,
        fault=shape.fault,
    )
    geo = tile_geometry(shape.group, decode, shape.on_gpu)
    if decode:
        q_start = torch.arange(bs, dtype=torch.int32, device=dev)
        q_len = torch.ones(bs, dtype=torch.int32, device=dev)
        tile_req, tile_tok = q_start, torch.zeros(bs, dtype=torch.int32, device=dev)
    else:
        q_start, q_len = batch.extend_start_loc, batch.extend_seq_lens
        tile_req, tile_tok = host_tiles(batch.extend_seq_lens_cpu.tolist(), geo.block_t, dev)
    max_seq = batch.max_seq_len
    programs = tile_req.shape[0] * shape.num_kv_heads * geo.slices
    return StepPlan(
        num_tokens=batch.num_tokens,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        q_start=q_start,
        q_len=q_len,
        seq_len=batch.seq_lens,
        tile_req=tile_req,
        tile_tok=tile_tok,
        geometry=geo,
        splits=shape.policy.splits(max_seq, programs),
        max_seq_len=max_seq,
    )


class GraphPlans:
    """DECODE plans for CUDA graphs: persistent buffers for `max_bs` requests of up to `max_context_len`
    keys, one plan (views of those buffers: no tensor moves between capture and replay) per captured batch
    size, refreshed in place at every replay."""

    def __init__(self, max_bs: int, max_context_len: int, shape: PlanShape, device: torch.device):
        self.shape = shape
        self.max_context_len = max_context_len
        self.capacity = max_bs * max_context_len
        self.kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.kv_indices = torch.zeros(self.capacity, dtype=torch.int32, device=device)
        self.q_start = torch.arange(max_bs, dtype=torch.int32, device=device)
        self.q_len = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.seq_len = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.tile_tok = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.plans: dict[int, StepPlan] = {}

    @property
    def max_bs(self) -> int:
        return self.q_start.shape[0]

    def capture(self, step: CudaGraphStep, req_to_token: torch.Tensor) -> StepPlan:
        """The plan of graph size `step.bs` (made once per size), filled for `step`."""
        bs = step.bs
        plan = self.plans.get(bs)
        if plan is None:
            geo = tile_geometry(self.shape.group, True, self.shape.on_gpu)
            programs = bs * self.shape.num_kv_heads * geo.slices
            plan = StepPlan(
                num_tokens=bs,
                kv_indptr=self.kv_indptr[: bs + 1],
                kv_indices=self.kv_indices,
                q_start=self.q_start[:bs],
                q_len=self.q_len[:bs],
                seq_len=self.seq_len[:bs],
                tile_req=self.q_start[:bs],
                tile_tok=self.tile_tok[:bs],
                geometry=geo,
                splits=self.shape.policy.splits(self.max_context_len, programs),
                max_seq_len=self.max_context_len,
            )
            self.plans[bs] = plan
        self.refresh(plan, step, req_to_token)
        return plan

    def refresh(self, plan: StepPlan, step: CudaGraphStep, req_to_token: torch.Tensor) -> None:
        """Write `step`'s lengths and key slots into the plan's buffers (no reallocation). On a GPU the
        index kernel bounds the ids by the buffer's capacity; the torch path (CPU) needs the exact host
        total, taken from `step.seq_lens_cpu` (or one host copy of `seq_lens` at a CPU capture)."""
        plan.seq_len.copy_(step.seq_lens)
        total = self.capacity if req_to_token.is_cuda else min(int(step.host_seq_lens().sum()), self.capacity)
        build_kv_indices(
            req_to_token,
            step.req_pool_indices,
            step.seq_lens,
            total,
            out=self.kv_indices,
            indptr_out=plan.kv_indptr,
            num_slots=self.shape.num_slots,
            fault=self.shape.fault,
            whole_out=True,
        )
