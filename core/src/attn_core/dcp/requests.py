"""One DCP rank's requests and steps: each rank allocates and stores only its shard of every request.

Every rank of a DCP group holds its own `RequestPool` (its own request→slot rows, allocator and KV pool)
and runs the same scheduling: the same `add` / `free` / `build_dcp_step` calls in the same order with the
same work. A request's global token p is stored by rank `layout.rank_of(p)` at local position
`layout.local_position(p)` of that rank's row (`attn_core.dcp.layout`), so a rank's row of the request
is an ordinary row of its local tokens and its pages hold only its blocks.

`build_dcp_step` gives, per rank: the global positions of the step's new tokens (for RoPE), which of
them this rank stores and in which local slots (`DcpStep.save_kv`), and for DECODE and TARGET_VERIFY
steps local DECODE `ForwardBatch`es over this rank's shard (`DcpStep.local_parts`) that any backend runs
unchanged: a row's "new token" is the last local key its query sees (already written), so they run with
`save_kv_cache=False`. Rows whose query sees no local key are left out (`local_rows`).

TARGET_VERIFY (`build_dcp_step(..., mode="target_verify")`, the same k >= 1 draft tokens for every
request, a chain: draft j sees the cached tokens and drafts 0..j): the drafts' K/V are stored as EXTEND
stores them (each on its rank, by the interleaved layout), and every one of the step's T = bs * k
queries is a row. Because the layout keeps a rank's tokens in global order, the keys at global positions
<= p that a rank holds are exactly the first `layout.local_lens(p + 1, rank)` entries of its local row,
so query p's causal rule on a rank is that prefix of the local row. Where the local backend declares
TARGET_VERIFY with custom masks (`Feature.CUSTOM_MASK`), the requests with at least k local keys run as
one local TARGET_VERIFY batch whose mask for request r is `[k, local_len]`, entry (j, i) True where local
key i's global position is <= prefix_len + j (`DcpLayout.global_position`). Every other query (a request
with fewer than k local keys, which a TARGET_VERIFY batch cannot hold, or a backend without custom
masks, or `verify_masks=False`) is a DECODE row of that prefix's length, which every DECODE backend
declaring LSE output serves. Two such rows of a request that see the same local keys (draft j+1 stored
on another rank) would write the same "new token" slot, which a batch may not hold, so DECODE rows are
split into parts: part o holds each (request, local length)'s o-th query (at most k parts). Tree masks
(topk > 1, `draft_masks`) are served by the custom-mask batch only: every request needs at least k keys
on every rank (else a typed error on every rank alike).

Graph-shaped steps (`build_dcp_step(..., graph_shaped=True)`, DECODE only) have the shapes a CUDA graph
needs: fixed for a batch size, nothing host-dependent. Their local batch covers every request of the
step, in step order; a request with no local key is a padding row as `attn_core.contract.graph_step.graph_padding`
defines it (request row 0, the padding seq_len, KV slot 0) and `local_mask` (bool `[bs]`, on the device)
is False there, so `dcp_decode_attention` gives it LSE -inf and output 0 with `torch.where`. `save_kv`
writes every new token: a token another rank stores goes to the reserved dummy slot 0. Such a step runs
through `attn_core.CudaGraphRunner`: `runner.run(step.local_batch, {..., **step.graph_inputs()})` with
`DCP_GRAPH_INPUTS` among the runner's inputs, and inside `run_layers(batch, inputs)` the step is
`DcpStep.from_graph_batch(batch, inputs)` (the runner's static buffers; the runner pads rows beyond the
real batch the same way, their mask input zeroed).

Rejected drafts roll back with `DcpRequestPool.truncate` (each rank drops its local share). Not
supported here: prefix forks, DRAFT_EXTEND and tree (topk > 1) verify masks.
Slot exhaustion on one rank raises `KVCacheError` there (nothing changes on that rank) while another
rank may have succeeded; an engine treats it as fatal or preempts on every rank alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from attn_core.contract.batch import ForwardBatch, SpecInfo, batch_field
from attn_core.contract.capabilities import Feature
from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import graph_padding
from attn_core.dcp.layout import DcpLayout
from attn_core.engine.requests import Request, RequestPool
from attn_core.engine.step_builder import step_mode
from attn_core.memory.kv_pool import KVPool

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

    def truncate(self, req: Request, kv_len: int) -> None:
        """Keep the request's first `kv_len` global tokens (e.g. drop rejected drafts): each rank keeps its
        `layout.local_lens(kv_len, rank)` local tokens (`RequestPool.truncate`; the dropped slots stay spares).

        Example (world 2, interleave 4, 11 tokens, truncate to 6): rank 0 keeps 4 of its 7, rank 1 2 of its 4.
        """
        length = self.kv_len(req)
        if not isinstance(kv_len, int) or not 0 <= kv_len <= length:
            raise InvalidArgumentError("kv_len", f"an int in [0, {length}] (the request's global length)", kv_len)
        self.requests.truncate(req, int(self.layout.local_lens(torch.tensor(kv_len), self.rank)))
        self._global_len[req.rid] = kv_len


@dataclass
class DcpStep:
    """One rank's part of a step (see the module docstring).

    forward_mode: the global mode (DECODE / MIXED / EXTEND / TARGET_VERIFY); batch_size: requests in the
    step; positions: int64 `[T]` global positions of the new tokens; seq_lens_cpu: int32 `[bs]` global
    lengths (None in a step made by `from_graph_batch`); save_rows: int64 `[n]` indices into the step's T
    new tokens this rank stores, save_loc: int64 `[n]` their local slots (graph-shaped: save_rows None,
    save_loc `[T]` with slot 0 for the tokens other ranks store); local_batch: DECODE batch over this
    rank's shard (DECODE steps with a local key only; graph-shaped: every DECODE step, `bs` rows);
    local_rows: int64 `[n_local]` the step's query rows it covers, in order (DECODE: request indices;
    TARGET_VERIFY: indices into the T new tokens; None when graph-shaped); more_parts: TARGET_VERIFY's
    further (rows, batch) parts (module docstring); local_mask: bool `[bs]` on the device, True where this
    rank holds a key of the request (graph-shaped steps only, else None).
    """

    forward_mode: ForwardMode
    batch_size: int
    positions: torch.Tensor
    seq_lens_cpu: Optional[torch.Tensor]
    save_rows: Optional[torch.Tensor]
    save_loc: torch.Tensor
    token_to_kv_pool: Optional[KVPool]
    local_batch: Optional[ForwardBatch] = None
    local_rows: Optional[torch.Tensor] = None
    local_mask: Optional[torch.Tensor] = None
    more_parts: list[tuple[torch.Tensor, ForwardBatch]] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        """Query rows of the step: `batch_size` (DECODE) or the T new tokens (TARGET_VERIFY)."""
        return self.positions.shape[0] if self.forward_mode.is_target_verify() else self.batch_size

    @property
    def local_parts(self) -> list[tuple[torch.Tensor, ForwardBatch]]:
        """The (rows, DECODE batch) pairs of an eager step's local attention (none when no query sees a local key)."""
        if self.local_batch is None or self.local_rows is None:
            return list(self.more_parts)
        return [(self.local_rows, self.local_batch)] + self.more_parts

    @property
    def graph_shaped(self) -> bool:
        """Whether the local batch covers every request with fixed shapes (`local_mask` set)."""
        return self.local_mask is not None

    def save_kv(self, layer, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this rank's share of the step's new K/V (`[T, Hkv, D]`, every new token) into its pool
        (graph-shaped: all T rows, those stored elsewhere into the dummy slot 0; no host sync)."""
        if k.shape[0] != self.positions.shape[0]:
            raise InvalidArgumentError("k", f"{self.positions.shape[0]} rows (the step's new tokens)", tuple(k.shape))
        pool = self.token_to_kv_pool
        if pool is None:
            raise InvalidArgumentError(
                "step.token_to_kv_pool", "the request pool's KV pool (build_dcp_step sets it)", None
            )
        if self.save_rows is None:
            pool.set_kv_buffer(layer, self.save_loc, k, v)
        elif self.save_loc.numel():
            pool.set_kv_buffer(layer, self.save_loc, k[self.save_rows], v[self.save_rows])

    def init_forward_metadata(self) -> None:
        """Once per step: the local batch's metadata on its backend (nothing when there is no local batch;
        a step of several parts has its metadata made by `dcp_attention` before each part, every layer).
        A graph-shaped step is refused (`InvalidArgumentError`): its padding rows read the dummy slot, so it
        runs through a CUDA-graph runner, whose capture / replay metadata calls take such rows."""
        if self.graph_shaped:
            raise InvalidArgumentError(
                "step",
                "a step built with graph_shaped=False (a graph-shaped step runs through "
                "CudaGraphRunner.run(step.local_batch, ...))",
                "a graph-shaped step",
            )
        if self.local_batch is not None and not self.more_parts:
            batch_field(self.local_batch.attn_backend, "attn_backend").init_forward_metadata(self.local_batch)

    def graph_inputs(self) -> dict[str, torch.Tensor]:
        """The DCP inputs of a graph-shaped step for `CudaGraphRunner.run` (names of `DCP_GRAPH_INPUTS`)."""
        if not self.graph_shaped:
            raise InvalidArgumentError(
                "step", "a graph-shaped DECODE step (build_dcp_step(..., graph_shaped=True))", self.forward_mode.name
            )
        return {DCP_LOCAL_MASK: self.graph_part()[1]}

    def graph_part(self) -> tuple[ForwardBatch, torch.Tensor]:
        """A graph-shaped step's local batch (every request a row) and its `local_mask` (bool `[bs]`)."""
        if self.local_batch is None or self.local_mask is None:
            raise InvalidArgumentError("step", "a graph-shaped step (its local batch and mask)", self.forward_mode.name)
        return self.local_batch, self.local_mask

    @classmethod
    def from_graph_batch(cls, batch: ForwardBatch, inputs: dict[str, torch.Tensor]) -> DcpStep:
        """The graph-shaped DECODE step a `CudaGraphRunner`'s `run_layers(batch, inputs)` runs: `batch` is
        the runner's static batch (the local batch of `graph_inputs`' step, padded to the captured size;
        its positions the global ones), `inputs[DCP_LOCAL_MASK]` the static mask. Views only (no copy)."""
        mask = inputs.get(DCP_LOCAL_MASK)
        if mask is None:
            raise InvalidArgumentError(
                "inputs", f"a {DCP_LOCAL_MASK!r} tensor (add DCP_GRAPH_INPUTS to the runner's inputs)", sorted(inputs)
            )
        if not batch.forward_mode.is_decode() or batch.positions is None:
            raise InvalidArgumentError("batch", "a DECODE graph batch with positions", batch.forward_mode.name)
        return cls(
            ForwardMode.DECODE,
            batch.batch_size,
            batch.positions,
            None,
            None,
            batch.out_cache_loc,
            batch.token_to_kv_pool,
            local_batch=batch,
            local_mask=mask,
        )


