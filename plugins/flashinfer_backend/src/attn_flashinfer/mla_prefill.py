"""DeepSeek's prefill path (MLA without weight absorption) on FlashInfer's ragged prefill kernels.

For a prefill, DeepSeek-style models decompress the latent into per-head K `[.., H, qk_head_dim]`
(128 nope + 64 rope = 192) and V `[.., H, v_head_dim]` (128) and run plain MHA: the new tokens attend
causally to themselves (a ragged pass over the step's K/V), and to their cached prefix, which the
engine decompresses chunk by chunk to bound memory (attn-core's `plan_prefix_chunks`: a token capacity
shared by the batch). Each chunk is a ragged pass without mask (a prefix precedes every new token);
partial results are merged by their LSEs by attn-core's `attend_with_prefix_chunks` (its `merge_state`:
FlashInfer 0.6.6's `merge_state_in_place` fails to launch at 128 heads of 128, "invalid argument",
found on an H200), through `attn_core.batching.chunked_prefill.ChunkedPrefillPlan.attend`, which this
module's `PrefillPlan` supplies with FlashInfer's passes.

Per step: `PrefillWrappers.plan` (through `FlashInferMLABackend.plan_prefill`) plans one wrapper for the
new tokens and one per chunk, and finds each chunk's pool slots (`PrefillPlan.chunk_slots`); per layer
`PrefillPlan.attend(q, k, v, prefix_kv)` runs them, calling `prefix_kv(chunk, slots)` for each chunk's
decompressed K/V. Example (one layer, the engine's `decompress` maps latent slots to K/V):

    plan = backend.plan_prefill(batch, chunk_capacity=8192, scaling=192 ** -0.5)
    o = plan.attend(q, k, v, lambda chunk, slots: decompress(pool_latents[slots], chunk.positions))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from flashinfer import BatchPrefillWithRaggedKVCacheWrapper

from attn_core.batching.chunk_plan import Partial, PrefixChunk, chunk_slots, plan_prefix_chunks
from attn_core.batching.chunked_prefill import ChunkedPrefillPlan
from attn_flashinfer.indices import query_layout

#: FlashInfer's FA2 ragged kernels (head_dim_qk 192 / head_dim_vo 128 build like any other pair).
KERNEL_BACKEND = "fa2"
LN2 = math.log(2.0)


@dataclass
class PrefillPlan(ChunkedPrefillPlan):
    """One step's planned prefill on FlashInfer's ragged wrappers: `new` over the new tokens (causal),
    `chunks[c]` over prefix chunk c; `attend` is `ChunkedPrefillPlan.attend`."""

    new: BatchPrefillWithRaggedKVCacheWrapper
    chunks: list[BatchPrefillWithRaggedKVCacheWrapper]

    def run_new(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Partial:
        o, lse = self.new.run(q, k, v, return_lse=True)
        return o, lse.mul_(LN2)  # FlashInfer's LSE is base 2; merge_state and callers take natural log

    def run_chunk(self, chunk: PrefixChunk, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Partial:
        o, lse = self.chunks[chunk.index].run(q, k, v, return_lse=True)
        return o, lse.mul_(LN2)


class PrefillWrappers:
    """FlashInfer ragged wrappers for the prefill path, created on first need and reused step after step
    (each holds pinned and device scheduler buffers): index 0 for the new tokens, 1 + c for chunk c."""

    def __init__(self, workspace: torch.Tensor):
        self.workspace = workspace
        self._wrappers: list[BatchPrefillWithRaggedKVCacheWrapper] = []

    def _get(self, i: int) -> BatchPrefillWithRaggedKVCacheWrapper:
        while len(self._wrappers) <= i:
            self._wrappers.append(BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend=KERNEL_BACKEND))
        return self._wrappers[i]

    def plan(
        self,
        q_lens_host: torch.Tensor,
        prefix_lens_host: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        chunk_capacity: int,
        *,
        num_heads: int,
        qk_head_dim: int,
        v_head_dim: int,
        dtype: torch.dtype,
        scaling: float,
    ) -> PrefillPlan:
        """Plan the new tokens' pass and one pass per prefix chunk (host lengths; no device sync)."""
        qo = query_layout(q_lens_host)
        chunks = plan_prefix_chunks(prefix_lens_host, chunk_capacity)
        common = dict(head_dim_vo=v_head_dim, sm_scale=scaling, q_data_type=dtype, kv_data_type=dtype)
        new = self._get(0)
        new.plan(qo.indptr, qo.indptr, num_heads, num_heads, qk_head_dim, causal=True, **common)
        planned = []
        for c in chunks.chunks:
            w = self._get(1 + c.index)
            w.plan(qo.indptr, c.cu_seqlens, num_heads, num_heads, qk_head_dim, causal=False, **common)
            planned.append(w)
        slots = [chunk_slots(req_to_token, req_pool_indices, c) for c in chunks.chunks]
        return PrefillPlan(chunks, slots, qo.num_tokens, num_heads, v_head_dim, new, planned)
