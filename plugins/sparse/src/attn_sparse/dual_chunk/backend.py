"""`DualChunkBackend`: dual chunk attention (Qwen2.5-1M's long-context method; SGLang's
`DualChunkFlashAttentionBackend`).

Keys are cut into chunks of chunk_len = chunk_size - local_size positions. A query at position p (chunk
start c = (p // chunk_len) * chunk_len) attends causally to the keys at positions 0..p in three parts,
each with its own query variant:

    intra: keys [c, p]                          with q
    succ:  keys [c - chunk_len, c)              with q_succ   (the previous chunk)
    inter: keys [0, c - chunk_len)              with q_inter  (every earlier chunk)

and the three partial results (output, LSE) are merged exactly with attn-core's `merge_state`: the result
is one softmax over all keys 0..p whose score for key j uses the variant of j's part.

Engine inputs: the options `chunk_size` and `local_size` (the model's `dual_chunk_attention_config`), and
per layer call the three rotary-embedded queries: `q` (the intra variant) as the usual argument and the
forward extras `q_succ` and `q_inter` (each `[T, Hq, D]` or `[T, Hq * D]`, in the context's dtype). The
engine rotates them, and k, at the positions `attn_sparse.dual_chunk.positions.dual_chunk_positions`
gives; attn applies no rotary embedding (the engine owns RoPE). Qwen's length scaling
(`original_max_position_embeddings`: the softmax scale times a per-request factor) is the engine's too:
multiply the request's three query variants by its factor. A variant a step does not need may be left
out: q_succ is needed once a query of the step sits at position >= chunk_len, q_inter at >= 2 chunk_len
(a CUDA graph needs them once the context's max_context_len exceeds chunk_len and 2 chunk_len); a
needed one missing is refused (`InvalidArgumentError` naming it) before any KV write.

Modes: EXTEND and MIXED (chunked prefill across chunk boundaries is the same rule: each new token's
parts come from its own position), DECODE (CUDA graphs too). SGLang's per-layer sparse prefill
(`sparse_attention_config`, vertical-and-slash patterns with the "critical" query variants) is left out:
every part here is exact attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attn_core.contract.batch import ForwardBatch
from attn_core.contract.context import BackendContext
from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.ops.merge_state import merge_state
from attn_sparse.attention import attend
from attn_sparse.base import PlannedBackend, unit_stride
from attn_sparse.config import SplitPolicy
from attn_sparse.dual_chunk.positions import chunk_length
from attn_sparse.kernels.ranged import INTER, INTRA, SUCC
from attn_sparse.plan import StepPlan
from attn_sparse.spec import CAPABILITIES

#: the forward extra carrying each part's query variant (the intra part's is `q`)
VARIANT_NAMES = {SUCC: "q_succ", INTER: "q_inter"}


@dataclass
class DualChunkMetadata:
    """One step's plan and the parts its queries can reach (INTRA always; SUCC, INTER when a query of the
    step, or of the graph's context, sits at position >= chunk_len, >= 2 chunk_len)."""

    plan: StepPlan
    parts: tuple[int, ...]