def build_dcp_step(
    pool: DcpRequestPool,
    work: Sequence[tuple[Request, int]],
    *,
    attn_backend=None,
    graph_shaped: bool = False,
    mode: Union[ForwardMode, str, None] = None,
    verify_masks: bool = True,
    draft_masks: Optional[Sequence[torch.Tensor]] = None,
) -> DcpStep:
    """This rank's part of a step where request work[i][0] runs work[i][1] new tokens (global counts,
    the same on every rank). Allocates the local slots of the new tokens this rank stores, writes them
    into the requests' local rows and advances the lengths. `mode` None infers DECODE / MIXED / EXTEND;
    "target_verify" asks for a verify step (the same number of drafts for every request; `verify_masks`
    False keeps it to DECODE rows even when the backend takes custom masks; `draft_masks`, one bool
    `[k, k]` per request, entry (j, m) True where draft j sees draft m, diagonal True, gives a tree
    instead of the chain: it needs the custom-mask batch for every request, so a backend declaring
    custom masks and at least k keys of every request on every rank, else `InvalidArgumentError` on every
    rank alike, before any allocation). `graph_shaped`
    (a DECODE step; needs `attn_backend` for its padding seq_len) gives the fixed shapes of a CUDA graph
    (module docstring).

    Worked example (world 2, interleave 4, rank 1): a new request runs 6 prompt tokens (EXTEND):
    positions [0..5], rank 1 stores tokens 4 and 5 (save_rows [4, 5], two local slots), no local batch.
    The next step (DECODE, 1 token at position 6): save_rows [0]; local_batch has the request with local
    seq_len 3 (tokens 4, 5, 6); on rank 0 save_rows is empty and the local seq_len is 4 (tokens 0..3).
    Graph-shaped, with a second request of 2 tokens decoding its third (position 2) in the same step:
    rank 1 has local_mask [True, False], local seq_lens [3, fill] (the second a padding row: request row
    0, slot 0), save_loc [its slot for position 6, 0]; rank 0 local_mask [True, True], seq_lens [4, 3],
    save_loc [0, its slot for position 2].
    Verify (world 2, interleave 4, rank 1, `verify_masks=False`): a request of 5 tokens verifies 2 drafts
    (positions 5, 6, both rank 1's): its queries see 2 and 3 local keys, one part; on rank 0 both see the
    4 keys 0..3, so two parts of one row each. With a backend taking custom masks, both ranks run one
    TARGET_VERIFY batch (rank 0: mask [[1, 1, 1, 1], [1, 1, 1, 1]]; rank 1: [[1, 1, 0], [1, 1, 1]]).
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
    inferred = step_mode(prefix.tolist(), counts)
    if mode is not None and mode not in (inferred, inferred.name.lower(), ForwardMode.TARGET_VERIFY, "target_verify"):
        raise InvalidArgumentError("mode", f"None, target_verify or {inferred.name.lower()} (inferred)", mode)
    mode = inferred if mode is None else ForwardMode.parse(mode)
    if mode.is_target_verify() and len(set(counts)) != 1:
        raise InvalidArgumentError("work", "the same number of draft tokens for every TARGET_VERIFY request", counts)
    if draft_masks is not None:
        _check_draft_masks(layout, draft_masks, mode, counts, seq, verify_masks and _takes_verify_masks(attn_backend))
    if graph_shaped:
        if not mode.is_decode():
            raise InvalidArgumentError(
                "graph_shaped", f"False for a {mode.name} step (graph-shaped steps are DECODE)", True
            )
        if attn_backend is None:
            raise InvalidArgumentError(
                "attn_backend", "the local backend (its CUDA-graph fill value pads rows without a local key)", None
            )
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
    step = DcpStep(
        mode,
        len(reqs),
        positions.to(device),
        seq.to(torch.int32),
        save_rows.to(device),
        local_slots.to(device),
        pool.requests.token_to_kv_pool,
    )
    parts: list[tuple[torch.Tensor, ForwardBatch]] = []
    if mode.is_decode():
        local_lens = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
        parts = _decode_parts(pool, reqs, local_lens, attn_backend, list(range(len(reqs))))
    elif mode.is_target_verify():
        k = counts[0]
        masked = (
            [i for i, r in enumerate(reqs) if r.kv_len >= k]
            if verify_masks and _takes_verify_masks(attn_backend)
            else []
        )
        if masked:
            trees = [draft_masks[i] for i in masked] if draft_masks is not None else None
            parts = _verify_mask_part(pool, [reqs[i] for i in masked], prefix[masked], k, attn_backend, masked, trees)
        rows_of = [i * k + j for i in sorted(set(range(len(reqs))) - set(masked)) for j in range(k)]
        local_lens = layout.local_lens(positions[rows_of] + 1, rank)  # the local keys each query sees
        parts += _decode_parts(pool, [reqs[t // k] for t in rows_of], local_lens, attn_backend, rows_of)
    if parts:
        (step.local_rows, step.local_batch), step.more_parts = parts[0], parts[1:]
    return step


def _takes_verify_masks(attn_backend) -> bool:
    """Whether the local backend declares TARGET_VERIFY with custom masks (then `_verify_mask_part` serves
    the requests with at least k local keys in one batch)."""
    caps = getattr(attn_backend, "capabilities", None)
    return caps is not None and ForwardMode.TARGET_VERIFY in caps.forward_modes and Feature.CUSTOM_MASK in caps.features


def _check_draft_masks(
    layout: DcpLayout,
    draft_masks: Sequence[torch.Tensor],
    mode: ForwardMode,
    counts: list[int],
    seq: torch.Tensor,
    masks_taken: bool,
) -> None:
    """Typed errors for `build_dcp_step`'s `draft_masks` (the same verdict on every rank: it reads only
    global lengths and the backend's declared capabilities)."""
    if not mode.is_target_verify():
        raise InvalidArgumentError(
            "draft_masks", f"None for a {mode.name} step (tree masks are TARGET_VERIFY's)", len(draft_masks)
        )
    k = counts[0]
    if len(draft_masks) != len(counts):
        raise InvalidArgumentError("draft_masks", f"one mask per request ({len(counts)})", len(draft_masks))
    for i, m in enumerate(draft_masks):
        if (
            not isinstance(m, torch.Tensor)
            or m.dtype != torch.bool
            or tuple(m.shape) != (k, k)
            or not bool(m.cpu().diagonal().all())
        ):
            raise InvalidArgumentError(
                f"draft_masks[{i}]",
                f"a bool [{k}, {k}] tensor with a True diagonal",
                (tuple(m.shape), m.dtype) if isinstance(m, torch.Tensor) else m,
            )
    if not masks_taken:
        raise InvalidArgumentError(
            "draft_masks",
            "None (a tree needs a local backend declaring TARGET_VERIFY with custom masks, and verify_masks=True)",
            "tree masks",
        )
    fewest = torch.stack([layout.local_lens(seq, r) for r in range(layout.world)]).min(0).values
    if bool((fewest < k).any()):
        raise InvalidArgumentError(
            "draft_masks",
            f"None while a request has fewer than {k} keys on some rank (its queries "
            "run as DECODE rows, which take no tree)",
            fewest.tolist(),
        )


