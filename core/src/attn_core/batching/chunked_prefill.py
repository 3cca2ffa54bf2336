"""The kernel-independent half of DeepSeek's prefill path (non-absorbed MHA over the new tokens plus the
cached prefix chunk by chunk), shared by every backend that offers it.

`ChunkedPrefillPlan` is one step's planned non-absorbed prefill: the prefix chunks
(`attn_core.batching.chunk_plan.plan_prefix_chunks`), each chunk's pool slots, and the step's sizes. Its `attend`
checks the per-layer inputs, asks the engine for each chunk's decompressed K/V and runs
`attn_core.batching.chunk_plan.attend_with_prefix_chunks` (the one chunk loop and LSE merge); the two passes it
needs are a subclass's, with the backend's kernels: `run_new` (the new tokens over themselves, causal)
and `run_chunk` (the new tokens over one prefix chunk, no mask), each returning the output
`[T, H, v_head_dim]` and the natural-log LSE `[T, H]` float32 (docs/design.md §3.2). attn-flashinfer's
subclass runs FlashInfer's ragged wrappers (`attn_flashinfer.mla_prefill.PrefillPlan`); attn-trtllm-mla's
runs TensorRT-LLM's ragged prefill (`attn_trtllm_mla.ragged.RaggedPrefillPlan`).

Worked example (a subclass whose passes run some kernel): an EXTEND batch of requests (prefix 5, 3 new)
and (0, 2), chunk capacity 4 -> `prefill_lengths(batch)` = ([3, 2], [5, 0]); `plan_prefix_chunks([5, 0],
4)` gives chunk_len 2 and 3 chunks; `plan.attend(q, k, v, prefix_kv)` runs `run_new` once, then
`prefix_kv(chunk, slots)` and `run_chunk` for chunks 0, 1, 2, merging each by LSE, and returns `[5, H * Dv]`.

`prefill_lengths(forward_batch)` gives the host lengths a plan is built from, or a typed error.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from attn_core.batching.chunk_plan import Partial, PrefixChunk, PrefixChunkPlan, attend_with_prefix_chunks
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.errors import InvalidArgumentError

#: (chunk, its pool slots int64 [chunk.num_tokens]) -> (K [N, H, qk_head_dim], V [N, H, v_head_dim])
PrefixKV = Callable[[PrefixChunk, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def prefill_lengths(forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(new tokens per request, cached prefix per request): the host lengths of an EXTEND batch, int
    `[bs]` each; `InvalidArgumentError` for another mode or a batch without them.

    Example: an EXTEND batch of requests (prefix 5, 3 new) and (0, 2) -> ([3, 2], [5, 0])."""
    b = forward_batch
    if not b.forward_mode.is_extend() or b.extend_seq_lens_cpu is None or b.extend_prefix_lens_cpu is None:
        raise InvalidArgumentError(
            "forward_batch", "an EXTEND batch with host extend and prefix lengths", b.forward_mode.name
        )
    return b.extend_seq_lens_cpu, b.extend_prefix_lens_cpu


@dataclass
class ChunkedPrefillPlan(ABC):
    """One step's planned prefill over `num_tokens` new tokens of `num_heads` heads; subclasses supply
    the passes (`run_new`, `run_chunk`). `chunk_slots[c]`: device int64 `[chunk.num_tokens]`, the pool
    slots of chunk c's tokens in its packed order (`attn_core.batching.chunk_plan.chunk_slots`)."""

    chunk_plan: PrefixChunkPlan
    chunk_slots: list[torch.Tensor]
    num_tokens: int
    num_heads: int
    v_head_dim: int

    @abstractmethod
    def run_new(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Partial:
        """The new tokens over themselves (causal): output `[T, H, v_head_dim]`, natural-log LSE `[T, H]`."""

    @abstractmethod
    def run_chunk(self, chunk: PrefixChunk, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Partial:
        """The new tokens over prefix chunk `chunk` (K/V `[chunk.num_tokens, H, ..]`, no mask): output
        `[T, H, v_head_dim]`, natural-log LSE `[T, H]` (-inf for a query whose request has no key in it)."""

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        prefix_kv: Optional[PrefixKV] = None,
        return_lse: bool = False,
    ):
        """q/k `[T, H, qk_head_dim]`, v `[T, H, v_head_dim]` (the step's new tokens) -> output `[T, H *
        v_head_dim]` (and the natural-log LSE `[T, H]` float32 with return_lse). `prefix_kv` gives each
        chunk's K/V; required when the plan has chunks."""
        T, H = self.num_tokens, self.num_heads
        if q.shape[0] != T or k.shape[0] != T or v.shape[0] != T or q.shape[1] != H:
            raise InvalidArgumentError(
                "q/k/v", f"{T} rows of {H} heads (the planned batch)", (tuple(q.shape), tuple(k.shape), tuple(v.shape))
            )
        chunks = self.chunk_plan.chunks
        if chunks and prefix_kv is None:
            raise InvalidArgumentError("prefix_kv", f"a callable giving the K/V of {len(chunks)} prefix chunks", None)

        def attend_chunk(chunk: PrefixChunk) -> Partial:
            if prefix_kv is None:  # never: refused above when there are chunks
                raise InvalidArgumentError("prefix_kv", "a callable giving the K/V of the prefix chunks", None)
            kc, vc = prefix_kv(chunk, self.chunk_slots[chunk.index])
            if kc.shape[0] != chunk.num_tokens or vc.shape[0] != chunk.num_tokens:
                raise InvalidArgumentError(
                    "prefix_kv", f"K/V of {chunk.num_tokens} tokens for chunk {chunk.index}", (kc.shape[0], vc.shape[0])
                )
            return self.run_chunk(chunk, q, kc, vc)

        o, lse = attend_with_prefix_chunks(chunks, lambda: self.run_new(q, k, v), attend_chunk)
        o = o.reshape(T, H * self.v_head_dim)
        return (o, lse) if return_lse else o
