"""`MultiStepDraftBackend`: one speculative-draft wrapper for every backend.

A draft round runs `num_steps` decode steps of the draft model over `bs` requests with `topk`
branches each. Layout (chosen here; the engine allocates slots to match, e.g. with
`allocate_draft_slots`):

- Request b has L_b tokens cached (`seq_lens`, the committed length) in row `req_pool_indices[b]` of
  `req_to_token`. Draft slots come as `out_cache_loc` int64 `[bs, topk, num_steps]` (or flattened in
  that order): the draft token of branch j at step s sits at position L_b + s in slot
  out_cache_loc[b, j, s].
- Step s has one query per (request, branch), row b*topk + j, which sees request b's L_b cached tokens
  and its own branch's draft tokens of steps 0..s: L_b + s + 1 keys. Column j of slots is branch j's
  path; an engine that re-parents branches between steps keeps that true by moving K/V.
- The shared buffer is a draft request table (a `ReqToTokenPool` of max_batch_size*topk rows), used by
  every step: row b*topk + j = request b's cached slots, then branch j's draft slots. Step s is then an
  ordinary DECODE batch over rows 0..bs*topk-1 with seq_lens L_b + s + 1, positions L_b + s and
  out_cache_loc[:, :, s]. The factory builds each step's backend with a context whose
  `req_to_token_pool` is that table, so every backend runs a draft step as its plain decode, eagerly
  or in CUDA graphs, with no draft-specific code.
- page_size P > 1: backends that read pages need token i of a row at page offset i % P. topk == 1: the
  chain continues the request's last partial page (slots as `alloc_extend` gives them). topk > 1: the
  branches cannot share that page, so each branch gets pages of its own with draft token s at offset
  (L_b + s) % P, and the first r_b = L_b % P slots of its first page receive copies of the K/V of the
  request's last r_b cached tokens (every layer, done by the wrapper before step 0). The row reads:
  the request's full pages, then the branch's pages. A backend whose `needs_page_aligned_draft_kv()`
  returns False skips the copy; its rows point at the request's own last page instead.

Worked example (P = 4, topk = 2, num_steps = 2): the request in row 7 has L = 6 tokens in slots
[20, 21, 22, 23, 40, 41] (pages 5 and 10; r = 2). Branch 0 gets page 12, branch 1 page 13:
    out_cache_loc = [[[50, 51], [54, 55]]]       copies: 40 -> 48, 41 -> 49, 40 -> 52, 41 -> 53
    table row 0 = [20, 21, 22, 23, 48, 49, 50, 51]   (branch 0)
    table row 1 = [20, 21, 22, 23, 52, 53, 54, 55]   (branch 1)
    step 0: seq_lens [7, 7], positions [6, 6], out_cache_loc [50, 54]
    step 1: seq_lens [8, 8], positions [7, 7], out_cache_loc [51, 55]
Without the copy (needs_page_aligned_draft_kv False) both rows start [20, 21, 22, 23, 40, 41].

Checks (both paths): the requests' tensors are checked on the host (shapes, dtypes, devices, host
lengths) before anything is built; on the CPU (and at validation "full") also their values: rows in the
table and distinct, device lengths equal to the host copy, every cached key with a slot in the pool;
on an accelerator at "basic" the rows are clamped into the table on the device (a row outside it reads
row 0 and is recorded in the first step backend's fault word, REQUEST_ROW, raised as `DeviceFaultError`
at its next step) and each step backend's own step check guards the draft slots. Nothing wraps around.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch

from attn_core.contract.backend import AttentionBackend
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.capabilities import Feature
from attn_core.contract.context import BackendContext
from attn_core.contract.errors import GraphShapeError, InvalidArgumentError, KVCacheError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import CudaGraphStep, GraphPadding, graph_padding
from attn_core.contract.validation import FULL, effective_level
from attn_core.memory import KVPool, ReqToTokenPool, window_pool_of
from attn_core.ops.device_faults import DeviceFaultKind
from attn_core.ops.kv_write import record_first

StepFactory = Callable[[BackendContext, int], AttentionBackend]


def allocate_draft_slots(
    allocator, req_to_token_pool, req_pool_indices: Sequence[int], seq_lens: Sequence[int], topk: int, num_steps: int
) -> torch.Tensor:
    """Allocate the draft slots of one round in the module's layout: int64 `[bs, topk, num_steps]` on the
    allocator's device. All or nothing: raises `KVCacheError` (allocating nothing) when slots run out.

    page_size 1: any free slots. topk 1: the chain continues each request's last page. Otherwise each
    branch gets ceil((L % P + num_steps) / P) fresh pages, its drafts starting at offset L % P.
    """
    rows, lens = [int(r) for r in req_pool_indices], [int(n) for n in seq_lens]
    bs, ps = len(lens), allocator.page_size
    if ps == 1 or topk == 1:
        if ps == 1:
            slots = allocator.alloc(bs * topk * num_steps)
        else:
            r2t = req_to_token_pool.req_to_token
            last = [int(r2t[row, n - 1]) if n else 0 for row, n in zip(rows, lens)]
            slots = allocator.alloc_extend(lens, [n + num_steps for n in lens], last)
        if slots is None:
            raise KVCacheError(
                f"out of KV slots for {bs * topk * num_steps} draft tokens ({allocator.available_size()} free)"
            )
        return slots.view(bs, topk, num_steps)
    pages_per_branch = [-(-(n % ps + num_steps) // ps) for n in lens]
    slots = allocator.alloc(sum(pages_per_branch) * topk * ps)
    if slots is None:
        raise KVCacheError(
            f"out of KV slots for the draft pages of {bs} requests x {topk} branches "
            f"({allocator.available_size()} free)"
        )
    pages = slots.view(-1, ps)
    out, cursor = [], 0
    for n, np_ in zip(lens, pages_per_branch):
        branch = pages[cursor : cursor + topk * np_].reshape(topk, np_ * ps)
        out.append(branch[:, n % ps : n % ps + num_steps])
        cursor += topk * np_
    return torch.stack(out)


@dataclass
class _GraphBuffers:
    """Persistent inputs of the draft steps (graphs read these addresses)."""

    req_pool_indices: torch.Tensor  # [max_bs] int64
    seq_lens: torch.Tensor  # [max_bs] int32, L_b
    out_cache_loc: torch.Tensor  # [max_bs, topk, num_steps] int64
    valid: torch.Tensor  # [max_bs] bool, real (not padding) requests
    rows: torch.Tensor  # [max_bs * topk] int64, 0, 1, 2, ...
    step_seq_lens: torch.Tensor  # [num_steps, max_bs * topk] int32
    step_positions: torch.Tensor  # [num_steps, max_bs * topk] int64
    step_out_cache_loc: torch.Tensor  # [num_steps, max_bs * topk] int64


class MultiStepDraftBackend:
    """Per-step backends `factory(step_ctx, step)` for steps 0..num_steps-1 over the shared draft
    request table (see the module docstring for the layout).

    Eager: `init_forward_metadata(...)` builds the table and every step's metadata and returns the
    step batches (batch s has `attn_backend` = step s's backend). Graphs (a draft round's own names: the
    wrapper is not an `AttentionBackend` and takes whole rounds): `init_draft_graph_state(max_bs)`,
    `capture_draft_graph_metadata(bs)` (returns the step batches to capture with) and
    `replay_draft_graph_metadata(bs, ...)` (pads the real requests to bs as `graph_padding` says for
    DECODE: request row 0, L = fill - 1 cached tokens, slot 0; a padding row's step s then has
    seq_len fill + s, its s + 1 draft tokens on top).

    Raises at construction: `InvalidArgumentError` for topk / num_steps < 1, `UnsupportedFeatureError`
    when a step backend cannot run DECODE or, for topk > 1, does not declare `Feature.SPEC_TOPK_GT1`.
    """

    def __init__(
        self, factory: StepFactory, topk: int, num_steps: int, ctx: BackendContext, *, check_layout: bool = True
    ):
        if topk < 1:
            raise InvalidArgumentError("topk", ">= 1", topk)
        if num_steps < 1:
            raise InvalidArgumentError("num_steps", ">= 1", num_steps)
        self.topk, self.num_steps, self.ctx = topk, num_steps, ctx
        self.page_size = ctx.page_size
        self.check_layout = check_layout
        ps = self.page_size
        width = -(-(ctx.max_context_len + num_steps) // ps) * ps
        self.table = ReqToTokenPool(ctx.max_batch_size * topk, width, ctx.device)
        self.step_ctx = replace(
            ctx,
            req_to_token_pool=self.table,
            max_batch_size=ctx.max_batch_size * topk,
            max_context_len=width,
            forward_modes=frozenset({ForwardMode.DECODE}),
        )
        self.backends = [factory(self.step_ctx, s) for s in range(num_steps)]
        for b in self.backends:
            if ForwardMode.DECODE not in b.capabilities.forward_modes:
                raise UnsupportedFeatureError(b.name, "DECODE (every draft step is a decode)")
            if topk > 1 and Feature.SPEC_TOPK_GT1 not in b.capabilities.features:
                raise UnsupportedFeatureError(
                    b.name, f"speculative topk={topk} > 1 (draft tree branches, {Feature.SPEC_TOPK_GT1.value})"
                )
        self.page_aligned = ps > 1 and topk > 1 and any(b.needs_page_aligned_draft_kv() for b in self.backends)
        self._graph: Optional[_GraphBuffers] = None
        self._captured: set[int] = set()

    # ---- shared pieces ---------------------------------------------------------------------------
    def _loc(self, out_cache_loc: torch.Tensor, bs: int) -> torch.Tensor:
        want = (bs, self.topk, self.num_steps)
        if out_cache_loc.numel() != bs * self.topk * self.num_steps:
            raise InvalidArgumentError(
                "out_cache_loc", f"{want} draft slots (bs, topk, num_steps)", tuple(out_cache_loc.shape)
            )
        return out_cache_loc.reshape(want).to(torch.int64)

    def _tail_len(self, seq_lens: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
        """r_b: cached tokens on the request's last partial page that each branch copies (0 when the
        rows need no page alignment, and for padding)."""
        if not self.page_aligned:
            return torch.zeros_like(seq_lens)
        r = seq_lens % self.page_size
        return r if valid is None else torch.where(valid, r, torch.zeros_like(r))

    def _fill_table(self, r2t, rpi, seq_lens, loc, width, valid=None) -> None:
        """Rows 0..bs*topk-1, columns 0..width-1 of the draft table (fixed shapes, no host sync)."""
        bs = rpi.shape[0]
        dev = loc.device
        rpi = self._rows_in_table(rpi, r2t)
        L = seq_lens.to(torch.int64)[:, None, None]
        r = self._tail_len(seq_lens.to(torch.int64), valid)[:, None, None]
        col = torch.arange(width, device=dev, dtype=torch.int64)[None, None, :]
        prefix = r2t[rpi.to(torch.int64)[:, None, None], col.clamp(max=r2t.shape[1] - 1)].to(torch.int64)
        tail_copy = loc[:, :, :1] - (L - col)  # slots of the copied tail on the branch's first page
        draft = loc.gather(2, (col - L).clamp(0, self.num_steps - 1).expand(bs, self.topk, width))
        vals = torch.where(
            col < L - r, prefix, torch.where(col < L, tail_copy, torch.where(col < L + self.num_steps, draft, 0))
        )
        self.table.req_to_token[: bs * self.topk, :width] = vals.reshape(bs * self.topk, width).to(torch.int32)

    def _copy_tails(self, pool, r2t, rpi, seq_lens, loc, valid=None) -> None:
        """Copy each request's last r_b cached tokens' K/V into the first page of every branch."""
        if not self.page_aligned:
            return
        ps, dev = self.page_size, loc.device
        rpi = self._rows_in_table(rpi, r2t)
        L = seq_lens.to(torch.int64)
        r = self._tail_len(L, valid)
        i = torch.arange(ps - 1, device=dev, dtype=torch.int64)
        take = i[None, :] < r[:, None]  # [bs, P-1]
        cols = ((L - r)[:, None] + i).clamp(0, r2t.shape[1] - 1)
        src = torch.where(take, r2t[rpi.to(torch.int64)[:, None], cols].to(torch.int64), 0)
        dst = torch.where(take[:, None, :], loc[:, :, :1] - r[:, None, None] + i, 0)
        src = src[:, None, :].expand_as(dst).reshape(-1)
        dst = dst.reshape(-1)  # masked entries copy dummy slot 0 onto itself
        _copy_kv_slots(pool, dst, src)

    def _rows_in_table(self, rpi: torch.Tensor, r2t: torch.Tensor) -> torch.Tensor:
        """Request rows clamped into the table (int64): a row outside it reads row 0, never wraps, and the
        refusal is recorded (REQUEST_ROW, first request) in the first step backend's fault word (device
        ops, no sync; on the CPU the rows were checked on the host before)."""
        rpi = rpi.to(torch.int64)
        bad = (rpi < 0) | (rpi >= r2t.shape[0])
        record_first(self.backends[0].device_faults.buffer, DeviceFaultKind.REQUEST_ROW, bad)
        return torch.where(bad, torch.zeros_like(rpi), rpi)

    def _check_requests(self, req_pool_indices, seq_lens, seq_lens_cpu, r2t: torch.Tensor, num_slots: int) -> None:
        """The requests' tensors: shapes, dtypes, devices and host lengths always (no device work); on the
        CPU or at validation "full" their values too (rows in the table and distinct, device lengths equal
        to the host copy, a slot in [1, num_slots) for every cached key). `InvalidArgumentError` naming
        the argument."""
        bs = seq_lens_cpu.shape[0] if isinstance(seq_lens_cpu, torch.Tensor) and seq_lens_cpu.dim() == 1 else -1
        dev = self.ctx.device
        for name, x, dtypes, where in (
            ("req_pool_indices", req_pool_indices, (torch.int32, torch.int64), dev),
            ("seq_lens", seq_lens, (torch.int32,), dev),
            ("seq_lens_cpu", seq_lens_cpu, (torch.int32, torch.int64), torch.device("cpu")),
        ):
            if not isinstance(x, torch.Tensor) or x.shape != (bs,) or x.dtype not in dtypes or x.device != where:
                found = (x.dtype, tuple(x.shape), x.device) if isinstance(x, torch.Tensor) else type(x).__name__
                expected = f"a {[str(d) for d in dtypes]} tensor of shape ({bs},) on {where}"
                raise InvalidArgumentError(name, expected, found)
        if not 1 <= bs <= self.ctx.max_batch_size:
            raise InvalidArgumentError("seq_lens", f"1..{self.ctx.max_batch_size} requests", bs)
        lo, hi = int(seq_lens_cpu.min()), int(seq_lens_cpu.max())
        if lo < 0 or hi > self.ctx.max_context_len or hi > r2t.shape[1]:
            limit = min(self.ctx.max_context_len, r2t.shape[1])
            expected = f"cached lengths in 0..{limit} (max_context_len, the table width)"
            raise InvalidArgumentError("seq_lens_cpu", expected, (lo, hi))
        if effective_level(self.ctx) != FULL:
            return
        rows = req_pool_indices.cpu().to(torch.int64)
        if int(rows.min()) < 0 or int(rows.max()) >= r2t.shape[0] or rows.unique().numel() != bs:
            raise InvalidArgumentError("req_pool_indices", f"distinct rows in [0, {r2t.shape[0]})", rows.tolist()[:16])
        if not torch.equal(seq_lens.cpu().to(torch.int64), seq_lens_cpu.to(torch.int64)):
            expected = f"the values of seq_lens_cpu {seq_lens_cpu.tolist()[:16]}"
            raise InvalidArgumentError("seq_lens", expected, seq_lens.cpu().tolist()[:16])
        cols = torch.arange(max(hi, 1))
        table = r2t.cpu()[rows][:, : max(hi, 1)].to(torch.int64)
        visible = cols[None, :] < seq_lens_cpu.to(torch.int64)[:, None]
        bad = visible & ((table < 1) | (table >= num_slots))
        if bad.any():
            r = int(bad.any(1).nonzero()[0])
            expected = f"a slot in [1, {num_slots}) for every cached key of request {r}"
            raise InvalidArgumentError("req_to_token_pool", expected, "a key without one")

    def _step_batch(
        self, s: int, n_rows: int, rows, seq_lens, positions, out_cache_loc, host_lens: torch.Tensor, pool
    ) -> ForwardBatch:
        step_cpu = (host_lens.to(torch.int32) + s + 1).repeat_interleave(self.topk)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=n_rows,
            req_pool_indices=rows,
            seq_lens=seq_lens,
            seq_lens_cpu=step_cpu,
            seq_lens_sum=int(step_cpu.sum()),
            out_cache_loc=out_cache_loc,
            positions=positions,
            req_to_token_pool=self.table,
            token_to_kv_pool=pool,
            attn_backend=self.backends[s],
        )

    def _check_slots(self, r2t, rpi, seq_lens_cpu: torch.Tensor, loc: torch.Tensor) -> None:
        """Host-side check that the slots follow the layout (one device sync; eager path only)."""
        ps = self.page_size
        loc_cpu = loc.cpu()
        bad = (loc_cpu < ps).nonzero()
        if bad.numel():
            raise InvalidArgumentError(
                "out_cache_loc", f"allocated slots (>= {ps}, not the dummy page)", f"slot {loc_cpu[tuple(bad[0])]}"
            )
        if loc_cpu.unique().numel() != loc_cpu.numel():
            raise InvalidArgumentError(
                "out_cache_loc", "distinct slots for every (request, branch, step)", "a slot used twice"
            )
        if ps == 1 or not (self.topk == 1 or self.page_aligned):
            return
        L = seq_lens_cpu.to(torch.int64)
        pos = L[:, None, None] + torch.arange(self.num_steps)
        off_bad = (loc_cpu % ps != pos % ps).nonzero()
        if off_bad.numel():
            b, j, s = off_bad[0].tolist()
            raise InvalidArgumentError(
                "out_cache_loc",
                f"slot at page offset {int(pos[b, 0, s]) % ps} for position {int(pos[b, 0, s])}",
                f"[{b}, {j}, {s}] = {int(loc_cpu[b, j, s])}",
            )
        same_page = (pos[:, :, 1:] % ps != 0) & (loc_cpu[:, :, 1:] != loc_cpu[:, :, :-1] + 1)
        if same_page.any():
            b, j, s = same_page.nonzero()[0].tolist()
            raise InvalidArgumentError(
                "out_cache_loc", "draft tokens within a page in consecutive slots", f"[{b}, {j}, {s + 1}]"
            )
        last_slot = r2t[rpi.to(torch.int64), (L - 1).clamp(min=0).to(r2t.device)].to(torch.int64).cpu()
        last = torch.where(L > 0, last_slot, -1)  # slot of each request's last cached token
        tail = L % ps > 0
        if self.topk == 1:
            broken = tail & (loc_cpu[:, 0, 0] != last + 1)
            if broken.any():
                raise InvalidArgumentError(
                    "out_cache_loc",
                    "a topk=1 chain continuing the request's last page",
                    f"request {int(broken.nonzero()[0])}",
                )
            return
        first_pages = loc_cpu[:, :, 0] // ps
        for b in range(loc_cpu.shape[0]):
            if len(set(first_pages[b].tolist())) != self.topk or (
                bool(tail[b]) and int(last[b]) // ps in first_pages[b].tolist()
            ):
                raise InvalidArgumentError(
                    "out_cache_loc", "a first page of its own for every branch (not the request's)", f"request {b}"
                )

    # ---- eager -----------------------------------------------------------------------------------
    def init_forward_metadata(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        *,
        req_to_token_pool: Optional[ReqToTokenPool] = None,
        token_to_kv_pool: Optional[KVPool] = None,
    ) -> list[ForwardBatch]:
        """Build the draft table (and the tail copies) and every step's metadata for requests with
        `seq_lens` (L_b, int32 `[bs]`, host copy `seq_lens_cpu`) cached tokens; returns the step batches.
        Pools default to the context's."""
        r2t_pool = req_to_token_pool or self.ctx.req_to_token_pool
        pool = token_to_kv_pool or self.ctx.token_to_kv_pool
        if r2t_pool is None or pool is None:
            raise InvalidArgumentError("req_to_token_pool/token_to_kv_pool", "pools given or in the context", None)
        r2t = r2t_pool.req_to_token
        self._check_requests(req_pool_indices, seq_lens, seq_lens_cpu, r2t, pool.num_slots)
        bs = seq_lens_cpu.shape[0]
        loc = self._loc(out_cache_loc, bs)
        if self.check_layout:
            self._check_slots(r2t, req_pool_indices, seq_lens_cpu, loc)
        self._fill_table(r2t, req_pool_indices, seq_lens, loc, int(seq_lens_cpu.max()) + self.num_steps)
        self._copy_tails(pool, r2t, req_pool_indices, seq_lens, loc)
        n = bs * self.topk
        rows = torch.arange(n, dtype=torch.int64, device=loc.device)
        per_row = seq_lens.to(torch.int64).repeat_interleave(self.topk)
        # step s's slots, one dense row per step (loc[:, :, s] is a strided view: kernels read dense rows)
        step_loc = loc.permute(2, 0, 1).reshape(self.num_steps, n).contiguous()
        batches = []
        for s in range(self.num_steps):
            b = self._step_batch(
                s, n, rows, (per_row + s + 1).to(torch.int32), per_row + s, step_loc[s], seq_lens_cpu, pool
            )
            self.backends[s].init_forward_metadata(b)
            batches.append(b)
        return batches

    # ---- CUDA graphs -----------------------------------------------------------------------------
    def init_draft_graph_state(self, max_bs: int) -> None:
        """Persistent buffers for up to `max_bs` requests (max_bs*topk rows per step) and every step
        backend's graph state."""
        if not 1 <= max_bs <= self.ctx.max_batch_size:
            raise InvalidArgumentError("max_bs", f"1..{self.ctx.max_batch_size}", max_bs)
        self._ctx_pools()
        dev, n, S = self.ctx.device, max_bs * self.topk, self.num_steps
        self._graph = _GraphBuffers(
            req_pool_indices=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            seq_lens=torch.zeros(max_bs, dtype=torch.int32, device=dev),
            out_cache_loc=torch.zeros((max_bs, self.topk, S), dtype=torch.int64, device=dev),
            valid=torch.zeros(max_bs, dtype=torch.bool, device=dev),
            rows=torch.arange(n, dtype=torch.int64, device=dev),
            step_seq_lens=torch.zeros((S, n), dtype=torch.int32, device=dev),
            step_positions=torch.zeros((S, n), dtype=torch.int64, device=dev),
            step_out_cache_loc=torch.zeros((S, n), dtype=torch.int64, device=dev),
        )
        for b in self.backends:
            b.init_cuda_graph_state(n, n)
        self._captured.clear()

    def _ctx_pools(self) -> tuple[ReqToTokenPool, KVPool]:
        """The context's request table and KV pool, which the graphs read."""
        r2t_pool, kv_pool = self.ctx.req_to_token_pool, self.ctx.token_to_kv_pool
        if r2t_pool is None or kv_pool is None:
            raise InvalidArgumentError(
                "ctx", "a context with req_to_token_pool and token_to_kv_pool (graphs read them)", None
            )
        return r2t_pool, kv_pool

    def _buffers(self) -> _GraphBuffers:
        if self._graph is None:
            raise InvalidArgumentError("init_draft_graph_state", "called before capture/replay", None)
        return self._graph

    def _padding(self, n: int, bs: int) -> GraphPadding:
        """n real requests padded to the captured size bs (each step is a DECODE batch)."""
        return graph_padding(ForwardMode.DECODE, n, [bs], self.backends[0].get_cuda_graph_seq_len_fill_value())

    def _stage(self, pad: GraphPadding, req_pool_indices, seq_lens, out_cache_loc) -> torch.Tensor:
        """Write the real requests (first n) and padding (rows n..bs-1) into the graph buffers, then the
        table, tail copies and per-step inputs; returns the device L_b of the padded batch."""
        g = self._buffers()
        n, bs = pad.bs, pad.padded_bs
        g.req_pool_indices[:n] = req_pool_indices
        g.req_pool_indices[n:bs] = 0
        g.seq_lens[:n] = seq_lens
        g.seq_lens[n:bs] = pad.prefix_len
        g.out_cache_loc[:n] = self._loc(out_cache_loc, n)
        g.out_cache_loc[n:bs] = 0
        g.valid[:n] = True
        g.valid[n:bs] = False
        rpi, L, loc, valid = g.req_pool_indices[:bs], g.seq_lens[:bs], g.out_cache_loc[:bs], g.valid[:bs]
        r2t_pool, kv_pool = self._ctx_pools()
        r2t = r2t_pool.req_to_token
        self._fill_table(r2t, rpi, L, loc, self.table.max_context_len, valid)
        self._copy_tails(kv_pool, r2t, rpi, L, loc, valid)
        rows = bs * self.topk
        per_row = L.to(torch.int64).repeat_interleave(self.topk)
        steps = torch.arange(self.num_steps, device=per_row.device)[:, None]
        g.step_seq_lens[:, :rows] = per_row[None, :] + steps + 1
        g.step_positions[:, :rows] = per_row[None, :] + steps
        g.step_out_cache_loc[:, :rows] = loc.permute(2, 0, 1).reshape(self.num_steps, rows)
        return L

    def _graph_step_batches(self, bs: int, host_lens: torch.Tensor) -> list[ForwardBatch]:
        g, rows = self._buffers(), bs * self.topk
        return [
            self._step_batch(
                s,
                rows,
                g.rows[:rows],
                g.step_seq_lens[s, :rows],
                g.step_positions[s, :rows],
                g.step_out_cache_loc[s, :rows],
                host_lens,
                self.ctx.token_to_kv_pool,
            )
            for s in range(self.num_steps)
        ]

    def _require_graph(self, bs: int) -> None:
        max_bs = self._buffers().req_pool_indices.shape[0]
        if not 1 <= bs <= max_bs:
            raise InvalidArgumentError("bs", f"1..{max_bs} (init_draft_graph_state's max_bs)", bs)

    def capture_draft_graph_metadata(self, bs: int) -> list[ForwardBatch]:
        """Capture-time metadata for `bs` requests (all padding) of every step; returns the step batches
        (views of the persistent buffers) to run inside the capture."""
        self._require_graph(bs)
        dev = self._buffers().rows.device
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        pad = self._padding(0, bs)
        self._stage(pad, empty, empty.to(torch.int32), empty)
        batches = self._graph_step_batches(bs, torch.full((bs,), pad.prefix_len, dtype=torch.int32))
        for s, b in enumerate(batches):
            self.backends[s].capture_graph_step(CudaGraphStep.from_batch(b, with_host_lens=False))
        self._captured.add(bs)
        return batches

    def replay_draft_graph_metadata(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
        seq_lens_cpu: Optional[torch.Tensor] = None,
    ) -> list[ForwardBatch]:
        """Refresh the buffers of captured size `bs` for the n <= bs real requests given (the rest is
        padding) and every step's metadata; returns the step batches (views; their real rows are the
        first n*topk). Without `seq_lens_cpu` this costs one device sync."""
        self._require_graph(bs)
        n = req_pool_indices.shape[0]
        if bs not in self._captured or not 1 <= n <= bs or seq_lens.shape != (n,):
            raise GraphShapeError("bs", f"a captured size {sorted(self._captured)} >= the {n} requests given", bs)
        if seq_lens_cpu is not None:
            r2t_pool, kv_pool = self._ctx_pools()
            self._check_requests(req_pool_indices, seq_lens, seq_lens_cpu, r2t_pool.req_to_token, kv_pool.num_slots)
        pad = self._padding(n, bs)
        L = self._stage(pad, req_pool_indices, seq_lens, out_cache_loc)
        if seq_lens_cpu is None:
            host = L.cpu().to(torch.int32)
        else:
            host = torch.cat([seq_lens_cpu.to(torch.int32), torch.full((bs - n,), pad.prefix_len, dtype=torch.int32)])
        batches = self._graph_step_batches(bs, host)
        for s, b in enumerate(batches):
            self.backends[s].replay_graph_step(CudaGraphStep.from_batch(b))
        return batches


def _copy_kv_slots(pool, dst: torch.Tensor, src: torch.Tensor) -> None:
    """K/V of slots `src` to slots `dst` in every layer (fixed shapes; raw bytes for fp8 caches; either
    KV layout)."""
    if window_pool_of(pool) is not None:
        raise UnsupportedFeatureError("multi_step_draft", "page-aligned draft K/V copies in a sliding-window KV pool")
    ps = pool.page_size
    for layer in range(pool.layer_num):
        k, v = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
        bufs = [k] if v.data_ptr() == k.data_ptr() else [k, v]  # MLA: the value is a view of the latent
        for buf in bufs:
            raw = buf.view(torch.uint8) if buf.element_size() == 1 else buf
            if getattr(pool, "kv_layout", "NHD") == "HND":
                raw[dst // ps, :, dst % ps] = raw[src // ps, :, src % ps]
            else:
                raw[dst] = raw[src]
