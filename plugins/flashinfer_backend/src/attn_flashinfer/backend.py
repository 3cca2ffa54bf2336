"""`FlashInferBackend`: attn-core's backend contract over FlashInfer's paged-KV wrappers.

Plan once per step, run thin per layer. Per step, `build_forward_metadata` (`planner.StepPlanner`)
builds the step's key lists once (`indices.PagedKV`: host indptr and
last-page lengths, and the same plus the page ids on the device from one kernel launch) and plans one set of
wrappers per distinct layer setting (`plans.LayerKey`: window, logit cap, scale, cross); every layer with
that setting runs on it. A wrapper's first plan is FlashInfer's own; later eager steps re-plan it through
`replan.py`, which skips the host work of FlashInfer's `plan` that does not change between steps.
A setting first met in `forward` is planned then and remembered, so later steps plan it up front. A
layer call takes its plan (`Step.plan_of`), writes the new K/V and runs it (`plans.Plan.run`).

Which wrappers a setting gets (see `plans.py`):
- DECODE: the decode wrapper over each request's keys (its encoder tokens for cross attention);
- TARGET_VERIFY: the paged prefill wrapper over the whole sequence under the tree mask (causal without one);
- MIXED with `mixed_split=True` and both one-token decodes and other requests: two sub-steps, the decodes
  as a DECODE step and the others as below (`mixed.py`);
- EXTEND / MIXED / DRAFT_EXTEND: without any cached prefix in the batch, the ragged wrapper (causal over
  the new tokens); with one, ragged (new tokens) + paged (prefix, no mask) merged by LSE; sliding-window
  layers with a prefix use the paged wrapper over the whole sequence (causal) instead, since FlashInfer
  places a window relative to the end of the keys it is given; cross attention: paged over the
  encoder tokens, no mask.

Sliding-window KV pool (`attn_core.memory.window_pool`): window layers in the pool's window pool get a
`LayerKey` of their own (`window_pool=True`) and read one more key list, built once per step
(`window_kv.build_window_kv`: each request's keys inside the window, as window slots, per token): DECODE
runs the decode wrapper over it, every other mode the paged prefill wrapper (causal; verify custom masks
are refused). Full layers are served as without the pool. CUDA graphs are refused with a window pool.

Chunked local layers (`ctx.attention_chunk_size` C; `LayerKey.chunk`): DECODE runs the decode wrapper
over each request's keys from its chunk start; every other mode the paged prefill wrapper (causal) over
the step's virtual requests (`local_kv.py`, after `attn_core.batching.local_attention`), built once per step.
CUDA graphs and verify custom masks are refused with chunked local layers.

CUDA graphs (DECODE and TARGET_VERIFY): `init_cuda_graph_state` allocates the index buffers; capture
builds graph-mode wrappers per (batch size, mode) over slices of them (attn-core's `GraphCaptures` keeps
them); replay rewrites the buffers and re-plans (decode: the lean re-plan, which only redoes the work
split; the index launch has rewritten the buffers).
"""

from __future__ import annotations

from typing import Optional, Union

import flashinfer
import torch

from attn_core.contract.backend import AttentionBackend
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.engine.graph_captures import GraphCaptures, captures_of
from attn_core.memory.pools import kv_scales
from attn_core.memory.window_pool import window_pool_of
from attn_core.ops.device_faults import DeviceFaultFlags
from attn_core.ops.kv_indices import pages_for
from attn_flashinfer import mixed, plans, replan
from attn_flashinfer.indices import self_attention_page_size
from attn_flashinfer.local_kv import local_page_size
from attn_flashinfer.planner import GraphWrappers, Step, StepPlanner
from attn_flashinfer.ragged import RaggedPlan, plan_ragged_op, run_ragged_op
from attn_flashinfer.spec import CAPABILITIES
from attn_flashinfer.steps import (
    GraphBuffers,
    StepInputs,
    check_context,
    check_local_step,
    check_window_pool_step,
    eager_inputs,
    graph_inputs,
)

