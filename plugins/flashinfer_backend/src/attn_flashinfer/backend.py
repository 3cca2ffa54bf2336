"""`FlashInferBackend`: attn-core's backend contract over FlashInfer's paged-KV wrappers.

Per step, `build_forward_metadata` builds the step's key lists once (`indices.PagedKV`: host indptr and
last-page lengths, and the same plus the page ids on the device from one kernel launch) and plans one set of
wrappers per distinct layer setting (`plans.LayerKey`: window, logit cap, scale, cross); every layer with
that setting runs on it. A wrapper's first plan is FlashInfer's own; later eager steps re-plan it through
`replan.py`, which skips the host work of FlashInfer's `plan` that does not change between steps.
A setting first met in `forward` is planned then and remembered, so later steps plan it up front.

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
the step's virtual requests (`local_kv.py`, after `attn_core.local_attention`), built once per step.
CUDA graphs and verify custom masks are refused with chunked local layers.

CUDA graphs (DECODE and TARGET_VERIFY): `init_cuda_graph_state` allocates the index buffers; capture
builds graph-mode wrappers per (batch size, mode) over slices of them; replay rewrites the buffers and
re-plans (decode: the lean re-plan, which only redoes the work split; the index launch has rewritten
the buffers).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import Optional, Union

import flashinfer
import torch

from attn_core.backend import AttentionBackend
from attn_core.batch import ForwardBatch
from attn_core.bidirectional import bidirectional_span_mask
from attn_core.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.forward_mode import ForwardMode
from attn_core.graph_step import CudaGraphStep
from attn_core.memory.pools import kv_scales
from attn_core.memory.window_pool import SlidingWindowKVPool, window_pool_of
from attn_core.ops.device_faults import DeviceFaultFlags
from attn_flashinfer import mixed, plans, replan
from attn_flashinfer.indices import PagedKV, QueryLayout, any_positive, build_paged_kv, query_layout, self_attention_page_size
from attn_flashinfer.local_kv import LocalKeys, build_local_decode_kv, build_local_extend, local_page_size
from attn_flashinfer.plans import Plan
from attn_flashinfer.ragged import RaggedPlan, plan_ragged_op, run_ragged_op
from attn_flashinfer.scratch import DeviceScratch
from attn_flashinfer.spec import CAPABILITIES
from attn_flashinfer.steps import (
    Dims,
    GraphBuffers,
    LayerKey,
    StepInputs,
    check_context,
    check_local_step,
    check_window_pool_step,
    eager_inputs,
    graph_inputs,
)
from attn_flashinfer.window_kv import build_window_kv

#: FlashInfer's recommended float workspace (split-KV partial results), shared by every wrapper.
DEFAULT_WORKSPACE_BYTES = 128 << 20


@dataclass
class Step:
    """One step's metadata: its inputs, key lists built on demand, and one `Plan` per `LayerKey`."""

    inputs: StepInputs
    qo: QueryLayout  # each request's queries (DECODE: one each)
    has_prefix: bool
    kv: dict[str, PagedKV] = field(default_factory=dict)  # "seq" / "prefix" / "cross" / "window"
    plans: dict[LayerKey, Plan] = field(default_factory=dict)
    graph: Optional[_GraphState] = None
    window_pool: Optional[SlidingWindowKVPool] = None  # the step's pool, when it is a sliding-window one
    local: Optional[LocalKeys] = None  # chunked local layers' queries and keys, built on first use
    tag: str = ""  # prefix of its scratch buffers' names (a split MIXED step's decode sub-step: "decode:")
    #: bidirectional layers' visibility (`attn_core.bidirectional`), built on first use
    span_mask: Optional[torch.Tensor] = None


@dataclass
class _GraphState:
    """A captured (batch size, mode): its buffer slices and its graph-mode wrappers by (key, role)."""

    buffers: dict[str, GraphBuffers]  # "seq" / "cross"
    wrappers: dict[tuple[LayerKey, str], object] = field(default_factory=dict)
    planned_once: set[tuple[LayerKey, str]] = field(default_factory=set)


def _write_device(step: Step) -> None:
    """Launch the device writes an eager step deferred until its plans were made (plans only keep
    references to the device arrays; the layers read them): one index launch per key list, the first
    also writing the query offsets, which are copied instead when the step has no key list."""
    qo = step.qo
    for kv in step.kv.values():
        if qo.pending and qo.lens_dev is not None and kv.launch is not None:
            kv.write_device(qo.lens_dev, qo.indptr_dev)
            qo.pending = False
        else:
            kv.write_device()
    qo.write_device()