class DualChunkBackend(PlannedBackend[DualChunkMetadata]):
    """Options: `chunk_size` (required: the model's chunk size), `local_size` (default 0), `split_policy`."""

    name = "dual_chunk"
    capabilities = CAPABILITIES
    extra_forward_args = frozenset(VARIANT_NAMES.values())

    def __init__(
        self,
        ctx: BackendContext,
        *,
        chunk_size: Optional[int] = None,
        local_size: int = 0,
        split_policy: Optional[SplitPolicy] = None,
        **options,
    ):
        if chunk_size is None:
            raise InvalidArgumentError(
                "chunk_size", "the model's dual_chunk_attention_config chunk_size (an int >= 1)", None
            )
        self.chunk_size, self.local_size = chunk_size, local_size
        self.chunk_len = chunk_length(chunk_size, local_size)
        super().__init__(ctx, split_policy=split_policy, **options)
        self._graph_meta: dict[int, DualChunkMetadata] = {}

    def parts_for(self, longest: int) -> tuple[int, ...]:
        """The parts queries of requests with up to `longest` keys reach (their positions are < longest)."""
        last = longest - 1
        return (INTRA,) + ((SUCC,) if last >= self.chunk_len else ()) + ((INTER,) if last >= 2 * self.chunk_len else ())

    # ---- metadata --------------------------------------------------------------------------------
    def build_forward_metadata(self, forward_batch: ForwardBatch) -> DualChunkMetadata:
        plan = self.step_plan(forward_batch)
        return DualChunkMetadata(plan, self.parts_for(plan.max_seq_len))

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        super().init_cuda_graph_state(max_bs, max_num_tokens)
        self._graph_meta = {}

    def capture_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        plan = self.graph_plan(step)
        meta = self._graph_meta.setdefault(step.bs, DualChunkMetadata(plan, self.parts_for(plan.max_seq_len)))
        self.bind_graph_metadata(meta, step)

    def replay_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        meta = self._graph_meta.get(step.bs)
        if meta is None:
            raise InvalidArgumentError("bs", f"a batch size captured for {step.forward_mode.name}", step.bs)
        self.graph_plan(step)  # refreshes meta.plan's buffers in place
        self.bind_graph_metadata(meta, step)

    # ---- attention -------------------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **extras)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **extras)

    def _forward(self, q, k, v, layer, batch, save_kv_cache, q_succ=None, q_inter=None, return_lse=False):
        meta: DualChunkMetadata = self.forward_metadata
        given = {SUCC: q_succ, INTER: q_inter}
        queries = {INTRA: unit_stride(q)}
        for part, x in given.items():  # every check before the K/V write
            if x is not None or part in meta.parts:
                queries[part] = self._variant(part, x, q.shape)
        pool = self.save_kv(k, v, layer, batch) if save_kv_cache else self.kv_pool(batch)
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        args = dict(chunk_len=self.chunk_len, scale=layer.scaling, logit_cap=layer.logit_cap)
        if meta.parts == (INTRA,):
            out, lse = attend(
                queries[INTRA], k_buf, v_buf, meta.plan, part=INTRA, out_dtype=q.dtype, want_lse=return_lse, **args
            )
            return self.finish(out, lse, return_lse)
        out = lse = None
        for part in meta.parts:
            o, o_lse = attend(
                queries[part], k_buf, v_buf, meta.plan, part=part, out_dtype=torch.float32, want_lse=True, **args
            )
            out, lse = (o, o_lse) if out is None else merge_state(out, lse, o, o_lse)
        return self.finish(out.to(q.dtype), lse, return_lse)

    def _variant(self, part: int, x: Optional[torch.Tensor], shape: torch.Size) -> torch.Tensor:
        """The query variant of `part` as `[T, Hq, D]`, or `InvalidArgumentError` naming it."""
        name = VARIANT_NAMES[part]
        T, hq, d = shape
        if x is None:
            reach = self.chunk_len * (1 if part == SUCC else 2)
            raise InvalidArgumentError(
                name, f"the rotary-embedded {name} (a query of this step may sit at position >= {reach})", None
            )
        if not isinstance(x, torch.Tensor):
            raise InvalidArgumentError(name, f"a tensor of shape ({T}, {hq}, {d}) or ({T}, {hq * d})", type(x).__name__)
        if x.dtype != self.ctx.dtype or x.device != self.device:
            raise InvalidArgumentError(name, f"a {self.ctx.dtype} tensor on {self.device}", (x.dtype, x.device))
        if tuple(x.shape) == (T, hq * d):
            x = x.reshape(T, hq, d)
        if tuple(x.shape) != (T, hq, d):
            raise InvalidArgumentError(name, f"shape ({T}, {hq}, {d}) or ({T}, {hq * d})", tuple(x.shape))
        return unit_stride(x)
