"""`FlashInferMLABackend` (`flashinfer_mla`): absorbed MLA over attn-core's `MLATokenToKVPool` through
FlashInfer's MLA paged wrapper (FA3 on SM90, FA2 on SM80).

Every mode is one kind of plan: each request's queries over all its keys (the new ones included, which
`save_kv` has written to the pool first), causal for every mode but DECODE (a request's queries are its
last keys). Per step, `build_forward_metadata` (called by the base class's validating
`init_forward_metadata`) builds the key list once (`indices.build_page_list`: host offsets and lengths,
page ids from one index launch into a reused `DeviceScratch` buffer, every slot checked against the
pool, refusals recorded in the backend's fault buffer: `poll_device_fault`) and plans one wrapper per
layer scaling met so far; a scaling first met in `forward` is planned then and remembered. A wrapper's first
plan is FlashInfer's own, later ones `replan.mla` (the scheduler call alone); layers run it through
`replan.mla_run` (the kernel call alone) with the same versions. Host arrays are reused: the query
layout per (batch size, queries per request) when every request has the same count, the page offsets
per batch size (`indices.HostOffsets`).

CUDA graphs (DECODE and TARGET_VERIFY): `init_cuda_graph_state` allocates the fixed index buffers;
capture builds graph-mode wrappers per (batch size, mode) (attn-core's `GraphCaptures` keeps them);
replay rewrites the page ids (one index launch) and re-plans lean. Tree masks (speculative topk > 1) are
refused: FlashInfer's MLA wrapper takes no custom mask.

Plan once per step, run thin: the step's plan is an `MLAStep`, whose `run(q, k, v, layer, batch)` is the
whole per-layer work (the wrapper of the layer's scaling, the new latent written, FlashInfer's run).

Extension point (public, pinned by `tests/test_mla_wiring_fake.py::test_composed_backend_*`): another
backend may serve some steps itself and hand the others to a `FlashInferMLABackend` it holds, without
subclassing it. It creates one over the same context (`FlashInferMLABackend(ctx, **options)`), forwards
`init_cuda_graph_state`, and for each step it does not serve takes the plan from `build_forward_metadata(batch)`
(a batch it has validated itself: its own `init_forward_metadata` ran), `capture_step(step)` or
`replay_step(step)` (a `CudaGraphStep`), and runs each layer with `plan.run(q, k, v, layer, batch,
save_kv_cache, return_lse)`; `plan_prefill` and `poll_device_fault` are public too. attn-trtllm-mla's
`TRTLLMMLABackend` is such a backend:

    class MyMLA(AttentionBackend[Union[MyPlan, MLAStep]]):
        def __init__(self, ctx, **options):
            super().__init__(ctx)
            self.fallback = FlashInferMLABackend(ctx, **options)

        def build_forward_metadata(self, batch):
            return my_plan(batch) if i_serve(batch) else self.fallback.build_forward_metadata(batch)

        def forward_decode(self, q, k, v, layer, batch, save_kv_cache=True, return_lse=False):
            return self.forward_metadata.run(q, k, v, layer, batch, save_kv_cache, return_lse)

DeepSeek's prefill path (non-absorbed MHA over the new tokens plus the cached prefix chunk by chunk) is
`plan_prefill` (see `mla_prefill.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import flashinfer
import torch

from attn_core.batching.batch_utils import shared_query_len
from attn_core.batching.chunked_prefill import prefill_lengths
from attn_core.contract.backend import AttentionBackend
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.contract.layer import AttentionLayer
from attn_core.discovery.probes import triton_interpreter_enabled
from attn_core.engine.graph_captures import GraphCaptures, captures_of
from attn_core.memory.scratch import DeviceScratch
from attn_core.ops.device_faults import DeviceFaultFlags
from attn_core.ops.kv_indices import pages_for
from attn_flashinfer import mla_plans, replan
from attn_flashinfer.backend import DEFAULT_WORKSPACE_BYTES
from attn_flashinfer.indices import HostOffsets, PageList, QueryLayout, build_page_list, query_layout
from attn_flashinfer.mla_prefill import PrefillPlan, PrefillWrappers
from attn_flashinfer.mla_spec import CAPABILITIES
from attn_flashinfer.mla_steps import MLADims, MLAGraphBuffers, check_capacity, check_mla_context, refuse_tree_mask
from attn_flashinfer.mla_works import StepWorks, WorkLaunch, WorkLayout, cluster_size, fits, work_layout
from attn_flashinfer.steps import StepInputs, eager_inputs, refuse_while_capturing


@dataclass
class WorkPlan:
    """The device work list of one step shape: its launch, FlashInfer's plan info for its layout, the work
    buffer's bytes (FlashInfer's int workspace) and the last step's `StepWorks` (reused while it holds)."""

    launch: WorkLaunch
    info: object
    int_ws: torch.Tensor
    works: Optional[StepWorks] = None