class FlashInferBackend(AttentionBackend[Union[Step, mixed.SplitStep]]):
    """FlashInfer (FA2 kernels) on CUDA, compute capability 8.0 or newer. Options: `workspace_bytes`
    sizes the shared float workspace; `lean_replan` (None: on for the FlashInfer versions `replan.py`
    was verified with) re-plans eager wrappers without FlashInfer's public `plan` after their first;
    `mixed_split` (default False: docs/dev/perf-notebook.md "MIXED steps") runs a MIXED step's one-token decodes through
    the decode wrapper and its other requests through the prefill plan (`mixed.py`)."""

    name = "flashinfer"
    capabilities = CAPABILITIES

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
        self.dims = Dims(ctx.num_q_heads, ctx.num_kv_heads, ctx.head_dim, ctx.dtype, ctx.kv_dtype)
        self.page_size = ctx.page_size
        self.kv_layout = ctx.kv_layout
        if self.kv_layout == "HND" and ctx.is_encoder_decoder and ctx.page_size > 1:
            # encoder-decoder self attention reads the pool at token granularity: an NHD-only view
            raise UnsupportedFeatureError(self.name, f"kv_layout HND with encoder-decoder models at page_size {ctx.page_size}")
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=ctx.device)
        self.lean_replan = replan.verified(flashinfer.__version__) if lean_replan is None else bool(lean_replan)
        self.known_keys: dict[LayerKey, None] = {}  # insertion-ordered set
        self._eager_wrappers: dict[tuple[LayerKey, str], object] = {}
        self._planned_eager: set[tuple[LayerKey, str]] = set()  # eager wrappers past their first (public) plan
        self._decode_queries: dict[int, QueryLayout] = {}  # by batch size
        self.scratch = DeviceScratch(self.device)
        self._scratch_views: dict[tuple[str, int], tuple] = {}  # (which, bs) -> (buffer, its three views)
        self._graph_buffers: Optional[dict[str, GraphBuffers]] = None
        self._graphs: dict[tuple[int, ForwardMode], tuple[Step, _GraphState]] = {}
        self.device_faults = DeviceFaultFlags(ctx.device)
        self._ragged_wrappers: dict[float, object] = {}  # the ragged op's wrappers, by softmax scale

    def poll_device_fault(self) -> Optional[str]:
        """What the index kernel refused since the last poll (an out-of-range request row, length,
        slot, or device lengths past the host-sized page-id buffer: `attn_core.ops.device_faults`), or
        None; reads and clears the fault buffer (one device sync)."""
        return self.device_faults.poll()

    # ---- per-step metadata -------------------------------------------------------------------
    def build_forward_metadata(self, forward_batch: ForwardBatch) -> Step:
        inputs = eager_inputs(forward_batch, self.req_to_token(forward_batch))
        window_pool = window_pool_of(forward_batch.token_to_kv_pool or self.ctx.token_to_kv_pool)  # None: no pool yet
        if window_pool is not None:
            check_window_pool_step(inputs, self.kv_layout, self.page_size, self.name)
        chunk = self.ctx.attention_chunk_size
        if chunk is not None:
            key_page_size = local_page_size(chunk, self.page_size, inputs.encoder_lens is not None)
            check_local_step(inputs, self.kv_layout, self.page_size, key_page_size, self.name)
        split = None
        if self.mixed_split and window_pool is None and chunk is None and forward_batch.bidirectional_spans is None:
            split = mixed.served_split(forward_batch, inputs)
        if split is not None:
            rows = split.to_device(self.device)
            decode_inputs, extend_inputs = mixed.split_inputs(inputs, split, rows)
            decode = self._new_step(decode_inputs, graph=None, keys=self.known_keys, tag="decode:")
            extend = self._new_step(extend_inputs, graph=None, keys=self.known_keys)
            return mixed.SplitStep(inputs, split.num_decodes, rows, decode, extend)
        return self._new_step(inputs, graph=None, keys=self.known_keys, window_pool=window_pool)

    def _new_step(
        self,
        inputs: StepInputs,
        graph: Optional[_GraphState],
        keys,
        window_pool: Optional[SlidingWindowKVPool] = None,
        tag: str = "",
    ) -> Step:
        """A step over `inputs`, with a plan for each of `keys` that the batch can use; `tag` prefixes the
        names of its scratch buffers (two sub-steps of one split MIXED step must not share them)."""
        has_prefix = inputs.prefix_lens_host is not None and any_positive(inputs.prefix_lens_host)
        if inputs.q_lens_host is None:
            qo = self._decode_query_layout(inputs.bs)
        elif graph is None:
            qo = query_layout(inputs.q_lens_host, self.scratch.get(tag + "qo", inputs.bs + 1)[: inputs.bs + 1], inputs.q_lens)
        else:  # graph wrappers copy the offsets into their own buffers
            qo = query_layout(inputs.q_lens_host)
        step = Step(inputs, qo, has_prefix, graph=graph, window_pool=window_pool, tag=tag)
        for key in keys:
            if (not key.cross or inputs.encoder_lens is not None) and (not key.window_pool or window_pool is not None):
                step.plans[key] = self._make_plan(step, key)
        _write_device(step)
        return step

    def _decode_query_layout(self, bs: int) -> QueryLayout:
        """One query per request (0..bs), built and copied to the device once per batch size."""
        qo = self._decode_queries.get(bs)
        if qo is None:
            out = torch.empty(bs + 1, dtype=torch.int32, device=self.device)
            qo = self._decode_queries[bs] = query_layout(torch.ones(bs, dtype=torch.int32), out)
            qo.write_device()
        return qo

    def _paged_kv(self, step: Step, which: str) -> PagedKV:
        """The step's key list `which`, built once: "seq" (every key of the request, the new ones
        included), "prefix" (cached keys of an extend) or "cross" (encoder tokens)."""
        kv = step.kv.get(which)
        if kv is not None:
            return kv
        x = step.inputs
        if which == "window":
            kv = step.kv[which] = build_window_kv(
                step.window_pool, x.req_to_token, x.req_pool_indices, x.seq_lens, x.seq_lens_host, x.q_lens, x.q_lens_host,
                x.encoder_lens, out=partial(self._scratch_layout, step.tag + which), fault=self.device_faults.buffer,
            )  # fmt: skip
            return kv
        graph = step.graph.buffers.get(which) if step.graph is not None else None
        if which == "cross":
            if x.encoder_lens is None:
                raise InvalidArgumentError("forward_batch.encoder_lens", "encoder lengths for a cross-attention layer", None)
            lens, lens_host, page_size, start = x.encoder_lens, x.encoder_lens_host, self.page_size, None
        else:  # the batch's encoder tokens (if any) come first in each row: then per-token keys
            page_size, start = self_attention_page_size(self.page_size, x.encoder_lens is not None), x.encoder_lens
            lens, lens_host = (x.seq_lens, x.seq_lens_host) if which == "seq" else (x.prefix_lens, x.prefix_lens_host)
        if graph is None:
            out = partial(self._scratch_layout, step.tag + which)
        else:

            def out(bs: int, pages: int):  # the captured graph's own buffers, which its wrappers read
                return graph.kv_indices, graph.kv_indptr, graph.last_page_len

        pool = self.ctx.token_to_kv_pool
        kv = build_paged_kv(
            x.req_to_token, x.req_pool_indices, lens, lens_host, page_size, kv_start=start, out=out, defer=graph is None,
            num_slots=None if pool is None else pool.num_slots, fault=self.device_faults.buffer,
        )  # fmt: skip
        step.kv[which] = kv
        return kv

    def _scratch_layout(self, which: str, bs: int, pages: int):
        """Eager device buffers of key list `which` (page ids, indptr, last-page lengths), carved from
        one `DeviceScratch` buffer; the page ids start 16-byte aligned. The views are kept per batch size while
        the buffer lasts (slicing a device tensor costs microseconds of host time per step)."""
        head = -(-(2 * bs + 1) // 4) * 4
        buf = self.scratch.get(which, head + pages)
        views = self._scratch_views.get((which, bs))
        if views is None or views[0] is not buf:
            views = self._scratch_views[(which, bs)] = (buf, buf[head:], buf[: bs + 1], buf[bs + 1 : 2 * bs + 1])
        return views[1:]

    def _wrapper(self, step: Step, key: LayerKey, role: str):
        """The wrapper of (key, role): eager ones are reused across steps, graph-mode ones belong to
        their captured (batch size, mode)."""
        g = step.graph
        pool = self._eager_wrappers if g is None else g.wrappers
        w = pool.get((key, role))
        if w is None:
            buffers = None if g is None else g.buffers["cross" if key.cross else "seq"]
            if role == "decode":
                w = plans.new_decode_wrapper(self.workspace, buffers, self.kv_layout)
            elif role == "ragged":
                w = plans.new_ragged_wrapper(self.workspace)
            else:
                w = plans.new_paged_wrapper(self.workspace, buffers, self.kv_layout)
            pool[(key, role)] = w
        return w

    def _make_plan(self, step: Step, key: LayerKey) -> Plan:
        x = step.inputs
        if key.chunk:  # chunked local: decode from each chunk start, else causal paged over virtual requests
            local = self._local_keys(step)
            if x.mode.is_decode():
                return Plan(page_size=local.kv.page_size, decode=self._planned(step, key, "decode", local.kv))
            return Plan(page_size=local.kv.page_size, paged=self._planned(step, key, "paged", local.kv, causal=True, qo=local.qo))
        if key.window_pool:  # per-token keys inside the window: decode, else causal paged prefill
            kv = self._paged_kv(step, "window")
            if x.mode.is_decode():
                return Plan(page_size=kv.page_size, decode=self._planned(step, key, "decode", kv))
            return Plan(page_size=kv.page_size, paged=self._planned(step, key, "paged", kv, causal=True))
        if x.mode.is_decode():
            kv = self._paged_kv(step, "cross" if key.cross else "seq")
            return Plan(page_size=kv.page_size, decode=self._planned(step, key, "decode", kv))
        if key.span:  # causal plus the step's spans: the paged pass over the whole sequence under their mask
            kv = self._paged_kv(step, "seq")
            paged = self._planned(step, key, "paged", kv, causal=False, mask=self._span_mask(step))
            return Plan(page_size=kv.page_size, paged=paged)
        if key.cross:
            kv = self._paged_kv(step, "cross")
            return Plan(page_size=kv.page_size, paged=self._planned(step, key, "paged", kv, causal=False))
        if x.mode.is_target_verify():
            kv = self._paged_kv(step, "seq")
            causal = x.custom_mask is None and key.causal
            paged = self._planned(step, key, "paged", kv, causal=causal, mask=x.custom_mask)
            return Plan(page_size=kv.page_size, paged=paged)
        if step.has_prefix and key.window_left >= 0:
            kv = self._paged_kv(step, "seq")
            return Plan(page_size=kv.page_size, paged=self._planned(step, key, "paged", kv, causal=True))
        ragged = self._planned(step, key, "ragged")
        if not step.has_prefix:
            return Plan(ragged=ragged)
        kv = self._paged_kv(step, "prefix")
        return Plan(page_size=kv.page_size, ragged=ragged, paged=self._planned(step, key, "paged", kv, causal=False))

    def _planned(
        self,
        step: Step,
        key: LayerKey,
        role: str,
        kv: Optional[PagedKV] = None,
        causal: bool = True,
        mask=None,
        qo: Optional[QueryLayout] = None,
    ):
        """The wrapper of (key, role), planned for this step the cheapest way FlashInfer allows: lean
        (`replan.py`) once it has had a public plan, unless masked or a CUDA-graph prefill wrapper.
        `qo`: the queries' layout when not the step's (chunked local virtual requests)."""
        w = self._wrapper(step, key, role)
        qo = step.qo if qo is None else qo
        g = step.graph
        done = self._planned_eager if g is None else g.planned_once
        lean = self.lean_replan and mask is None and (g is None or role == "decode") and (key, role) in done
        if role == "decode":
            plans.plan_decode(w, qo, kv, key, self.dims, lean)
        elif role == "ragged":
            plans.plan_ragged(w, qo, key, self.dims, lean)
        else:
            plans.plan_paged(w, qo, kv, key, self.dims, causal, lean, custom_mask=mask)
        done.add((key, role))
        return w

    def _span_mask(self, step: Step) -> torch.Tensor:
        """The step's bidirectional-span visibility as FlashInfer's custom mask (per request a bool
        `[q_len, seq_len]`, `attn_core.bidirectional.bidirectional_span_mask`), built on the device once."""
        if step.span_mask is None:
            x = step.inputs
            total = int((x.q_lens_host.to(torch.int64) * x.seq_lens_host.to(torch.int64)).sum())
            step.span_mask = bidirectional_span_mask(x.spans, x.seq_lens, x.q_lens, total)
        return step.span_mask

    def _local_keys(self, step: Step) -> LocalKeys:
        """The step's chunked-local queries and keys (`local_kv.py`), built on first use, written at once."""
        if step.local is None:
            x, chunk, pool = step.inputs, self.ctx.attention_chunk_size, self.ctx.token_to_kv_pool
            ps = local_page_size(chunk, self.page_size, x.encoder_lens is not None)
            kw = dict(
                out=partial(self._scratch_layout, "local"),
                num_slots=None if pool is None else pool.num_slots,
                fault=self.device_faults.buffer,
            )
            if x.mode.is_decode():
                kv = build_local_decode_kv(chunk, x.req_to_token, x.req_pool_indices, x.seq_lens, x.seq_lens_host, ps, x.encoder_lens, **kw)
                step.local = LocalKeys(None, kv)
            else:  # at most one virtual request per query row
                qo_out = self.scratch.get("local_qo", x.num_tokens + 1)
                step.local = build_local_extend(
                    chunk, x.req_to_token, x.req_pool_indices, x.q_lens_host, x.seq_lens_host, ps, x.encoder_lens, qo_out=qo_out, **kw
                )
        return step.local

    def _layer_key(self, layer, window_pool: Optional[SlidingWindowKVPool], has_spans: bool = False) -> LayerKey:
        """The `LayerKey` of `layer` in a step over `window_pool` (None: none) and with bidirectional spans
        or not (a bidirectional layer without spans is a causal one), or a typed error for a layer the step
        cannot serve (before any plan or KV write)."""
        key = LayerKey.of(layer)
        if key.span and not has_spans:
            key = replace(key, span=False)
        if key.chunk and key.chunk != self.ctx.attention_chunk_size:
            raise InvalidArgumentError(
                f"layer {layer.layer_id} attention_chunk_size",
                f"the context's attention_chunk_size ({self.ctx.attention_chunk_size}), for which the step's metadata is built",
                key.chunk,
            )
        if window_pool is not None and window_pool.is_window_layer(layer.layer_id):
            if key.cross:
                raise UnsupportedFeatureError(self.name, f"a cross-attention layer in a sliding-window KV pool (layer {layer.layer_id})")
            key = replace(key, window_pool=True)
        return key

    def _plan_for(self, step: Step, key: LayerKey) -> Plan:
        """The step's plan of `key`, made now (and remembered for later steps) when first met."""
        plan = step.plans.get(key)
        if plan is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise InvalidArgumentError(
                    "layer", "layer settings met before CUDA-graph capture (run the captured batch once eagerly first)", key
                )
            plan = step.plans[key] = self._make_plan(step, key)
            _write_device(step)
            self.known_keys[key] = None
        return plan

    # ---- CUDA graphs -------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if max_bs < 1 or max_num_tokens < max_bs:
            raise InvalidArgumentError("max_bs/max_num_tokens", "max_num_tokens >= max_bs >= 1", (max_bs, max_num_tokens))
        dev, ctx = self.device, self.ctx

        def index_buffers(page_size: int) -> dict:
            pages = max_bs * -(-ctx.max_context_len // page_size)
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
            self._graph_buffers["cross"] = GraphBuffers(**index_buffers(self.page_size), qo_indptr=self._graph_buffers["seq"].qo_indptr)
        self._graphs = {}

    def _graph_inputs(self, step: CudaGraphStep, num_tokens: int, seq_host: torch.Tensor) -> StepInputs:
        pool = self.ctx.req_to_token_pool
        if pool is None:
            raise InvalidArgumentError("ctx.req_to_token_pool", "the request-to-token pool (CUDA graphs read the context's)", None)
        if step.encoder_lens is not None and not self.ctx.is_encoder_decoder:  # the graph buffers are sized per page
            raise InvalidArgumentError("encoder_lens", "None in CUDA graphs unless ctx.is_encoder_decoder", "encoder lengths")
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
        if self._graph_buffers is None:
            raise InvalidArgumentError("init_cuda_graph_state", "called before capture", None)
        if window_pool_of(self.ctx.token_to_kv_pool) is not None:
            raise UnsupportedFeatureError(self.name, "CUDA graphs with a sliding-window KV pool")
        if self.ctx.attention_chunk_size is not None:
            raise UnsupportedFeatureError(self.name, "CUDA graphs with chunked local attention (attention_chunk_size)")
        mode, bs = step.forward_mode, step.bs
        if not (mode.is_decode() or mode.is_target_verify()):
            raise UnsupportedFeatureError(self.name, f"CUDA graphs for {mode.name}")
        if bs + 1 > self._graph_buffers["seq"].kv_indptr.shape[0]:
            raise InvalidArgumentError("bs", "<= max_bs of init_cuda_graph_state", bs)
        seq_host = step.seq_lens.cpu()  # capture only: a sync is fine here
        inputs = self._graph_inputs(step, step.num_tokens, seq_host)
        graph = _GraphState(self._graph_slices(bs, with_mask=inputs.custom_mask is not None))
        state = self._new_step(inputs, graph, keys=self.known_keys)
        self._graphs[(bs, mode)] = (state, graph)
        self.bind_graph_metadata(state, step)

    def replay_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        mode, bs = step.forward_mode, step.bs
        captured = self._graphs.get((bs, mode))
        if captured is None:
            raise InvalidArgumentError("bs", f"a batch size captured for {mode.name}", bs)
        old, graph = captured
        if step.num_tokens not in (None, old.inputs.num_tokens):
            raise InvalidArgumentError("num_tokens", f"{old.inputs.num_tokens} as captured for bs={bs}", step.num_tokens)
        inputs = self._graph_inputs(step, old.inputs.num_tokens, step.host_seq_lens())
        if (inputs.custom_mask is None) != (old.inputs.custom_mask is None):
            raise InvalidArgumentError(
                "spec_info.custom_mask", "a mask exactly when the graph was captured with one", inputs.custom_mask is not None
            )
        state = self._new_step(inputs, graph, keys=list(old.plans))  # the keys the graph holds kernels of
        self._graphs[(bs, mode)] = (state, graph)
        self.bind_graph_metadata(state, step)

    # ---- attention ---------------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **extras)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **extras)

    # ---- the ragged op (attn_core.ragged; `ragged.py`) -------------------------------------------
    def build_ragged_metadata(self, ragged) -> RaggedPlan:
        return RaggedPlan(ragged)

    def forward_ragged(self, q, k, v, ragged, *, scaling, return_lse):
        """FlashInfer's ragged prefill wrapper, planned once per (batch, scaling) (`ragged.py`)."""
        plan = self.ragged_metadata
        wrapper = plan.wrappers.get(scaling)
        if wrapper is None:
            wrapper = self._ragged_wrappers.get(scaling)
            if wrapper is None:
                wrapper = self._ragged_wrappers[scaling] = plans.new_ragged_wrapper(self.workspace)
            plan_ragged_op(wrapper, ragged, self.dims, scaling)
            plan.wrappers[scaling] = wrapper
        return run_ragged_op(wrapper, q, k, v, return_lse)

    @staticmethod
    def _check_new_kv(plan: Plan, k, batch) -> None:
        if plan.ragged is not None and k is None:
            raise InvalidArgumentError(
                "k", f"the new tokens' keys and values for {batch.forward_mode.name} (the ragged pass reads them)", None
            )

    def _forward(self, q, k, v, layer, batch, save_kv_cache, return_lse=False):
        scales = kv_scales(layer, self.ctx.token_to_kv_pool)  # typed error for a bad scale, before any write
        step = self.forward_metadata
        if isinstance(step, mixed.SplitStep):
            o, lse = mixed.forward(self, step, q, k, v, layer, batch, save_kv_cache, return_lse, scales)
        else:
            plan = self._plan_for(step, self._layer_key(layer, step.window_pool, step.inputs.spans is not None))
            self._check_new_kv(plan, k, batch)
            pool = self.save_kv(k, v, layer, batch) if save_kv_cache else self.kv_pool(batch)
            k_cache, v_cache = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
            o, lse = plans.run(plan, q, k, v, k_cache, v_cache, return_lse, self.kv_layout, scales)
        o = o.flatten(1)  # [T, H * Dv]; flatten, not view(T, -1): T may be 0
        return (o, lse) if return_lse else o