def _verify_mask_part(
    pool: DcpRequestPool,
    reqs: list[Request],
    prefix: torch.Tensor,
    k: int,
    attn_backend,
    step_rows: list[int],
    trees: Optional[list[torch.Tensor]] = None,
) -> list[tuple[torch.Tensor, ForwardBatch]]:
    """One local TARGET_VERIFY batch of requests with at least k local keys (their lengths already
    advanced): request r's k queries over its whole local row, draft j's mask row True at the local keys of
    global position < prefix[r] and at the drafts m it sees (m <= j, or `trees[r][j, m]`). `step_rows`
    are the requests' indices in the step; the part's rows are their queries, request after request.

    Example (world 2, interleave 4, rank 0, prefix 9, k 2: local keys at 0..3, 8..10): mask
    [[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]], seq_len 7, extend_prefix_len 5.
    """
    layout, rank = pool.layout, pool.rank
    rows, device = pool.requests.req_to_token_pool, pool.requests.req_to_token_pool.device
    bs = len(reqs)
    lens = torch.tensor([r.kv_len for r in reqs], dtype=torch.int32)
    chain = torch.ones(k, k, dtype=torch.bool).tril()
    masks = []
    for i, (n, p) in enumerate(zip(lens.tolist(), prefix.tolist())):
        draft = layout.global_position(torch.arange(n), rank) - p  # the draft index of each local key (< 0: cached)
        tree = trees[i].cpu() if trees is not None else chain
        masks.append((draft < 0)[None, :] | (tree[:, draft.clamp(0, k - 1)] & (draft >= 0)[None, :]))
    q_lens = torch.full((bs,), k, dtype=torch.int32)
    indptr = torch.zeros(bs + 1, dtype=torch.int64)
    indptr[1:] = (lens.to(torch.int64) * k).cumsum(0)
    batch = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY,
        batch_size=bs,
        req_pool_indices=torch.tensor([r.row for r in reqs], dtype=torch.int64).to(device),
        seq_lens=lens.to(device),
        seq_lens_cpu=lens,
        seq_lens_sum=int(lens.sum()),
        out_cache_loc=torch.tensor([s for r in reqs for s in r.slots[r.kv_len - k : r.kv_len]], dtype=torch.int64).to(
            device
        ),
        req_to_token_pool=rows,
        token_to_kv_pool=pool.requests.token_to_kv_pool,
        extend_prefix_lens=(lens - k).to(device),
        extend_prefix_lens_cpu=lens - k,
        extend_seq_lens=q_lens.to(device),
        extend_seq_lens_cpu=q_lens,
        extend_start_loc=(torch.arange(bs, dtype=torch.int32) * k).to(device),
        extend_num_tokens=bs * k,
        spec_info=SpecInfo(
            num_draft_tokens=k,
            custom_mask=torch.cat([m.reshape(-1) for m in masks]).to(device),
            mask_indptr=indptr.to(device),
        ),
        attn_backend=attn_backend,
    )
    query_rows = torch.tensor([i * k + j for i in step_rows for j in range(k)], dtype=torch.int64)
    return [(query_rows.to(device), batch)]


