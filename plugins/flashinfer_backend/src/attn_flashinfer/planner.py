"""`StepPlanner`: the FlashInfer (MHA/GQA) backend's per-step plans.

A `Step` (the backend's per-step metadata) holds the step's inputs, its key lists (built on demand) and
one planned `plans.Plan` per distinct layer setting (`steps.LayerKey`); `StepPlanner.new_step` builds it
once per step (eager) or per CUDA-graph capture / replay, planning every layer setting met so far, and
`Step.plan_of(layer)` gives a layer's plan (planned then, and remembered for later steps, when the
setting is new). Which wrappers a setting gets is `_make_plan` (see the backend's docstring and
`plans.py`); how each is planned, `_planned`: FlashInfer's public `plan` the first time, the lean
re-plan (`replan.py`) after it.

Device buffers of eager steps come from attn-core's `DeviceScratch`; the key lists' device writes are
deferred until a step's plans are made (`write_device`), so the first index launch can write the
step's query offsets too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import Iterable, Optional

import torch

from attn_core.contract.bidirectional import bidirectional_span_mask
from attn_core.contract.context import BackendContext
from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.layer import AttentionLayer
from attn_core.memory.scratch import DeviceScratch
from attn_core.memory.window_pool import SlidingWindowKVPool
from attn_core.ops.step_checks import PendingStepCheck
from attn_flashinfer import plans
from attn_flashinfer.indices import (
    PagedKV,
    QueryLayout,
    any_positive,
    build_paged_kv,
    query_layout,
    self_attention_page_size,
)
from attn_flashinfer.local_kv import LocalKeys, build_local_decode_kv, build_local_extend, local_page_size
from attn_flashinfer.plans import Plan
from attn_flashinfer.steps import Dims, GraphBuffers, LayerKey, StepInputs, refuse_while_capturing
from attn_flashinfer.window_kv import build_window_kv


@dataclass
class GraphWrappers:
    """A captured (batch size, mode): its buffer slices and its graph-mode wrappers by (key, role)."""

    buffers: dict[str, GraphBuffers]  # "seq" / "cross"
    wrappers: dict[tuple[LayerKey, str], object] = field(default_factory=dict)
    planned_once: set[tuple[LayerKey, str]] = field(default_factory=set)


@dataclass
class Step:
    """One step's metadata: its inputs, key lists built on demand, and one `Plan` per `LayerKey`."""

    planner: StepPlanner
    inputs: StepInputs
    qo: QueryLayout  # each request's queries (DECODE: one each)
    has_prefix: bool
    kv: dict[str, PagedKV] = field(default_factory=dict)  # "seq" / "prefix" / "cross" / "window"
    plans: dict[LayerKey, Plan] = field(default_factory=dict)
    graph: Optional[GraphWrappers] = None
    window_pool: Optional[SlidingWindowKVPool] = None  # the step's pool, when it is a sliding-window one
    local: Optional[LocalKeys] = None  # chunked local layers' queries and keys, built on first use
    tag: str = ""  # prefix of its scratch buffers' names (a split MIXED step's decode sub-step: "decode:")
    #: bidirectional layers' visibility (`attn_core.contract.bidirectional`), built on first use
    span_mask: Optional[torch.Tensor] = None
    #: the step check the step's first index launch runs (`AttentionBackend.take_step_check`), until it ran
    step_check: Optional[PendingStepCheck] = None

    def plan_of(self, layer: AttentionLayer) -> Plan:
        """The plan `layer` runs in this step (typed errors for a layer the step cannot serve, before any
        plan or KV write)."""
        key = self.planner.layer_key(layer, self.window_pool, self.inputs.spans is not None)
        return self.planner.plan_for(self, key)


