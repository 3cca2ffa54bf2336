"""One DCP rank's requests and steps: each rank allocates and stores only its shard of every request.

Every rank of a DCP group holds its own `RequestPool` (its own request→slot rows, allocator and KV pool)
and runs the same scheduling: the same `add` / `free` / `build_dcp_step` calls in the same order with the
same work. A request's global token p is stored by rank `layout.rank_of(p)` at local position
`layout.local_position(p)` of that rank's row (`attn_core.dcp.layout`), so a rank's row of the request
is an ordinary row of its local tokens and its pages hold only its blocks.

`build_dcp_step` gives, per rank: the global positions of the step's new tokens (for RoPE), which of
them this rank stores and in which local slots (`DcpStep.save_kv`), and for DECODE steps a local
DECODE `ForwardBatch` over this rank's shard (`DcpStep.local_batch`) that any backend runs unchanged:
its "new token" is each request's last local token (already written), so it is run with
`save_kv_cache=False`. Requests with no local token yet are left out of it (`local_rows`).

Graph-shaped steps (`build_dcp_step(..., graph_shaped=True)`, DECODE only) have the shapes a CUDA graph
needs: fixed for a batch size, nothing host-dependent. Their local batch covers every request of the
step, in step order; a request with no local key is a padding row as `attn_core.graph_step.graph_padding`
defines it (request row 0, the padding seq_len, KV slot 0) and `local_mask` (bool `[bs]`, on the device)
is False there, so `dcp_decode_attention` gives it LSE -inf and output 0 with `torch.where`. `save_kv`
writes every new token: a token another rank stores goes to the reserved dummy slot 0. Such a step runs
through `attn_core.CudaGraphRunner`: `runner.run(step.local_batch, {..., **step.graph_inputs()})` with
`DCP_GRAPH_INPUTS` among the runner's inputs, and inside `run_layers(batch, inputs)` the step is
`DcpStep.from_graph_batch(batch, inputs)` (the runner's static buffers; the runner pads rows beyond the
real batch the same way, their mask input zeroed).

Not supported here: prefix forks, `truncate` (speculative rollback) and the speculative modes.
Slot exhaustion on one rank raises `KVCacheError` there (nothing changes on that rank) while another
rank may have succeeded; an engine treats it as fatal or preempts on every rank alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from attn_core.batch import ForwardBatch
from attn_core.dcp.layout import DcpLayout
from attn_core.errors import InvalidArgumentError
from attn_core.forward_mode import ForwardMode
from attn_core.graph_step import graph_padding
from attn_core.requests import Request, RequestPool
from attn_core.step_builder import step_mode

#: the runner input a graph-shaped step needs (add it to `CudaGraphRunner`'s `input_shapes`): per
#: request, whether this rank holds one of its keys (`DcpStep.local_mask`)
DCP_LOCAL_MASK = "dcp_local_mask"
DCP_GRAPH_INPUTS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {DCP_LOCAL_MASK: ((), torch.bool)}


class DcpRequestPool:
    """One rank's share of the running requests of a DCP group.

    `requests` is this rank's `RequestPool`; `layout` the group's `DcpLayout`; `rank` this rank in it.
    `Request` handles returned by `add` are this rank's (their `kv_len` counts local tokens);
    `kv_len(req)` is the request's global length.
    """

    def __init__(self, requests: RequestPool, layout: DcpLayout, rank: int):
        layout.check_rank(rank)
        self.requests = requests
        self.layout = layout
        self.rank = rank
        self._global_len: dict[int, int] = {}  # rid -> global kv_len

    def add(self) -> Request:
        """A new request with no tokens (its local handle)."""
        req = self.requests.add()
        self._global_len[req.rid] = 0
        return req

    def free(self, req: Request) -> None:
        """Free the request's local row and pages."""
        self.requests.free(req)
        del self._global_len[req.rid]

    def kv_len(self, req: Request) -> int:
        """The request's global number of tokens with KV (on all ranks together)."""
        self.requests.check_live(req)
        return self._global_len[req.rid]


