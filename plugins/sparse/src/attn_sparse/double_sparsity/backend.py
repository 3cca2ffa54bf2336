"""`DoubleSparsityBackend`: double sparsity (post-training sparse attention, SGLang's
`DoubleSparseAttnBackend`).

The rule, per DECODE request r with L = seq_len keys (the new token's included) and per q head h:

- L < `sparse_decode_threshold`, or L <= `heavy_token_num`: attend to all L keys (dense);
- otherwise: score every key j by s~(j) = sum_c q[h, ch[g, c]] * label[j, g, c] (g = h's KV head, ch the
  layer's heavy channels, label the label cache of `DoubleSparseKVPool`), keep the `heavy_token_num` keys of
  largest s~ (ties: lower positions first) and attend exactly to those (scaling, logit cap and LSE as
  for dense attention, over the kept keys only).

The choice is made per request on the device (no host sync, the same in a CUDA graph). Extend-like steps
(EXTEND, MIXED) attend densely and write the labels of their keys. SGLang decides dense or sparse for the
whole batch (sparse only when every request has >= heavy_token_num keys and the longest reaches the
threshold); per request, a short request in a long batch stays dense and a long one goes sparse.

Engine inputs: the label cache (a `DoubleSparseKVPool` built with the heavy channels per layer and KV head)
as the KV pool, and the options `heavy_token_num` and `sparse_decode_threshold`. A context that can never
go sparse (max_context_len below the threshold, or at most heavy_token_num) may use a plain
`MHATokenToKVPool`: the backend is then dense attention (the conformance kit runs it so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attn_core.contract.batch import ForwardBatch
from attn_core.contract.context import BackendContext
from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.graph_step import CudaGraphStep
from attn_sparse.attention import attend
from attn_sparse.base import PlannedBackend, unit_stride
from attn_sparse.config import SplitPolicy
from attn_sparse.double_sparsity.pool import DoubleSparseKVPool
from attn_sparse.kernels.merge import merge_splits
from attn_sparse.kernels.ranged import CAUSAL, kernel_tiles, launch_ranged
from attn_sparse.kernels.selected import selected_attention
from attn_sparse.kernels.topk import label_scores, select_topk
from attn_sparse.plan import StepPlan
from attn_sparse.spec import CAPABILITIES


@dataclass
class DoubleSparsityMetadata:
    """One step's metadata: the plan, and in a DECODE step that may go sparse, the per-request choice
    `sparse` (int8 `[bs]`, 1: top-k) and the scratch of the selection (`keys` int32 `[bs, Hq, W]` with W >=
    every seq_len, `selected` int32 `[bs, Hq, heavy_token_num]`), shared by the step's layers. `sparse` is
    None when no request of the step can go sparse."""

    plan: StepPlan
    sparse: Optional[torch.Tensor] = None
    keys: Optional[torch.Tensor] = None
    selected: Optional[torch.Tensor] = None


def label_pool(pool, where: str) -> DoubleSparseKVPool:
    """`pool` if it keeps a label cache, else `InvalidArgumentError` naming `where`."""
    if not isinstance(pool, DoubleSparseKVPool):
        raise InvalidArgumentError(
            where,
            "a DoubleSparseKVPool (the label cache) when a request can reach sparse_decode_threshold",
            type(pool).__name__,
        )
    return pool


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(name, "an int >= 1", value)
    return value


class DoubleSparsityBackend(PlannedBackend[DoubleSparsityMetadata]):
    """Options: `heavy_token_num` (keys kept per q head, default 256), `sparse_decode_threshold` (a request
    with fewer keys attends densely, default 4096), `split_policy`."""

    name = "double_sparsity"
    capabilities = CAPABILITIES

    def __init__(
        self,
        ctx: BackendContext,
        *,
        heavy_token_num: int = 256,
        sparse_decode_threshold: int = 4096,
        split_policy: Optional[SplitPolicy] = None,
        **options,
    ):
        self.heavy_token_num = _positive_int("heavy_token_num", heavy_token_num)
        self.sparse_decode_threshold = _positive_int("sparse_decode_threshold", sparse_decode_threshold)
        super().__init__(ctx, split_policy=split_policy, **options)
        self.may_go_sparse = self.sparse_possible(ctx.max_context_len)
        if self.may_go_sparse and ctx.token_to_kv_pool is not None:
            label_pool(ctx.token_to_kv_pool, "ctx.token_to_kv_pool")
        self._graph_meta: dict[int, DoubleSparsityMetadata] = {}
        self._graph_scratch: Optional[DoubleSparsityMetadata] = None

    def sparse_possible(self, longest: int) -> bool:
        """Whether a request of `longest` keys takes the top-k path."""
        return longest >= self.sparse_decode_threshold and longest > self.heavy_token_num

    # ---- metadata --------------------------------------------------------------------------------
    def build_forward_metadata(self, forward_batch: ForwardBatch) -> DoubleSparsityMetadata:
        b = forward_batch
        plan = self.step_plan(b)
        if not b.forward_mode.is_decode() or not self.sparse_possible(plan.max_seq_len):
            return DoubleSparsityMetadata(plan)
        label_pool(self.kv_pool(b), "forward_batch.token_to_kv_pool")
        dev, hq = b.seq_lens.device, self.ctx.num_q_heads
        return DoubleSparsityMetadata(
            plan,
            sparse=self._sparse_flags(b.seq_lens),
            keys=torch.empty((b.batch_size, hq, plan.max_seq_len), dtype=torch.int32, device=dev),
            selected=torch.empty((b.batch_size, hq, self.heavy_token_num), dtype=torch.int32, device=dev),
        )

    def _sparse_flags(self, seq_lens: torch.Tensor) -> torch.Tensor:
        return ((seq_lens >= self.sparse_decode_threshold) & (seq_lens > self.heavy_token_num)).to(torch.int8)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        super().init_cuda_graph_state(max_bs, max_num_tokens)
        self._graph_meta = {}
        self._graph_scratch = None
        if self.may_go_sparse:
            label_pool(self.ctx.token_to_kv_pool, "ctx.token_to_kv_pool")
            dev, hq, width = self.ctx.device, self.ctx.num_q_heads, self.ctx.max_context_len
            self._graph_scratch = DoubleSparsityMetadata(
                plan=None,
                sparse=torch.zeros(max_bs, dtype=torch.int8, device=dev),
                keys=torch.empty((max_bs, hq, width), dtype=torch.int32, device=dev),
                selected=torch.empty((max_bs, hq, self.heavy_token_num), dtype=torch.int32, device=dev),
            )

    def _graph_metadata(self, step: CudaGraphStep) -> DoubleSparsityMetadata:
        plan = self.graph_plan(step)
        bs, scratch = step.bs, self._graph_scratch
        meta = self._graph_meta.get(bs)
        if meta is None:
            meta = DoubleSparsityMetadata(plan)
            if scratch is not None:
                meta.sparse, meta.keys, meta.selected = scratch.sparse[:bs], scratch.keys[:bs], scratch.selected[:bs]
            self._graph_meta[bs] = meta
        if meta.sparse is not None:
            meta.sparse.copy_(self._sparse_flags(step.seq_lens))
        return meta

    def capture_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        self.bind_graph_metadata(self._graph_metadata(step), step)

    def replay_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        if step.bs not in self._graph_meta:
            raise InvalidArgumentError("bs", f"a batch size captured for {step.forward_mode.name}", step.bs)
        self.bind_graph_metadata(self._graph_metadata(step), step)

    # ---- attention -------------------------------------------------------------------------------
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, return_lse=False, **extras):
        pool = self.save_kv(k, v, layer, forward_batch) if save_kv_cache else self.kv_pool(forward_batch)
        return self._dense(unit_stride(q), pool, layer, return_lse)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, return_lse=False, **extras):
        meta: DoubleSparsityMetadata = self.forward_metadata
        pool = self.save_kv(k, v, layer, forward_batch) if save_kv_cache else self.kv_pool(forward_batch)
        q = unit_stride(q)
        if meta.sparse is None:
            return self._dense(q, pool, layer, return_lse)
        plan, lid = meta.plan, layer.layer_id
        k_buf, v_buf = pool.get_key_buffer(lid), pool.get_value_buffer(lid)
        bs, hq, dv = q.shape[0], q.shape[1], v_buf.shape[2]
        label_scores(
            q,
            pool.heavy_channels[lid],
            pool.get_label_buffer(lid),
            plan,
            meta.sparse,
            meta.keys,
            kernel_tiles(q.is_cuda).block_n,
        )
        select_topk(meta.keys, plan, meta.sparse, self.heavy_token_num, meta.selected)
        # every (request, head, split) of the partials is written once: top-k requests by the selected-key
        # kernel, the others by the dense kernel (which skips the top-k requests)
        partial_o = torch.empty((bs, hq, plan.splits, dv), dtype=torch.float32, device=q.device)
        partial_lse = torch.empty((bs, hq, plan.splits), dtype=torch.float32, device=q.device)
        scale, cap = layer.scaling, layer.logit_cap
        selected_attention(
            q,
            k_buf,
            v_buf,
            meta.selected,
            plan,
            meta.sparse,
            self.heavy_token_num,
            scale=scale,
            logit_cap=cap,
            partial_o=partial_o,
            partial_lse=partial_lse,
        )
        launch_ranged(
            q,
            k_buf,
            v_buf,
            plan,
            part=CAUSAL,
            chunk_len=1,
            scale=scale,
            logit_cap=cap,
            out=partial_o,
            lse=partial_lse,
            splits=plan.splits,
            skip=meta.sparse,
        )
        out = torch.empty((bs, hq, dv), dtype=q.dtype, device=q.device)
        lse = torch.empty((bs, hq), dtype=torch.float32, device=q.device) if return_lse else None
        merge_splits(partial_o, partial_lse, out, lse)
        return self.finish(out, lse, return_lse)

    def _dense(self, q, pool, layer, return_lse: bool):
        lid = layer.layer_id
        out, lse = attend(
            q,
            pool.get_key_buffer(lid),
            pool.get_value_buffer(lid),
            self.forward_metadata.plan,
            part=CAUSAL,
            chunk_len=1,
            scale=layer.scaling,
            logit_cap=layer.logit_cap,
            out_dtype=q.dtype,
            want_lse=return_lse,
        )
        return self.finish(out, lse, return_lse)