@dataclass
class MLAGraph:
    """A captured (batch size, mode): its buffer slices and graph-mode wrappers by layer scaling."""

    buffers: MLAGraphBuffers
    wrappers: dict[float, object] = field(default_factory=dict)
    planned_once: set[float] = field(default_factory=set)
    device_works: Optional[bool] = None  # whether capture ran on the device work list (replays must too)


@dataclass
class MLAStep:
    """One step's plan: its inputs, queries, key list and one planned wrapper per layer scaling; `run`
    runs a layer (see the module docstring; `backend` is the `FlashInferMLABackend` that planned it)."""

    backend: FlashInferMLABackend
    inputs: StepInputs
    qo: QueryLayout
    kv: PageList
    causal: bool
    wrappers: dict[float, object] = field(default_factory=dict)
    graph: Optional[MLAGraph] = None
    works: Optional[StepWorks] = None  # the device work list the layers run on (lean steps), else the wrappers' plans

    @property
    def path(self) -> str:
        """The kernels every layer of this step runs."""
        return "flashinfer MLA (device work list)" if self.works is not None else "flashinfer MLA"

    def run(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: AttentionLayer,
        batch: ForwardBatch,
        save_kv_cache: bool = True,
        return_lse: bool = False,
    ):
        """One layer of this step: q `[T, Hq, kv_lora_rank + rope]` (k: the new latents `[T, 1, kv_lora_rank
        + rope]`, written to the pool first when `save_kv_cache`) → `[T, Hq * kv_lora_rank]` (and the
        natural-log LSE `[T, Hq]` float32 with return_lse). Typed errors (a quantized layer; a scaling met
        first inside a CUDA-graph capture) come before the write."""
        be = self.backend
        if layer.k_scale not in (None, 1.0) or layer.v_scale not in (None, 1.0):
            raise UnsupportedFeatureError(be.name, f"k_scale/v_scale (layer {layer.layer_id}): quantized KV caches")
        w = be.wrapper_of(self, layer)
        pool = be.save_kv(k, v, layer, batch) if save_kv_cache else be.kv_pool(batch)
        ckv, kpe = be.latent_views(pool, layer.layer_id)
        q_nope, q_pe = q.split_with_sizes(be.q_split, 2)
        rows = q.shape[0]
        out = q.new_empty((rows, *be.out_heads))
        lse = torch.empty((rows, be.dims.num_heads), dtype=torch.float32, device=q.device) if return_lse else None
        mla_plans.run(w, q_nope, q_pe, ckv, kpe, out, lse, be.lean_replan, self.works)
        o = out.view(rows, be.out_cols)
        return (o, lse) if return_lse else o