@dataclass
class DcpStep:
    """One rank's part of a step (see the module docstring).

    forward_mode: the global mode (DECODE / MIXED / EXTEND); batch_size: requests in the step;
    positions: int64 `[T]` global positions of the new tokens; seq_lens_cpu: int32 `[bs]` global lengths
    (None in a step made by `from_graph_batch`); save_rows: int64 `[n]` indices into the step's T new
    tokens this rank stores, save_loc: int64 `[n]` their local slots (graph-shaped: save_rows None,
    save_loc `[T]` with slot 0 for the tokens other ranks store); local_batch: DECODE batch over this
    rank's shard (DECODE steps with a local key only; graph-shaped: every DECODE step, `bs` rows);
    local_rows: int64 `[bs_local]` the step's request indices it covers, in order (None when
    graph-shaped); local_mask: bool `[bs]` on the device, True where this rank holds a key of the request
    (graph-shaped steps only, else None).
    """

    forward_mode: ForwardMode
    batch_size: int
    positions: torch.Tensor
    seq_lens_cpu: Optional[torch.Tensor]
    save_rows: Optional[torch.Tensor]
    save_loc: torch.Tensor
    token_to_kv_pool: object
    local_batch: Optional[ForwardBatch] = None
    local_rows: Optional[torch.Tensor] = None
    local_mask: Optional[torch.Tensor] = None

    @property
    def graph_shaped(self) -> bool:
        """Whether the local batch covers every request with fixed shapes (`local_mask` set)."""
        return self.local_mask is not None

    def save_kv(self, layer, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this rank's share of the step's new K/V (`[T, Hkv, D]`, every new token) into its pool
        (graph-shaped: all T rows, those stored elsewhere into the dummy slot 0; no host sync)."""
        if k.shape[0] != self.positions.shape[0]:
            raise InvalidArgumentError("k", f"{self.positions.shape[0]} rows (the step's new tokens)", tuple(k.shape))
        if self.save_rows is None:
            self.token_to_kv_pool.set_kv_buffer(layer, self.save_loc, k, v)
        elif self.save_loc.numel():
            self.token_to_kv_pool.set_kv_buffer(layer, self.save_loc, k[self.save_rows], v[self.save_rows])

    def init_forward_metadata(self) -> None:
        """Once per step: the local batch's metadata on its backend (nothing when there is no local batch).
        A graph-shaped step is refused (`InvalidArgumentError`): its padding rows read the dummy slot, so it
        runs through a CUDA-graph runner, whose capture / replay metadata calls take such rows."""
        if self.graph_shaped:
            raise InvalidArgumentError("step", "a step built with graph_shaped=False (a graph-shaped step runs through "
                                       "CudaGraphRunner.run(step.local_batch, ...))", "a graph-shaped step")
        if self.local_batch is not None:
            self.local_batch.attn_backend.init_forward_metadata(self.local_batch)

    def graph_inputs(self) -> dict[str, torch.Tensor]:
        """The DCP inputs of a graph-shaped step for `CudaGraphRunner.run` (names of `DCP_GRAPH_INPUTS`)."""
        if not self.graph_shaped:
            raise InvalidArgumentError("step", "a graph-shaped DECODE step (build_dcp_step(..., graph_shaped=True))",
                                       self.forward_mode.name)
        return {DCP_LOCAL_MASK: self.local_mask}

    @classmethod
    def from_graph_batch(cls, batch: ForwardBatch, inputs: dict[str, torch.Tensor]) -> DcpStep:
        """The graph-shaped DECODE step a `CudaGraphRunner`'s `run_layers(batch, inputs)` runs: `batch` is
        the runner's static batch (the local batch of `graph_inputs`' step, padded to the captured size;
        its positions the global ones), `inputs[DCP_LOCAL_MASK]` the static mask. Views only (no copy)."""
        mask = inputs.get(DCP_LOCAL_MASK)
        if mask is None:
            raise InvalidArgumentError("inputs", f"a {DCP_LOCAL_MASK!r} tensor (add DCP_GRAPH_INPUTS to the runner's inputs)",
                                       sorted(inputs))
        if not batch.forward_mode.is_decode() or batch.positions is None:
            raise InvalidArgumentError("batch", "a DECODE graph batch with positions", batch.forward_mode.name)
        return cls(ForwardMode.DECODE, batch.batch_size, batch.positions, None, None, batch.out_cache_loc, batch.token_to_kv_pool,
                   local_batch=batch, local_mask=mask)


def build_dcp_step(pool: DcpRequestPool, work: Sequence[tuple[Request, int]], *, attn_backend=None,
                   graph_shaped: bool = False) -> DcpStep:
    """This rank's part of a step where request work[i][0] runs work[i][1] new tokens (global counts,
    the same on every rank). Allocates the local slots of the new tokens this rank stores, writes them
    into the requests' local rows and advances the lengths. `graph_shaped` (a DECODE step; needs
    `attn_backend` for its padding seq_len) gives the fixed shapes of a CUDA graph (module docstring).

    Worked example (world 2, interleave 4, rank 1): a new request runs 6 prompt tokens (EXTEND):
    positions [0..5], rank 1 stores tokens 4 and 5 (save_rows [4, 5], two local slots), no local batch.
    The next step (DECODE, 1 token at position 6): save_rows [0]; local_batch has the request with local
    seq_len 3 (tokens 4, 5, 6); on rank 0 save_rows is empty and the local seq_len is 4 (tokens 0..3).
    Graph-shaped, with a second request of 2 tokens decoding its third (position 2) in the same step:
    rank 1 has local_mask [True, False], local seq_lens [3, fill] (the second a padding row: request row
    0, slot 0), save_loc [its slot for position 6, 0]; rank 0 local_mask [True, True], seq_lens [4, 3],
    save_loc [0, its slot for position 2].
    """
    layout, rank = pool.layout, pool.rank
    reqs = [r for r, _ in work]
    counts = [int(n) for _, n in work]
    if not reqs:
        raise InvalidArgumentError("work", "at least one (request, new_tokens) pair", 0)
    for i, r in enumerate(reqs):
        pool.requests.check_live(r, f"work[{i}]")
    if len({id(r) for r in reqs}) != len(reqs):
        raise InvalidArgumentError("work", "each request at most once", [r.rid for r in reqs])
    if min(counts) < 1:
        raise InvalidArgumentError("work", "new_tokens >= 1 for every request", counts)
    prefix = torch.tensor([pool.kv_len(r) for r in reqs], dtype=torch.int64)
    count_t = torch.tensor(counts, dtype=torch.int64)
    seq = prefix + count_t
    mode = step_mode(prefix.tolist(), counts)
    if graph_shaped:
        if not mode.is_decode():
            raise InvalidArgumentError("graph_shaped", f"False for a {mode.name} step (graph-shaped steps are DECODE)", True)
        if attn_backend is None:
            raise InvalidArgumentError("attn_backend", "the local backend (its CUDA-graph fill value pads rows without a local key)", None)
    local_counts = layout.local_lens(seq, rank) - layout.local_lens(prefix, rank)
    local_slots = pool.requests.extend(reqs, local_counts.tolist())
    for r, s in zip(reqs, seq.tolist()):
        pool._global_len[r.rid] = s
    positions = torch.cat([torch.arange(p, s, dtype=torch.int64) for p, s in zip(prefix.tolist(), seq.tolist())])
    save_rows = (layout.rank_of(positions) == rank).nonzero().flatten()
    rows = pool.requests.req_to_token_pool
    device = rows.device
    if graph_shaped:
        return _graph_shaped_decode(pool, reqs, positions, seq, save_rows, local_slots, attn_backend)
    step = DcpStep(mode, len(reqs), positions.to(device), seq.to(torch.int32), save_rows.to(device), local_slots.to(device),
                   pool.requests.token_to_kv_pool)
    if mode.is_decode():
        local_lens = torch.tensor([r.kv_len for r in reqs], dtype=torch.int32)
        keep = (local_lens > 0).nonzero().flatten()
        if keep.numel():
            kept = [reqs[i] for i in keep.tolist()]
            lens = local_lens[keep]
            step.local_rows = keep.to(device)
            step.local_batch = ForwardBatch(
                forward_mode=ForwardMode.DECODE,
                batch_size=len(kept),
                req_pool_indices=torch.tensor([r.row for r in kept], dtype=torch.int64).to(device),
                seq_lens=lens.to(device),
                seq_lens_cpu=lens,
                seq_lens_sum=int(lens.sum()),
                out_cache_loc=torch.tensor([r.slots[r.kv_len - 1] for r in kept], dtype=torch.int64).to(device),
                req_to_token_pool=rows,
                token_to_kv_pool=pool.requests.token_to_kv_pool,
                attn_backend=attn_backend,
            )
    return step


def _graph_shaped_decode(pool: DcpRequestPool, reqs: list[Request], positions: torch.Tensor, seq: torch.Tensor,
                         save_rows: torch.Tensor, local_slots: torch.Tensor, attn_backend) -> DcpStep:
    """The graph-shaped DECODE step of `build_dcp_step` (its lengths already advanced): every request a
    row of the local batch, those without a local key padded as `graph_padding` says."""
    rows, kv = pool.requests.req_to_token_pool, pool.requests.token_to_kv_pool
    bs, device = len(reqs), rows.device
    pad = graph_padding(ForwardMode.DECODE, 0, [bs], attn_backend.get_cuda_graph_seq_len_fill_value())
    local_lens = torch.tensor([r.kv_len for r in reqs], dtype=torch.int32)
    local = local_lens > 0
    lens = torch.where(local, local_lens, pad.seq_len)
    row_idx = torch.tensor([r.row if r.kv_len else 0 for r in reqs], dtype=torch.int64)
    save_loc = torch.zeros(bs, dtype=torch.int64)  # tokens other ranks store: the dummy slot 0
    save_loc[save_rows] = local_slots
    save_loc = save_loc.to(device)
    batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=bs,
        req_pool_indices=row_idx.to(device),
        seq_lens=lens.to(device),
        seq_lens_cpu=lens,
        seq_lens_sum=int(lens.sum()),
        out_cache_loc=save_loc,
        positions=positions.to(device),
        req_to_token_pool=rows,
        token_to_kv_pool=kv,
        attn_backend=attn_backend,
    )
    return DcpStep(ForwardMode.DECODE, bs, batch.positions, seq.to(torch.int32), None, save_loc, kv,
                   local_batch=batch, local_mask=local.to(device))
