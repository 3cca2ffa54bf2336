"""MIXED steps split by request kind: one-token decodes through the decode wrapper, the rest through the
prefill plan (option `mixed_split`, off by default: on an H200 1.79× faster with few decodes next to long-prefix
chunks, 0.98× with 64 decodes next to one chunk; docs/dev/perf-notebook.md "MIXED steps").

Unsplit, a MIXED step plans the whole batch like an extend (ragged over the new tokens, plus paged over
the cached prefixes merged by LSE; paged over the whole sequence for window layers with a prefix), so a
decode's cached keys go through the prefill kernels. Split, the step is two sub-steps built by the
backend's ordinary code: a DECODE sub-step over the decodes (the paged decode wrapper over each
request's keys, planned like a DECODE step's: window, logit cap, scale, fp8 scales, NHD/HND) and an
extend sub-step over the other requests (the same plan choice as unsplit, made over those requests
only: ragged alone when none of them has a prefix). Two key lists (two index launches) instead of one.

Request order: any. The requests are put decode-first with attn-core's
`attn_core.batching.batch_utils.decode_first_split` (fewest swaps); each sub-step's per-request device tensors
are gathered once per step (`RowOrder.requests`, after one host→device copy of the permutation), its
host ones permuted on the host. A decode-first batch needs neither: the sub-steps take slices (views).
Per layer, the two parts write into one output `[T, Hq, D]` (and LSE) through FlashInfer's `out=` /
`lse=`: the decodes rows [0, D), the rest rows [D, T). A decode-first batch is then read and written
in place (q, k, v and the output are sliced, no copy); any other gathers q's rows (and the new k/v rows
of the extend part when it has a ragged pass) into the decode-first order and scatters the output (and
LSE) rows back, once per layer.

A decode is a request with exactly one new token; a request with none joins the extend part. Served: a
MIXED step with at least one decode and at least one other request with new tokens. Steps the split
does not serve keep the one-plan path (`served_split` returns None): no decode, or no new token outside
the decodes; encoder tokens in the batch (cross attention / encoder-decoder self attention); a
sliding-window KV pool (window-pool layers read their own key lists); chunked local attention
(`attention_chunk_size`). A cascade hint (`cascade_prefix_len`) is ignored, as unsplit (the backend
does not declare `Feature.CASCADE`). fp8 KV caches are served: the decode part runs exactly as in a
DECODE step (the cache's dtype, `k_scale` / `v_scale` at run), the extend part as unsplit. MIXED steps
are never captured in CUDA graphs (`capture_cuda_graph_metadata` refuses them), so the split is eager
only; nothing here waits for the device. The sub-steps are the planner's (`planner.StepPlanner`); per
layer, `SplitStep.plan_of(layer)` gives a `MixedPlan` of the layer's two plans, which `run` runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from attn_core.batching.batch_utils import DecodeFirstSplit, RowOrder, decode_first_split
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.layer import AttentionLayer
from attn_flashinfer.planner import Step
from attn_flashinfer.plans import LN2, Plan
from attn_flashinfer.steps import LayerKey, StepInputs


@dataclass
class SplitStep:
    """A split MIXED step: its requests in decode-first order, requests [0, num_decodes) (q rows
    [0, num_decodes)) in `decode` (a DECODE sub-step), the others in `prefill` (an extend sub-step whose
    query rows start at 0, i.e. at row num_decodes of the decode-first q). `rows`: the order on the device."""

    inputs: StepInputs  # the whole step's
    num_decodes: int
    rows: RowOrder
    decode: Step
    prefill: Step
    plans: dict[LayerKey, MixedPlan] = field(default_factory=dict)

    def plan_of(self, layer: AttentionLayer) -> MixedPlan:
        """The layer's plans in both sub-steps (typed errors for a layer the step cannot serve, before any
        plan or KV write)."""
        planner = self.decode.planner
        key = planner.layer_key(layer, None)
        plan = self.plans.get(key)
        if plan is None:
            decode, prefill = planner.plan_for(self.decode, key), planner.plan_for(self.prefill, key)
            plan = self.plans[key] = MixedPlan(self, decode, prefill)
        return plan


@dataclass
class MixedPlan:
    """One layer's plans in a split MIXED step: `decode` over the decodes, `extend` over the rest."""

    step: SplitStep
    decode: Plan
    extend: Plan

    @property
    def path(self) -> str:
        return f"{self.decode.path} + {self.extend.path} (mixed split)"

    @property
    def reads_new_kv(self) -> bool:
        """Whether `run` reads the new tokens' K/V from its k / v arguments (its extend part's ragged pass)."""
        return self.extend.reads_new_kv

    def check_new_kv(self, k: Optional[torch.Tensor], mode_name: str) -> None:
        self.extend.check_new_kv(k, mode_name)

    def run(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        return_lse: bool,
        kv_layout: str,
        scales: tuple[float, float],
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One layer: q `[T, Hq, D]` in the batch's order (the new K/V already written) → output
        `[T, Hq, D]` and, with return_lse, the natural-log LSE `[T, Hq]` float32, in the batch's order."""
        nd, rows = self.step.num_decodes, self.step.rows
        qs = rows.tokens(q)
        o = q.new_empty(q.shape)
        lse = q.new_empty(q.shape[:2], dtype=torch.float32) if return_lse else None
        common = (k_cache, v_cache, return_lse, kv_layout, scales)
        self.decode.attend(qs[:nd], None, None, *common, out=o[:nd], lse=None if lse is None else lse[:nd])
        k_new = v_new = None
        if self.extend.ragged is not None:
            k_new, v_new = rows.tokens(k, nd), rows.tokens(v, nd)
        self.extend.attend(qs[nd:], k_new, v_new, *common, out=o[nd:], lse=None if lse is None else lse[nd:])
        o = rows.scatter_tokens(o)
        if lse is not None:
            lse = rows.scatter_tokens(lse.mul_(LN2))
        return o, lse


def served_split(b: ForwardBatch, inputs: StepInputs) -> Optional[DecodeFirstSplit]:
    """The decode-first order of MIXED batch `b` when the split serves it, else None (see the module
    docstring). Host data only. Example: a MIXED batch with query lengths `[5, 1, 1]` → order
    `(2, 1, 0)`, 2 decodes; `[5, 3]` (no decode), `[1, 1]` or `[1, 0]` (no other request with new
    tokens) → None."""
    if not inputs.mode.is_mixed() or inputs.encoder_lens is not None:
        return None
    split = decode_first_split(b)
    nd = split.num_decodes
    return split if nd > 0 and sum(split.query_lens[nd:]) > 0 else None


def split_inputs(x: StepInputs, split: DecodeFirstSplit, rows: RowOrder) -> tuple[StepInputs, StepInputs]:
    """The inputs of the two sub-steps of MIXED step `x`: (decodes as a DECODE step, the other requests as
    an extend step of `x`'s mode), from the decode-first order (`rows`: the same order on the device).
    Device tensors are gathered once (views when the order is the identity), host ones permuted.

    Example: query lengths `[5, 1, 1]`, seq_lens `[9, 4, 7]` (order `(2, 1, 0)`): decode inputs bs 2,
    seq_lens `[7, 4]`, 2 tokens; extend inputs bs 1, seq_lens `[9]`, q_lens `[5]`, 5 tokens."""
    nd = split.num_decodes
    req, seq = rows.requests(x.req_pool_indices), rows.requests(x.seq_lens)
    seq_h = split.requests(x.seq_lens_host)
    q_lens, q_lens_h = rows.requests(x.q_lens), split.requests(x.q_lens_host)
    prefix = None if x.prefix_lens is None else rows.requests(x.prefix_lens)
    prefix_h = None if x.prefix_lens_host is None else split.requests(x.prefix_lens_host)
    decode = StepInputs(ForwardMode.DECODE, nd, nd, x.req_to_token, req[:nd], seq[:nd], seq_h[:nd])
    extend = StepInputs(
        mode=x.mode,
        bs=x.bs - nd,
        num_tokens=x.num_tokens - nd,
        req_to_token=x.req_to_token,
        req_pool_indices=req[nd:],
        seq_lens=seq[nd:],
        seq_lens_host=seq_h[nd:],
        q_lens_host=q_lens_h[nd:],
        q_lens=q_lens[nd:],
        prefix_lens=None if prefix is None else prefix[nd:],
        prefix_lens_host=None if prefix_h is None else prefix_h[nd:],
    )
    return decode, extend