def _decode_parts(
    pool: DcpRequestPool, row_reqs: list[Request], lens: torch.Tensor, attn_backend, step_rows: list[int]
) -> list[tuple[torch.Tensor, ForwardBatch]]:
    """Local DECODE batches of query rows: row i (the step's row `step_rows[i]`) reads the first `lens[i]`
    local keys of `row_reqs[i]` (rows with 0 are left out). Rows of one request with the same length go
    to successive parts (a batch holds each "new token" slot once). Returns [(step rows int64 `[n]` on
    the device, batch)], part by part.

    Example: row_reqs [A, A, A, B], lens [2, 2, 3, 0], step_rows [0, 1, 2, 3] -> part 0 rows [0, 2]
    (lengths 2, 3), part 1 row [1].
    """
    rows = pool.requests.req_to_token_pool
    device = rows.device
    seen: dict[tuple[int, int], int] = {}
    part_rows: list[list[int]] = []
    for i, (r, n) in enumerate(zip(row_reqs, lens.tolist())):
        if n > 0:
            o = seen.get((r.rid, n), 0)
            seen[(r.rid, n)] = o + 1
            if o == len(part_rows):
                part_rows.append([])
            part_rows[o].append(i)
    parts = []
    for idx in part_rows:
        kept = [row_reqs[i] for i in idx]
        n = lens[idx].to(torch.int32)
        parts.append(
            (
                torch.tensor([step_rows[i] for i in idx], dtype=torch.int64).to(device),
                ForwardBatch(
                    forward_mode=ForwardMode.DECODE,
                    batch_size=len(kept),
                    req_pool_indices=torch.tensor([r.row for r in kept], dtype=torch.int64).to(device),
                    seq_lens=n.to(device),
                    seq_lens_cpu=n,
                    seq_lens_sum=int(n.sum()),
                    out_cache_loc=torch.tensor(
                        [r.slots[m - 1] for r, m in zip(kept, n.tolist())], dtype=torch.int64
                    ).to(device),
                    req_to_token_pool=rows,
                    token_to_kv_pool=pool.requests.token_to_kv_pool,
                    attn_backend=attn_backend,
                ),
            )
        )
    return parts


def _graph_shaped_decode(
    pool: DcpRequestPool,
    reqs: list[Request],
    positions: torch.Tensor,
    seq: torch.Tensor,
    save_rows: torch.Tensor,
    local_slots: torch.Tensor,
    attn_backend,
) -> DcpStep:
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
    return DcpStep(
        ForwardMode.DECODE,
        bs,
        batch_field(batch.positions, "positions"),
        seq.to(torch.int32),
        None,
        save_loc,
        kv,
        local_batch=batch,
        local_mask=local.to(device),
    )
