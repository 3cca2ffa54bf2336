"""`StepPlanner`: builds the Triton backend's `plans.StepPlan` of every step, once per step (eager) or once
per captured CUDA graph (`graph.py` builds its plans over the graph's persistent buffers with the same
`decode_step` / `extend_step`).

Per step it fills the key indices on the device (one `kv_indices_triton` launch per key set, sized from
host data), picks the decode splits (by batch size, graph-safe), and decides every path of the step
(`plans.py`). The common DECODE step (no encoder tokens, no chunked local layers, no window pool, no
cascade) hands out the same plan object per batch size while its index and split scratch views are
current: only the index contents change.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn_core.contract.batch import ForwardBatch
from attn_core.contract.context import BackendContext
from attn_core.contract.errors import UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.memory.scratch import DeviceScratch
from attn_core.memory.window_pool import SlidingWindowKVPool, window_pool_of
from attn_core.ops.step_checks import PendingStepCheck
from attn_triton.config import SplitPolicy
from attn_triton.kernels.mla_decode import MAX_FOLDED_Q_LEN
from attn_triton.kernels.verify import verify_q_len
from attn_triton.launchers import Launch
from attn_triton.metadata import (
    CascadeKeys,
    KVIndex,
    LocalExtend,
    Splits,
    cascade_keys,
    cross_kv,
    fill_kv,
    local_decode_kv,
    local_extend,
    main_kv,
    split_views,
    window_kv,
)
from attn_triton.plans import CascadePath, DecodeKeys, DecodePath, ExtendPath, MLAPath, StepPlan


class StepPlanner:
    """The plans of one backend: `ctx`, its `launch` settings, the decode split policy and what sizes its
    grids (`programs_per_request`: KV-head blocks or MLA head blocks per request, `num_sms`,
    `ctas_per_sm` for the MLA kernel's wave-aware splits), and whether absorbed MLA runs the MLA kernel
    (`mla_kernel`: a pool of the q dtype)."""

    def __init__(
        self,
        ctx: BackendContext,
        launch: Launch,
        split_policy: SplitPolicy,
        programs_per_request: int,
        num_sms: int,
        ctas_per_sm: int,
        mla_kernel: bool,
    ):
        self.ctx, self.launch, self.split_policy = ctx, launch, split_policy
        self.programs_per_request, self.num_sms, self.ctas_per_sm = programs_per_request, num_sms, ctas_per_sm
        self.mla_kernel = mla_kernel
        self.scratch = DeviceScratch(ctx.device)
        self._splits: dict[int, Splits] = {}
        self._plain_decode: dict[int, StepPlan] = {}  # bs -> the last plain DECODE step's plan

    # ---- decode splits ------------------------------------------------------------------------------
    def decode_splits(self, bs: int) -> Splits:
        """Split parameters of a DECODE batch of `bs` requests (graph-safe: depends on bs only)."""
        splits = self._splits.get(bs)
        if splits is None:
            det, p = self.ctx.deterministic, self.split_policy
            ms = p.max_splits(
                bs, self.ctx.num_kv_heads * self.programs_per_request, self.num_sms, det, self.ctas_per_sm
            )
            splits = self._splits[bs] = Splits(ms, p.min_len(det))
        return splits

    def decode_keys(self, bs: int, scratch: Optional[DeviceScratch] = None) -> DecodeKeys:
        """The splits of `bs` decodes and their scratch views (in `scratch`, default the eager one)."""
        splits = self.decode_splits(bs)
        part_o, part_lse = split_views(
            scratch or self.scratch, bs, splits.max_splits, self.ctx.num_q_heads, self.ctx.v_head_dim
        )
        return DecodeKeys(splits, part_o, part_lse)

    # ---- eager steps ----------------------------------------------------------------------------------
    def plan(
        self, b: ForwardBatch, r2t: torch.Tensor, pool_of_batch, step_check: Optional[PendingStepCheck] = None
    ) -> StepPlan:
        """The plan of batch `b` (validated) over request table `r2t`; `pool_of_batch`: its KV pool;
        `step_check`: the step's pending step check (`AttentionBackend.take_step_check`), run by the main index
        launch."""
        if b.forward_mode.is_decode():
            return self._decode_plan(b, r2t, window_pool_of(pool_of_batch), step_check)
        return self._extend_plan(b, r2t, window_pool_of(pool_of_batch), step_check)

    def _decode_plan(
        self,
        b: ForwardBatch,
        r2t: torch.Tensor,
        pool: Optional[SlidingWindowKVPool],
        step_check: Optional[PendingStepCheck] = None,
    ) -> StepPlan:
        bs, fault = b.batch_size, self.launch.fault
        kv = main_kv(self.scratch, bs, b.seq_lens_sum)
        fill_kv(
            kv,
            r2t,
            b.req_pool_indices,
            b.seq_lens,
            fault,
            kv_start=b.encoder_lens,
            capacity=b.seq_lens_sum,
            step_check=step_check,
        )
        split = self.decode_keys(bs)
        chunk = self.ctx.attention_chunk_size
        if b.encoder_lens is None and chunk is None and not b.cascade_prefix_len and pool is None:
            # the common step: everything but the index contents depends on bs alone, so the last plan
            # of this size is handed out again while its scratch views are current
            plan = self._plain_decode.get(bs)
            if plan is None or plan.kv is not kv or plan.plain.split.part_o is not split.part_o:
                plan = self._plain_decode[bs] = self.decode_step(kv, None, split)
            return plan
        cross = cross_kv(b, r2t, fault) if b.encoder_lens is not None else None
        local = local_decode_kv(chunk, b, r2t, fault) if chunk is not None else None
        window = window_kv(b, r2t, pool, fault) if pool is not None else None
        cascade = cascade_keys(b, r2t, fault) if b.cascade_prefix_len else None
        return self.decode_step(kv, cross, split, local_kv=local, window_kv=window, window_pool=pool, cascade=cascade)

    def _extend_plan(
        self,
        b: ForwardBatch,
        r2t: torch.Tensor,
        pool: Optional[SlidingWindowKVPool],
        step_check: Optional[PendingStepCheck] = None,
    ) -> StepPlan:
        bs, dev, fault = b.batch_size, self.ctx.device, self.launch.fault
        mask = custom_mask(b)
        qo_indptr = torch.empty(bs + 1, dtype=torch.int32, device=dev)
        mask_indptr = torch.empty(bs + 1, dtype=torch.int64, device=dev) if mask is not None else None
        kv = main_kv(self.scratch, bs, b.seq_lens_sum)
        fill_kv(
            kv,
            r2t,
            b.req_pool_indices,
            b.seq_lens,
            fault,
            kv_start=b.encoder_lens,
            q_lens=b.extend_seq_lens,
            qo_indptr=qo_indptr,
            mask_indptr=mask_indptr,
            capacity=b.seq_lens_sum,
            step_check=step_check,
        )
        cross = cross_kv(b, r2t, fault) if b.encoder_lens is not None else None
        max_q = int(b.extend_seq_lens_cpu.max()) if bs else 0
        local = None
        if self.ctx.attention_chunk_size is not None:
            if mask is not None:
                raise UnsupportedFeatureError(
                    "triton", "chunked local attention together with a custom mask (TARGET_VERIFY)"
                )
            local = local_extend(self.ctx.attention_chunk_size, b, r2t, fault)
        window = None
        if pool is not None:
            if mask is not None:
                raise UnsupportedFeatureError(
                    "triton", "a sliding-window KV pool together with a custom mask (TARGET_VERIFY)"
                )
            window = window_kv(b, r2t, pool, fault)
        cascade = cascade_keys(b, r2t, fault) if b.cascade_prefix_len else None
        return self.extend_step(
            b.forward_mode,
            bs,
            b.num_tokens,
            qo_indptr,
            max_q,
            kv,
            cross,
            mask,
            mask_indptr,
            local=local,
            window_kv=window,
            window_pool=pool,
            cascade=cascade,
            spans=b.bidirectional_spans,
        )

    # ---- plans from key indices (eager steps and CUDA-graph captures) --------------------------------
    def decode_step(
        self,
        kv: KVIndex,
        cross: Optional[KVIndex],
        split: DecodeKeys,
        *,
        local_kv: Optional[KVIndex] = None,
        window_kv: Optional[KVIndex] = None,
        window_pool: Optional[SlidingWindowKVPool] = None,
        cascade: Optional[CascadeKeys] = None,
    ) -> StepPlan:
        """A DECODE step's plan over its key sets: the MLA kernel or the decode kernel per key set, the
        decode kernel under a cascade's suffix."""
        ln = self.launch

        def over(keys: KVIndex):
            return MLAPath(ln, keys, 1, split=split) if self.mla_kernel else DecodePath(ln, keys, split)

        return StepPlan(
            True,
            kv,
            over(kv),
            cross=None if cross is None else over(cross),
            local=None if local_kv is None else over(local_kv),
            chunk=self.ctx.attention_chunk_size,
            window=None if window_kv is None else over(window_kv),
            window_pool=window_pool,
            cascade=None if cascade is None else CascadePath(ln, cascade, DecodePath(ln, cascade.suffix, split)),
        )

    def extend_step(
        self,
        mode: ForwardMode,
        bs: int,
        num_tokens: int,
        qo_indptr: torch.Tensor,
        max_q_len: int,
        kv: KVIndex,
        cross: Optional[KVIndex],
        mask: Optional[torch.Tensor],
        mask_indptr: Optional[torch.Tensor],
        *,
        local: Optional[LocalExtend] = None,
        window_kv: Optional[KVIndex] = None,
        window_pool: Optional[SlidingWindowKVPool] = None,
        cascade: Optional[CascadeKeys] = None,
        spans: Optional[torch.Tensor] = None,
    ) -> StepPlan:
        """An extend-like step's plan: `bs` requests, `num_tokens` query rows (offsets `qo_indptr`, the
        longest `max_q_len`), the TARGET_VERIFY mask (uint8) and its int64 offsets if any, the batch's
        bidirectional spans (int32 `[bs, 2]`) if any. The step's own key sets (main and window) take the
        folded kernels when every request carries the same tokens (`verify_q_len`): the MLA kernel for
        2..16 with absorbed MLA, else the verify kernel; cross (non-causal, no mask), local, cascade,
        encoder-only (non-causal) and bidirectional layers the extend kernel."""
        ln = self.launch
        same = verify_q_len(mode, bs, num_tokens, max_q_len)

        def over(keys: KVIndex):
            if self.launch.share_kv:  # absorbed MLA: its folded kernel, else the extend kernel
                if self.mla_kernel and same is not None and 2 <= same <= MAX_FOLDED_Q_LEN:
                    return MLAPath(ln, keys, same, qo_indptr=qo_indptr, custom_mask=mask, mask_indptr=mask_indptr)
                return ExtendPath(ln, qo_indptr, max_q_len, keys, custom_mask=mask, mask_indptr=mask_indptr)
            return ExtendPath(
                ln, qo_indptr, max_q_len, keys, custom_mask=mask, mask_indptr=mask_indptr, verify_len=same
            )

        cascade_path = local_path = None
        if cascade is not None:
            suffix = ExtendPath(ln, qo_indptr, max_q_len, cascade.suffix, custom_mask=mask, mask_indptr=mask_indptr)
            cascade_path = CascadePath(ln, cascade, suffix)
        if local is not None:
            local_path = ExtendPath(
                ln, local.qo_indptr, local.max_q_len, local.kv, custom_mask=mask, mask_indptr=mask_indptr
            )
        common = dict(custom_mask=mask, mask_indptr=mask_indptr)
        noncausal = ExtendPath(ln, qo_indptr, max_q_len, kv, causal=False, path="extend (non-causal)", **common)
        spans_path = None
        if spans is not None:
            spans = spans.contiguous()
            spans_path = ExtendPath(
                ln, qo_indptr, max_q_len, kv, spans=spans, path="extend (bidirectional spans)", **common
            )
        return StepPlan(
            False,
            kv,
            over(kv),
            cross=None if cross is None else ExtendPath(ln, qo_indptr, max_q_len, cross, causal=False),
            local=local_path,
            chunk=self.ctx.attention_chunk_size,
            window=None if window_kv is None else over(window_kv),
            window_pool=window_pool,
            cascade=cascade_path,
            noncausal=noncausal,
            spans=spans_path,
        )


def custom_mask(b: ForwardBatch) -> Optional[torch.Tensor]:
    """The verify mask as uint8 (its dtype and size checked by the batch validation), or None."""
    spec = b.spec_info
    if not b.forward_mode.is_target_verify() or spec is None or spec.custom_mask is None:
        return None
    return spec.custom_mask.view(torch.uint8)