class FlashInferMLABackend(AttentionBackend[MLAStep]):
    """FlashInfer's MLA kernels on CUDA, compute capability 8.0 or newer. Options: `workspace_bytes`
    sizes the float workspace (split-KV partial results); `lean_replan` (None: on for the FlashInfer
    versions `replan.py` was verified with) re-plans wrappers without FlashInfer's public `plan` after
    their first and runs them through the compiled kernel call alone (`replan.mla_run`); `device_works`
    (default on, with lean re-plans) lets steps whose requests all have the same query count run on a
    work list their page-id launch writes (`mla_works`) instead of FlashInfer's host scheduler."""

    name = "flashinfer_mla"
    capabilities = CAPABILITIES
    #: multiprocessors of the stand-in GPU the CPU wiring tests give FlashInfer's MLA scheduler (None: the
    #: device work list runs on CUDA only; on the CPU it needs this and the Triton interpreter)
    cpu_work_sms: Optional[int] = None

    def __init__(
        self,
        ctx,
        *,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        lean_replan: Optional[bool] = None,
        device_works: bool = True,
        **options,
    ):
        super().__init__(ctx, **options)  # unknown options, undeclared layouts: typed errors
        check_mla_context(ctx, self.name)
        if workspace_bytes < (1 << 20):
            raise InvalidArgumentError("workspace_bytes", ">= 1 MiB", workspace_bytes)
        self.dims = MLADims(ctx.num_q_heads, ctx.kv_lora_rank, ctx.qk_rope_head_dim, ctx.dtype)
        self.page_size = ctx.page_size
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=ctx.device)
        self.lean_replan = replan.mla_verified(flashinfer.__version__) if lean_replan is None else bool(lean_replan)
        self.scratch = DeviceScratch(self.device)
        self.known_scalings: dict[float, None] = {}  # insertion-ordered set
        self._eager_wrappers: dict[float, object] = {}
        self._planned_eager: set[float] = set()
        self._uniform_queries: dict[tuple[int, int], QueryLayout] = {}  # (bs, queries per request) -> layout
        self.host_offsets = HostOffsets()  # the steps' host page offsets, reused per batch size
        self.device_faults = DeviceFaultFlags(ctx.device)
        self._graph_buffers: Optional[MLAGraphBuffers] = None
        self.graphs: Optional[GraphCaptures[tuple[MLAStep, MLAGraph]]] = None
        self._prefill = PrefillWrappers(self.workspace)
        # per-call constants of a layer call (`MLAStep.run`): q's split, the output's trailing shape, its 2-D width
        self.q_split = (ctx.kv_lora_rank, ctx.qk_rope_head_dim)
        self.out_heads = (ctx.num_q_heads, ctx.kv_lora_rank)
        self.out_cols = ctx.num_q_heads * ctx.kv_lora_rank
        self._latents: dict[
            int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ] = {}  # layer id -> (pool buffer, ckv, kpe)
        # the device work list (`mla_works`): per cluster size its layout and FlashInfer's plan info for it
        # (confirmed; a disagreement turns the device path off, `device_works_off`); one work buffer for
        # eager steps, one for CUDA-graph replays
        self._work_layouts: dict[int, tuple[WorkLayout, object]] = {}
        self._work_buffers: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        self._work_launches: dict[
            tuple, Optional[WorkPlan]
        ] = {}  # (graph, bs, q_len, decode) -> plan; None: not served
        self.device_works_off: Optional[str] = None
        if not device_works:
            self.device_works_off = "device_works=False (FlashInfer's scheduler plans every step)"
        elif not self.lean_replan:
            self.device_works_off = "lean_replan is off (FlashInfer's public plans)"

    def poll_device_fault(self) -> Optional[str]:
        """What the index kernel refused since the last poll (an out-of-range request row, length or
        slot, or device lengths past the host-sized page-id buffer: `attn_core.ops.device_faults`), or
        None; reads and clears the fault buffer (one device sync)."""
        return self.device_faults.poll()

    # ---- per-step metadata -------------------------------------------------------------------
    def build_forward_metadata(self, forward_batch: ForwardBatch) -> MLAStep:
        """The step's key list and planned wrappers (the batch is validated by `init_forward_metadata`;
        tree masks are refused here, before any plan)."""
        refuse_tree_mask(self.name, forward_batch.forward_mode, forward_batch.spec_info)
        return self._new_step(eager_inputs(forward_batch, self.req_to_token(forward_batch)), None, self.known_scalings)

    def _new_step(self, inputs: StepInputs, graph: Optional[MLAGraph], scalings) -> MLAStep:
        """A step over `inputs` with a planned wrapper for each of `scalings`."""
        decode = inputs.q_lens_host is None
        qo = self._query_layout(inputs)
        if graph is None:
            out = self._scratch_ids
        else:
            ids = graph.buffers.kv_indices

            def out(pages: int) -> torch.Tensor:
                check_capacity("CUDA-graph page ids (seq_lens)", pages, ids.shape[0])
                return ids

        pool = self.ctx.token_to_kv_pool
        num_slots = None if pool is None else pool.num_slots
        plan = self._work_plan(inputs, qo, graph) if scalings else None
        kv = build_page_list(
            inputs.req_to_token,
            inputs.req_pool_indices,
            inputs.seq_lens,
            inputs.seq_lens_host,
            self.page_size,
            out,
            self.host_offsets.get(inputs.bs),
            num_slots,
            self.device_faults.buffer,
            None if plan is None else plan.launch,
        )
        works = None
        if plan is not None:
            works = plan.works
            if (
                works is None or works.kv_indices is not kv.indices
            ):  # the same object step after step while the ids' buffer stays
                works = plan.works = StepWorks(plan.int_ws, plan.info, kv.indices, not decode, plan.launch.layout)
        step = MLAStep(self, inputs, qo, kv, causal=not decode, graph=graph, works=works)
        for scaling in scalings:
            step.wrappers[scaling] = self._planned(step, scaling)
        return step

    def _work_plan(self, inputs: StepInputs, qo: QueryLayout, graph: Optional[MLAGraph]) -> Optional[WorkPlan]:
        """The device work list's launch for this step's shape (made once per shape) when the step runs on
        it (`mla_works`): lean re-plans, every request with the same number of queries, a step the layout
        `fits`, a layout FlashInfer's own scheduler has confirmed, and for a CUDA-graph step the path its
        capture took; else None (FlashInfer's scheduler plans the step)."""
        bs = inputs.bs
        if self.device_works_off is not None or bs == 0 or (graph is not None and graph.device_works is False):
            return None
        q_len = inputs.num_tokens // bs
        if inputs.q_lens_host is not None and self._uniform_queries.get((bs, q_len)) is not qo:
            return None
        key = (graph is not None, bs, q_len, inputs.q_lens_host is None)
        plan = self._work_launches.get(key, False)
        if plan is False:
            plan = self._work_launches[key] = self._new_work_plan(
                graph is not None, bs, q_len, causal=inputs.q_lens_host is not None
            )
        return plan

    def _new_work_plan(self, graph: bool, bs: int, q_len: int, causal: bool) -> Optional[WorkPlan]:
        heads = self.dims.num_heads
        cs = cluster_size(bs * q_len, bs, heads)
        entry = self._work_layouts.get(cs) or self._confirm_layout(cs)
        if entry is None:
            return None
        layout, info = entry
        if not fits(bs, q_len, heads, layout):
            return None
        buf, buf_bytes = self._work_buffer(graph, layout)
        pool = self.ctx.token_to_kv_pool
        launch = WorkLaunch(layout, bs, q_len, heads, self.page_size, causal, buf, pool is not None, True)
        return WorkPlan(launch, info, buf_bytes)

    def _confirm_layout(self, cs: int) -> Optional[tuple[WorkLayout, object]]:
        """The layout of cluster size `cs` and the plan info FlashInfer's own scheduler gives a wrapper of
        this backend's dims (a throwaway one, publicly planned for one request of that cluster size, one
        key in page id 0) if the two agree (kept per cluster size); else None, with `device_works_off`
        saying why (no later step asks again). Runs once per cluster size, outside graph capture (like
        every public plan)."""
        if self.device.type == "cuda":
            num_sm = torch.cuda.get_device_properties(self.device).multi_processor_count
        elif self.cpu_work_sms is not None and triton_interpreter_enabled():
            num_sm = self.cpu_work_sms
        else:
            self.device_works_off = f"the device work list runs on CUDA (device {self.device})"
            return None
        layout = work_layout(num_sm, cs, self.dims.kv_lora_rank, self.dims.dtype.itemsize)
        q_len = 1 if cs == 1 else -(-65 // self.dims.num_heads)
        one = torch.ones(1, dtype=torch.int32)
        keys = PageList(
            self.page_size,
            one,
            torch.tensor([0, 1], dtype=torch.int32),
            1,
            torch.zeros(1, dtype=torch.int32, device=self.device),
        )
        w = mla_plans.new_wrapper(self.workspace)
        mla_plans.plan(w, query_layout(one * q_len), keys, False, self.dims, 1.0, lean=False)
        reason = layout.verify(w._plan_info)
        if reason is not None:
            self.device_works_off = reason
            return None
        entry = self._work_layouts[cs] = (layout, w._plan_info)
        return entry

    def _work_buffer(self, graph: bool, layout: WorkLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """The eager or the CUDA-graph work buffer (int32) and its bytes (the int workspace FlashInfer's run takes)."""
        hit = self._work_buffers.get(graph)
        if hit is None:
            buf = torch.zeros(layout.buffer_entries, dtype=torch.int32, device=self.device)
            hit = self._work_buffers[graph] = (buf, buf.view(torch.uint8))
        return hit

    def _scratch_ids(self, pages: int) -> torch.Tensor:
        return self.scratch.get("seq", pages)

    def _query_layout(self, inputs: StepInputs) -> QueryLayout:
        """The step's queries on the host: when every request has the same number n (DECODE: 1; verify
        and draft-extend steps: their draft count) the layout built once per (batch size, n), else this
        step's own. A CUDA-graph step hands in that layout's own `lens` (`_graph_step_inputs`): no check."""
        lens, bs = inputs.q_lens_host, inputs.bs
        if lens is not None and bs:
            hit = self._uniform_queries.get((bs, inputs.num_tokens // bs))
            if hit is not None and hit.lens is lens:
                return hit
        n = 1 if lens is None else shared_query_len(bs, inputs.num_tokens, lens=lens)
        return self._uniform_layout(bs, n) if n else query_layout(lens)

    def _uniform_layout(self, bs: int, n: int) -> QueryLayout:
        """`n` queries for each of `bs` requests, built once."""
        qo = self._uniform_queries.get((bs, n))
        if qo is None:
            qo = self._uniform_queries[(bs, n)] = query_layout(torch.full((bs,), n, dtype=torch.int32))
        return qo

    def _planned(self, step: MLAStep, scaling: float):
        """The wrapper of `scaling` for this step (eager: reused across steps; graph: the captured
        batch's), planned the cheapest way FlashInfer allows."""
        g = step.graph
        pool = self._eager_wrappers if g is None else g.wrappers
        done = self._planned_eager if g is None else g.planned_once
        w = pool.get(scaling)
        if w is None:
            w = pool[scaling] = mla_plans.new_wrapper(self.workspace, None if g is None else g.buffers)
        lean = self.lean_replan and scaling in done
        if not (lean and step.works is not None):  # a device work list needs no plan after the first
            mla_plans.plan(w, step.qo, step.kv, step.causal, self.dims, scaling, lean)
        done.add(scaling)
        return w

    def wrapper_of(self, step: MLAStep, layer):
        """The wrapper `step` planned for `layer`'s scaling, planned now (and remembered for later steps)
        when the scaling is met first (a typed error inside a CUDA-graph capture)."""
        scaling = float(layer.scaling)
        w = step.wrappers.get(scaling)
        if w is None:
            refuse_while_capturing(self.device, "layer scalings", scaling)
            w = step.wrappers[scaling] = self._planned(step, scaling)
            self.known_scalings[scaling] = None
        return w

    # ---- CUDA graphs -------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.graphs = GraphCaptures(self.name, max_bs, max_num_tokens)
        dev = self.device
        pages = max_bs * pages_for(self.ctx.max_context_len, self.page_size)
        self._graph_buffers = MLAGraphBuffers(
            qo_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            kv_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            kv_indices=torch.zeros(pages, dtype=torch.int32, device=dev),
            kv_lens=torch.zeros(max_bs, dtype=torch.int32, device=dev),
        )

    def _graph_step_inputs(self, step: CudaGraphStep, num_tokens: int, seq_host: torch.Tensor) -> StepInputs:
        pool = self.ctx.req_to_token_pool
        if pool is None:
            raise InvalidArgumentError(
                "ctx.req_to_token_pool", "the request-to-token pool (CUDA graphs read the context's)", None
            )
        refuse_tree_mask(self.name, step.forward_mode, step.spec_info)
        mode, bs = step.forward_mode, step.bs
        # the same inputs as `steps.graph_inputs` gives (no encoder tokens, no mask: refused), the queries'
        # lengths being those of the (bs, num_tokens // bs) layout `_query_layout` then takes as it is
        return StepInputs(
            mode=mode,
            bs=bs,
            num_tokens=num_tokens,
            req_to_token=pool.req_to_token,
            req_pool_indices=step.req_pool_indices,
            seq_lens=step.seq_lens,
            seq_lens_host=seq_host if seq_host.dtype == torch.int32 else seq_host.to(torch.int32),
            q_lens_host=None if mode.is_decode() else self._uniform_layout(bs, num_tokens // bs).lens,
        )

    def capture_step(self, step: CudaGraphStep) -> MLAStep:
        """The plan of the CUDA-graph batch `step` over the graph buffers (before its capture); it stays
        the plan of that (mode, batch size) until `replay_step` refreshes it."""
        graphs = captures_of(self.graphs, self.name)
        graphs.check_capture(step)
        b, bs = self._graph_buffers, step.bs
        inputs = self._graph_step_inputs(
            step, step.num_tokens, step.seq_lens.cpu()
        )  # capture only: a sync is fine here
        graph = MLAGraph(MLAGraphBuffers(b.qo_indptr[: bs + 1], b.kv_indptr[: bs + 1], b.kv_indices, b.kv_lens[:bs]))
        state = self._new_step(inputs, graph, self.known_scalings)
        graph.device_works = state.works is not None
        graphs.add(step, (state, graph))
        return state

    def replay_step(self, step: CudaGraphStep) -> MLAStep:
        """The plan of a replay of the graph captured for `step`'s (mode, batch size), its buffers
        rewritten in place for this batch."""
        graphs = captures_of(self.graphs, self.name)
        old, graph = graphs.captured(step)
        inputs = self._graph_step_inputs(step, old.inputs.num_tokens, step.host_seq_lens())
        state = self._new_step(inputs, graph, list(old.wrappers))  # the scalings the graph holds kernels of
        if graph.device_works and state.works is None:  # the graph reads the work buffer this step did not write
            expected = f"a batch the device work list serves, as the one captured for bs={step.bs}"
            raise InvalidArgumentError("seq_lens", expected, None)
        graphs.update(step, (state, graph))
        return state

    def capture_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        self.bind_graph_metadata(self.capture_step(step), step)

    def replay_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        self.bind_graph_metadata(self.replay_step(step), step)

    # ---- attention ---------------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, return_lse=False):
        return self.forward_metadata.run(q, k, v, layer, forward_batch, save_kv_cache, return_lse)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, return_lse=False):
        return self.forward_metadata.run(q, k, v, layer, forward_batch, save_kv_cache, return_lse)

    def latent_views(self, pool, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's paged ckv / kpe views (`mla_plans.latent_views`), made once per layer and pool
        buffer (remade when the pool hands out another buffer for the layer)."""
        buf = pool.get_key_buffer(layer_id)
        hit = self._latents.get(layer_id)
        if hit is None or hit[0] is not buf:
            hit = self._latents[layer_id] = (buf, *mla_plans.latent_views(buf, self.page_size, self.dims.kv_lora_rank))
        return hit[1], hit[2]

    # ---- DeepSeek's prefill path -------------------------------------------------------------
    def plan_prefill(
        self,
        forward_batch: ForwardBatch,
        chunk_capacity: int,
        scaling: float,
        qk_head_dim: int = 192,
        v_head_dim: int = 128,
    ) -> PrefillPlan:
        """Plan the non-absorbed prefill of an EXTEND batch (see `mla_prefill.py`): ragged MHA over the
        new tokens (`qk_head_dim` / `v_head_dim`, `num_q_heads` heads for q, k and v) plus the cached
        prefix in chunks of at most `chunk_capacity` tokens (attn-core's `plan_prefix_chunks`)."""
        b = forward_batch
        q_lens, prefix_lens = prefill_lengths(b)
        return self._prefill.plan(
            q_lens,
            prefix_lens,
            self.req_to_token(b),
            b.req_pool_indices,
            chunk_capacity,
            num_heads=self.dims.num_heads,
            qk_head_dim=qk_head_dim,
            v_head_dim=v_head_dim,
            dtype=self.dims.dtype,
            scaling=scaling,
        )