#: FlashInfer's recommended float workspace (split-KV partial results), shared by every wrapper.
DEFAULT_WORKSPACE_BYTES = 128 << 20


class FlashInferBackend(AttentionBackend[Union[Step, mixed.SplitStep]]):
    """FlashInfer (FA2 kernels) on CUDA, compute capability 8.0 or newer. Options: `workspace_bytes`
    sizes the shared float workspace; `lean_replan` (None: on for the FlashInfer versions `replan.py`
    was verified with) re-plans eager wrappers without FlashInfer's public `plan` after their first;
    `mixed_split` (default False: docs/dev/perf-notebook.md "MIXED steps") runs a MIXED step's one-token
    decodes through the decode wrapper and its other requests through the prefill plan (`mixed.py`)."""

    name = "flashinfer"
    capabilities = CAPABILITIES
    step_check_in_index_launch = True  # the step's first index launch runs it (planner.write_device)

    def __init__(
        self,
        ctx,
        *,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        lean_replan: Optional[bool] = None,
        mixed_split: bool = False,
        **options,
    ):
        super().__init__(ctx, **options)  # unknown options: a typed error
        check_context(ctx, self.name)
        if workspace_bytes < (1 << 20):
            raise InvalidArgumentError("workspace_bytes", ">= 1 MiB", workspace_bytes)
        if not isinstance(mixed_split, bool):
            raise InvalidArgumentError("mixed_split", "a bool", mixed_split)
        self.mixed_split = mixed_split
        self.page_size = ctx.page_size
        self.kv_layout = ctx.kv_layout
        if self.kv_layout == "HND" and ctx.is_encoder_decoder and ctx.page_size > 1:
            # encoder-decoder self attention reads the pool at token granularity: an NHD-only view
            raise UnsupportedFeatureError(
                self.name, f"kv_layout HND with encoder-decoder models at page_size {ctx.page_size}"
            )
        workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=ctx.device)
        lean = replan.verified(flashinfer.__version__) if lean_replan is None else bool(lean_replan)
        self.device_faults = DeviceFaultFlags(ctx.device)
        self.planner = StepPlanner(self.name, ctx, workspace, lean, self.device_faults.buffer)
        self._graph_buffers: Optional[dict[str, GraphBuffers]] = None
        self.graphs: Optional[GraphCaptures[tuple[Step, GraphWrappers]]] = None
        self._ragged_wrappers: dict[float, object] = {}  # the ragged op's wrappers, by softmax scale

    def poll_device_fault(self) -> Optional[str]:
        """What the index kernel refused since the last poll (an out-of-range request row, length,
        slot, or device lengths past the host-sized page-id buffer: `attn_core.ops.device_faults`), or
        None; reads and clears the fault buffer (one device sync)."""
        return self.device_faults.poll()

    # ---- per-step metadata -------------------------------------------------------------------
    def build_forward_metadata(self, forward_batch: ForwardBatch) -> Union[Step, mixed.SplitStep]:
        inputs = eager_inputs(forward_batch, self.req_to_token(forward_batch))
        window_pool = window_pool_of(forward_batch.token_to_kv_pool or self.ctx.token_to_kv_pool)  # None: no pool yet
        if window_pool is not None:
            check_window_pool_step(inputs, self.kv_layout, self.page_size, self.name)
        chunk = self.ctx.attention_chunk_size
        if chunk is not None:
            key_page_size = local_page_size(chunk, self.page_size, inputs.encoder_lens is not None)
            check_local_step(inputs, self.kv_layout, self.page_size, key_page_size, self.name)
        planner, keys = self.planner, self.planner.known_keys
        split = None
        if self.mixed_split and window_pool is None and chunk is None and forward_batch.bidirectional_spans is None:
            split = mixed.served_split(forward_batch, inputs)
        if split is not None:
            rows = split.to_device(self.device)
            decode_inputs, extend_inputs = mixed.split_inputs(inputs, split, rows)
            decode = planner.new_step(decode_inputs, graph=None, keys=keys, tag="decode:")
            extend = planner.new_step(extend_inputs, graph=None, keys=keys)
            return mixed.SplitStep(inputs, split.num_decodes, rows, decode, extend)
        check = self.take_step_check()  # run by the step's first index launch
        return planner.new_step(inputs, graph=None, keys=keys, window_pool=window_pool, step_check=check)

    # ---- CUDA graphs -------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.graphs = GraphCaptures(self.name, max_bs, max_num_tokens)
        dev, ctx = self.device, self.ctx

        def index_buffers(page_size: int) -> dict:
            pages = max_bs * pages_for(ctx.max_context_len, page_size)
            return dict(
                kv_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
                kv_indices=torch.zeros(pages, dtype=torch.int32, device=dev),
                last_page_len=torch.zeros(max_bs, dtype=torch.int32, device=dev),
            )

        mask_bytes = -(-max_num_tokens * ctx.max_context_len // 8) + max_bs
        self._graph_buffers = {
            "seq": GraphBuffers(
                **index_buffers(self_attention_page_size(self.page_size, ctx.is_encoder_decoder)),
                qo_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
                custom_mask=torch.zeros(mask_bytes, dtype=torch.uint8, device=dev),
                mask_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            )
        }
        if ctx.is_encoder_decoder:
            self._graph_buffers["cross"] = GraphBuffers(
                **index_buffers(self.page_size), qo_indptr=self._graph_buffers["seq"].qo_indptr
            )

    def _graph_inputs(self, step: CudaGraphStep, num_tokens: int, seq_host: torch.Tensor) -> StepInputs:
        pool = self.ctx.req_to_token_pool
        if pool is None:
            raise InvalidArgumentError(
                "ctx.req_to_token_pool", "the request-to-token pool (CUDA graphs read the context's)", None
            )
        if step.encoder_lens is not None and not self.ctx.is_encoder_decoder:  # the graph buffers are sized per page
            raise InvalidArgumentError(
                "encoder_lens", "None in CUDA graphs unless ctx.is_encoder_decoder", "encoder lengths"
            )
        # FlashInfer plans on the host: encoder lengths must come back (encoder-decoder graphs only)
        enc_host = None if step.encoder_lens is None else step.encoder_lens.cpu()
        return graph_inputs(pool.req_to_token, step, num_tokens, seq_host, enc_host)

    def _graph_slices(self, bs: int, with_mask: bool) -> dict[str, GraphBuffers]:
        out = {}
        for name, b in self._graph_buffers.items():
            out[name] = GraphBuffers(
                kv_indptr=b.kv_indptr[: bs + 1],
                kv_indices=b.kv_indices,
                last_page_len=b.last_page_len[:bs],
                qo_indptr=b.qo_indptr[: bs + 1],
                custom_mask=b.custom_mask if with_mask and name == "seq" else None,
                mask_indptr=b.mask_indptr[: bs + 1] if with_mask and name == "seq" else None,
            )
        return out

    def capture_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        graphs = captures_of(self.graphs, self.name)
        if window_pool_of(self.ctx.token_to_kv_pool) is not None:
            raise UnsupportedFeatureError(self.name, "CUDA graphs with a sliding-window KV pool")
        if self.ctx.attention_chunk_size is not None:
            raise UnsupportedFeatureError(self.name, "CUDA graphs with chunked local attention (attention_chunk_size)")
        graphs.check_capture(step)
        seq_host = step.seq_lens.cpu()  # capture only: a sync is fine here
        inputs = self._graph_inputs(step, step.num_tokens, seq_host)
        graph = GraphWrappers(self._graph_slices(step.bs, with_mask=inputs.custom_mask is not None))
        state = self.planner.new_step(inputs, graph, keys=self.planner.known_keys)
        graphs.add(step, (state, graph))
        self.bind_graph_metadata(state, step)

    def replay_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        graphs = captures_of(self.graphs, self.name)
        old, graph = graphs.captured(step)
        inputs = self._graph_inputs(step, old.inputs.num_tokens, step.host_seq_lens())
        if (inputs.custom_mask is None) != (old.inputs.custom_mask is None):
            raise InvalidArgumentError(
                "spec_info.custom_mask",
                "a mask exactly when the graph was captured with one",
                inputs.custom_mask is not None,
            )
        state = self.planner.new_step(inputs, graph, keys=list(old.plans))  # the keys the graph holds kernels of
        graphs.update(step, (state, graph))
        self.bind_graph_metadata(state, step)

    # ---- attention: the layer's plan, the new K/V, the wrappers' run --------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **extras)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **extras)

    # ---- the ragged op (attn_core.contract.ragged; `ragged.py`) -------------------------------------------
    def build_ragged_metadata(self, ragged) -> RaggedPlan:
        return RaggedPlan(ragged)

    def forward_ragged(self, q, k, v, ragged, *, scaling, return_lse):
        """FlashInfer's ragged prefill wrapper, planned once per (batch, scaling) (`ragged.py`)."""
        plan = self.ragged_metadata
        wrapper = plan.wrappers.get(scaling)
        if wrapper is None:
            wrapper = self._ragged_wrappers.get(scaling)
            if wrapper is None:
                wrapper = self._ragged_wrappers[scaling] = plans.new_ragged_wrapper(self.planner.workspace)
            plan_ragged_op(wrapper, ragged, self.planner.dims, scaling)
            plan.wrappers[scaling] = wrapper
        return run_ragged_op(wrapper, q, k, v, return_lse)

    def describe_path(self, layer, forward_batch) -> Optional[str]:
        """The wrappers `layer` runs in this step (its plan's `path`)."""
        step = self.forward_metadata
        return None if step is None else step.plan_of(layer).path

    def save_kv(self, k, v, layer, forward_batch, *, clean_inputs=None):
        """The core's write step (`AttentionBackend.save_kv`). `clean_inputs` None: this layer's plan in the
        step decides: where its ragged pass reads the new tokens' K/V from k and v, the rows the write stores
        as K = NaN, V = 0 (a value not finite) are cleaned in k and v too, in place, so a masked key adds
        nothing there either. That covers `forward` (which writes through here) and an engine that calls
        `save_kv` itself and then `forward(..., save_kv_cache=False)` with the same k and v."""
        if clean_inputs is None:
            step = self.forward_metadata
            clean_inputs = k is not None and step is not None and step.plan_of(layer).reads_new_kv
        return super().save_kv(k, v, layer, forward_batch, clean_inputs=clean_inputs)

    def _forward(self, q, k, v, layer, batch, save_kv_cache, return_lse=False):
        scales = kv_scales(layer, self.ctx.token_to_kv_pool)  # typed error for a bad scale, before any write
        plan = self.forward_metadata.plan_of(layer)
        plan.check_new_kv(k, batch.forward_mode.name)
        # the ragged kernel reads the new tokens' K/V from k and v: a non-finite value is cleaned there too
        # (K = NaN, V = 0, as the pool stores it), so a masked key adds nothing to the tokens before it
        if save_kv_cache:
            pool = self.save_kv(k, v, layer, batch, clean_inputs=plan.reads_new_kv)
        else:
            pool = self.kv_pool(batch)
        k_cache, v_cache = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        o, lse = plan.run(q, k, v, k_cache, v_cache, return_lse, self.kv_layout, scales)
        o = o.flatten(1)  # [T, H * Dv]; flatten, not view(T, -1): T may be 0
        return (o, lse) if return_lse else o
