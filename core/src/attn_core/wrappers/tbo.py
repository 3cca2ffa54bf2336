"""`TboAttnBackend`: two-batch overlap. The engine runs a step either whole (on `primary`) or as two
micro-batches that overlap compute with communication; each micro-batch runs on its own child
backend with its own metadata. See `attn_core.batching.tbo_split` for how a batch is cut.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from attn_core.batching.tbo_split import split_batch, split_spec_info_for_graph
from attn_core.contract.backend import AttentionBackend, Output
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.contract.layer import AttentionLayer
from attn_core.wrappers.compose import check_same_kv_layout, intersect_capabilities


class TboAttnBackend(AttentionBackend[Optional[tuple[ForwardBatch, ForwardBatch]]]):
    """`primary` serves the whole batch; `children[0]` / `children[1]` serve its two halves.

    `init_forward_metadata(batch)` builds the primary's metadata and, when the batch can be split,
    the children's for the two child batches, left in `child_batches` (each with its `attn_backend`
    set to its child); the engine runs child A then child B at every layer. `forward` runs the whole
    batch on the primary.

    CUDA graphs: a captured batch size bs must be even; the primary gets bs, each child bs/2 (requests
    [0, bs/2) and [bs/2, bs)), with the graph arguments split the same way as `split_forward_batch`
    splits a DECODE / TARGET_VERIFY batch of that size.

    Metadata: the two child batches (also `child_batches`), or None when the batch is not split; the
    primary and the children validate their batches and refuse stale metadata themselves.

    `capabilities` (an instance attribute) is what all three can do. All three must agree on the KV
    layout and, when graphs are possible, on the padding fill value (`InvalidArgumentError` otherwise).
    """

    name = "tbo"

    def __init__(self, primary: AttentionBackend, children: Sequence[AttentionBackend], *, allow_cut: bool = True):
        children = tuple(children)
        if len(children) != 2:
            raise InvalidArgumentError("children", "exactly two child backends", len(children))
        named = [("primary", primary), ("children[0]", children[0]), ("children[1]", children[1])]
        check_same_kv_layout(named)
        super().__init__(primary.ctx)
        self.primary = primary
        self.children = children
        self.allow_cut = allow_cut
        self.capabilities = intersect_capabilities([b.capabilities for _, b in named])
        self.child_batches: Optional[tuple[ForwardBatch, ForwardBatch]] = None
        if self.capabilities.cuda_graph > 0:
            fill = primary.get_cuda_graph_seq_len_fill_value()
            for name, b in named[1:]:
                if b.get_cuda_graph_seq_len_fill_value() != fill:
                    raise InvalidArgumentError(
                        name,
                        f"the CUDA-graph seq_len fill value {fill} of primary",
                        b.get_cuda_graph_seq_len_fill_value(),
                    )

    # ---- eager -----------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Delegation only: the primary and the children validate (no second validation here)."""
        self.forward_metadata = self.child_batches = self.build_forward_metadata(forward_batch)

    def build_forward_metadata(self, forward_batch: ForwardBatch) -> Optional[tuple[ForwardBatch, ForwardBatch]]:
        self.primary.init_forward_metadata(forward_batch)
        child_batches = split_batch(forward_batch, allow_cut=self.allow_cut)
        if child_batches is not None:
            for child, child_batch in zip(self.children, child_batches):
                child_batch.attn_backend = child
                child.init_forward_metadata(child_batch)
        return child_batches

    def forward(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **extras: Any,
    ) -> Output:
        return self.primary.forward(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **extras)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **extras: Any,
    ) -> Output:
        return self.primary.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **extras)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **extras: Any,
    ) -> Output:
        return self.primary.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **extras)

    # ---- CUDA graphs -------------------------------------------------------------------------------
    def trust_graph_slots(self, buffer: torch.Tensor) -> None:
        super().trust_graph_slots(buffer)
        for b in (self.primary, *self.children):
            b.trust_graph_slots(buffer)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.primary.init_cuda_graph_state(max_bs, max_num_tokens)
        for child in self.children:
            child.init_cuda_graph_state(max(max_bs // 2, 1), max(max_num_tokens // 2, 1))

    @staticmethod
    def _half(bs: int) -> int:
        if bs < 2 or bs % 2:
            raise InvalidArgumentError("bs", "an even CUDA-graph batch size >= 2 (each child gets bs/2)", bs)
        return bs // 2

    def _child_steps(self, step: CudaGraphStep, host_lens: torch.Tensor) -> list[CudaGraphStep]:
        """The two halves of a graph batch (`host_lens`: its host seq_lens `[bs]`)."""
        h = self._half(step.bs)
        specs = split_spec_info_for_graph(step.spec_info, h, host_lens)
        return [
            CudaGraphStep(
                forward_mode=step.forward_mode,
                bs=h,
                num_tokens=None if step.num_tokens is None else step.num_tokens // 2,
                req_pool_indices=step.req_pool_indices[rows],
                seq_lens=step.seq_lens[rows],
                seq_lens_cpu=host_lens[rows],
                encoder_lens=None if step.encoder_lens is None else step.encoder_lens[rows],
                spec_info=spec,
            )
            for rows, spec in zip((slice(0, h), slice(h, step.bs)), specs)
        ]

    def capture_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        self._half(step.bs)
        self.primary.capture_cuda_graph_metadata(step)
        children = self._child_steps(step, step.seq_lens.cpu())  # capture is once per size: a sync is fine
        for child, child_step in zip(self.children, children):
            child.capture_cuda_graph_metadata(child_step)

    def replay_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        """As the protocol; without `step.seq_lens_cpu` splitting costs one device sync (the children's host
        lengths)."""
        self._half(step.bs)
        self.primary.replay_cuda_graph_metadata(step)
        for child, child_step in zip(self.children, self._child_steps(step, step.host_seq_lens())):
            child.replay_cuda_graph_metadata(child_step)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.primary.get_cuda_graph_seq_len_fill_value()

    def support_triton(self) -> bool:
        return self.primary.support_triton() and all(c.support_triton() for c in self.children)