def write_device(step: Step) -> None:
    """Launch the device writes an eager step deferred until its plans were made (plans only keep
    references to the device arrays; the layers read them): one index launch per key list, the first
    also writing the query offsets, which are copied instead when the step has no key list."""
    qo = step.qo
    check, step.step_check = step.step_check, None
    for kv in step.kv.values():
        if qo.pending and qo.lens_dev is not None and kv.launch is not None:
            kv.write_device(qo.lens_dev, qo.indptr_dev, check)
            qo.pending, check = False, None
        elif kv.write_device(step_check=check):
            check = None
    qo.write_device()
    if check is not None:  # no index launch this time (no key list yet): the step check on its own
        check.run()


class StepPlanner:
    """The wrappers, scratch and plan state of one backend (`name`, for its errors): `workspace` is
    FlashInfer's float workspace every wrapper shares, `lean_replan` whether wrappers past their first
    (public) plan are re-planned lean, `fault` the device fault buffer the index launches record in."""

    def __init__(self, name: str, ctx: BackendContext, workspace: torch.Tensor, lean_replan: bool, fault: torch.Tensor):
        self.name, self.ctx, self.workspace, self.lean_replan, self.fault = name, ctx, workspace, lean_replan, fault
        self.dims = Dims(ctx.num_q_heads, ctx.num_kv_heads, ctx.head_dim, ctx.dtype, ctx.kv_dtype)
        self.page_size, self.kv_layout, self.device = ctx.page_size, ctx.kv_layout, ctx.device
        self.known_keys: dict[LayerKey, None] = {}  # insertion-ordered set
        self.scratch = DeviceScratch(ctx.device)
        self._eager_wrappers: dict[tuple[LayerKey, str], object] = {}
        self._planned_eager: set[tuple[LayerKey, str]] = set()  # eager wrappers past their first (public) plan
        self._decode_queries: dict[int, QueryLayout] = {}  # by batch size

    # ---- steps ----------------------------------------------------------------------------------------
    def new_step(
        self,
        inputs: StepInputs,
        graph: Optional[GraphWrappers],
        keys: Iterable[LayerKey],
        window_pool: Optional[SlidingWindowKVPool] = None,
        tag: str = "",
        step_check: Optional[PendingStepCheck] = None,
    ) -> Step:
        """A step over `inputs`, with a plan for each of `keys` that the batch can use; `tag` prefixes the
        names of its scratch buffers (two sub-steps of one split MIXED step must not share them);
        `step_check`: the batch's pending step check, which the step's first index launch runs."""
        has_prefix = inputs.prefix_lens_host is not None and any_positive(inputs.prefix_lens_host)
        if inputs.q_lens_host is None:
            qo = self._decode_query_layout(inputs.bs)
        elif graph is None:
            qo = query_layout(
                inputs.q_lens_host, self.scratch.get(tag + "qo", inputs.bs + 1)[: inputs.bs + 1], inputs.q_lens
            )
        else:  # graph wrappers copy the offsets into their own buffers
            qo = query_layout(inputs.q_lens_host)
        step = Step(self, inputs, qo, has_prefix, graph=graph, window_pool=window_pool, tag=tag, step_check=step_check)
        for key in keys:
            if (not key.cross or inputs.encoder_lens is not None) and (not key.window_pool or window_pool is not None):
                step.plans[key] = self._make_plan(step, key)
        write_device(step)
        return step

    def layer_key(
        self, layer: AttentionLayer, window_pool: Optional[SlidingWindowKVPool], has_spans: bool = False
    ) -> LayerKey:
        """The `LayerKey` of `layer` in a step over `window_pool` (None: none) and with bidirectional spans
        or not (a bidirectional layer without spans is a causal one), or a typed error for a layer the step
        cannot serve (before any plan or KV write)."""
        key = LayerKey.of(layer)
        if key.span and not has_spans:
            key = replace(key, span=False)
        if key.chunk and key.chunk != self.ctx.attention_chunk_size:
            raise InvalidArgumentError(
                f"layer {layer.layer_id} attention_chunk_size",
                f"the context's attention_chunk_size ({self.ctx.attention_chunk_size}), "
                "for which the step's metadata is built",
                key.chunk,
            )
        if window_pool is not None and window_pool.is_window_layer(layer.layer_id):
            if key.cross:
                raise UnsupportedFeatureError(
                    self.name, f"a cross-attention layer in a sliding-window KV pool (layer {layer.layer_id})"
                )
            key = replace(key, window_pool=True)
        return key

    def plan_for(self, step: Step, key: LayerKey) -> Plan:
        """The step's plan of `key`, made now (and remembered for later steps) when first met."""
        plan = step.plans.get(key)
        if plan is None:
            refuse_while_capturing(self.device, "layer settings", key)
            plan = step.plans[key] = self._make_plan(step, key)
            write_device(step)
            self.known_keys[key] = None
        return plan

    def _decode_query_layout(self, bs: int) -> QueryLayout:
        """One query per request (0..bs), built and copied to the device once per batch size."""
        qo = self._decode_queries.get(bs)
        if qo is None:
            out = torch.empty(bs + 1, dtype=torch.int32, device=self.device)
            qo = self._decode_queries[bs] = query_layout(torch.ones(bs, dtype=torch.int32), out)
            qo.write_device()
        return qo

    # ---- key lists ------------------------------------------------------------------------------------
    def _paged_kv(self, step: Step, which: str) -> PagedKV:
        """The step's key list `which`, built once: "seq" (every key of the request, the new ones
        included), "prefix" (cached keys of an extend), "cross" (encoder tokens) or "window" (a window
        pool's keys, `window_kv.py`)."""
        kv = step.kv.get(which)
        if kv is not None:
            return kv
        x = step.inputs
        if which == "window":
            kv = step.kv[which] = build_window_kv(
                step.window_pool,
                x.req_to_token,
                x.req_pool_indices,
                x.seq_lens,
                x.seq_lens_host,
                x.q_lens,
                x.q_lens_host,
                x.encoder_lens,
                out=partial(self._scratch_layout, step.tag + which),
                fault=self.fault,
            )
            return kv
        graph = step.graph.buffers.get(which) if step.graph is not None else None
        if which == "cross":
            if x.encoder_lens is None:
                raise InvalidArgumentError(
                    "forward_batch.encoder_lens", "encoder lengths for a cross-attention layer", None
                )
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
            x.req_to_token,
            x.req_pool_indices,
            lens,
            lens_host,
            page_size,
            kv_start=start,
            out=out,
            defer=graph is None,
            num_slots=None if pool is None else pool.num_slots,
            fault=self.fault,
        )
        step.kv[which] = kv
        return kv

    def _scratch_layout(self, which: str, bs: int, pages: int):
        """Eager device buffers of key list `which` (page ids, indptr, last-page lengths), carved from one
        scratch buffer; the page ids start 16-byte aligned. The views are kept per batch size while the
        buffer lasts (slicing a device tensor costs microseconds of host time per step)."""
        head = -(-(2 * bs + 1) // 4) * 4
        return self.scratch.carve(
            which, head + pages, bs, lambda buf: (buf[head:], buf[: bs + 1], buf[bs + 1 : 2 * bs + 1])
        )

    def _local_keys(self, step: Step) -> LocalKeys:
        """The step's chunked-local queries and keys (`local_kv.py`), built on first use, written at once."""
        if step.local is None:
            x, chunk, pool = step.inputs, self.ctx.attention_chunk_size, self.ctx.token_to_kv_pool
            ps = local_page_size(chunk, self.page_size, x.encoder_lens is not None)
            kw = dict(
                out=partial(self._scratch_layout, "local"),
                num_slots=None if pool is None else pool.num_slots,
                fault=self.fault,
            )
            if x.mode.is_decode():
                kv = build_local_decode_kv(
                    chunk, x.req_to_token, x.req_pool_indices, x.seq_lens, x.seq_lens_host, ps, x.encoder_lens, **kw
                )
                step.local = LocalKeys(None, kv)
            else:  # at most one virtual request per query row
                qo_out = self.scratch.get("local_qo", x.num_tokens + 1)
                step.local = build_local_extend(
                    chunk,
                    x.req_to_token,
                    x.req_pool_indices,
                    x.q_lens_host,
                    x.seq_lens_host,
                    ps,
                    x.encoder_lens,
                    qo_out=qo_out,
                    **kw,
                )
        return step.local

    # ---- plans ----------------------------------------------------------------------------------------
    def _make_plan(self, step: Step, key: LayerKey) -> Plan:
        x = step.inputs
        if key.chunk:  # chunked local: decode from each chunk start, else causal paged over virtual requests
            local = self._local_keys(step)
            if x.mode.is_decode():
                return Plan(
                    "decode (chunked local)", local.kv.page_size, decode=self._planned(step, key, "decode", local.kv)
                )
            paged = self._planned(step, key, "paged", local.kv, causal=True, qo=local.qo)
            return Plan("paged causal (chunked local)", local.kv.page_size, paged=paged)
        if key.window_pool:  # per-token keys inside the window: decode, else causal paged prefill
            kv = self._paged_kv(step, "window")
            if x.mode.is_decode():
                return Plan("decode (window pool)", kv.page_size, decode=self._planned(step, key, "decode", kv))
            return Plan(
                "paged causal (window pool)", kv.page_size, paged=self._planned(step, key, "paged", kv, causal=True)
            )
        if x.mode.is_decode():
            kv = self._paged_kv(step, "cross" if key.cross else "seq")
            decode = self._planned(step, key, "decode", kv)
            return Plan("decode (cross)" if key.cross else "decode", kv.page_size, decode=decode)
        if key.span:  # causal plus the step's spans: the paged pass over the whole sequence under their mask
            kv = self._paged_kv(step, "seq")
            paged = self._planned(step, key, "paged", kv, causal=False, mask=self._span_mask(step))
            return Plan("paged (bidirectional spans mask)", kv.page_size, paged=paged)
        if key.cross:
            kv = self._paged_kv(step, "cross")
            return Plan("paged (cross)", kv.page_size, paged=self._planned(step, key, "paged", kv, causal=False))
        if x.mode.is_target_verify():
            kv = self._paged_kv(step, "seq")
            causal = x.custom_mask is None and key.causal
            paged = self._planned(step, key, "paged", kv, causal=causal, mask=x.custom_mask)
            path = "paged causal" if causal else "paged (non-causal)"
            if x.custom_mask is not None:
                path = "paged (tree mask)"
            return Plan(path, kv.page_size, paged=paged)
        if step.has_prefix and key.window_left >= 0:
            kv = self._paged_kv(step, "seq")
            return Plan("paged causal (window)", kv.page_size, paged=self._planned(step, key, "paged", kv, causal=True))
        ragged = self._planned(step, key, "ragged")
        ragged_path = "ragged" if key.causal else "ragged (non-causal)"
        if not step.has_prefix:
            return Plan(ragged_path, ragged=ragged)
        kv = self._paged_kv(step, "prefix")
        paged = self._planned(step, key, "paged", kv, causal=False)
        return Plan(f"{ragged_path} + paged prefix", kv.page_size, ragged=ragged, paged=paged)

    def _span_mask(self, step: Step) -> torch.Tensor:
        """The step's bidirectional-span visibility as FlashInfer's custom mask (per request a bool
        `[q_len, seq_len]`, `attn_core.contract.bidirectional.bidirectional_span_mask`), built on the device once."""
        if step.span_mask is None:
            x = step.inputs
            total = int((x.q_lens_host.to(torch.int64) * x.seq_lens_host.to(torch.int64)).sum())
            step.span_mask = bidirectional_span_mask(x.spans, x.seq_lens, x.q_lens, total)
        return step.span_mask

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
