"""`TboAttnBackend`: two-batch overlap. The engine runs a step either whole (on `primary`) or as two
micro-batches that overlap compute with communication; each micro-batch runs on its own child
backend with its own metadata. See `attn_core.wrappers.tbo_split` for how a batch is cut.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from attn_core.backend import AttentionBackend, Output
from attn_core.batch import ForwardBatch, SpecInfo
from attn_core.errors import InvalidArgumentError
from attn_core.forward_mode import ForwardMode
from attn_core.wrappers.compose import check_same_kv_layout, intersect_capabilities
from attn_core.wrappers.tbo_split import split_batch, split_spec_info_for_graph


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
                        name, f"the CUDA-graph seq_len fill value {fill} of primary", b.get_cuda_graph_seq_len_fill_value()
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

    def forward(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache: bool = True, **extras) -> Output:
        return self.primary.forward(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **extras)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras) -> Output:
        return self.primary.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **extras)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras) -> Output:
        return self.primary.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **extras)

    # ---- CUDA graphs -------------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.primary.init_cuda_graph_state(max_bs, max_num_tokens)
        for child in self.children:
            child.init_cuda_graph_state(max(max_bs // 2, 1), max(max_num_tokens // 2, 1))

    @staticmethod
    def _half(bs: int) -> int:
        if bs < 2 or bs % 2:
            raise InvalidArgumentError("bs", "an even CUDA-graph batch size >= 2 (each child gets bs/2)", bs)
        return bs // 2

    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        encoder_lens: Optional[torch.Tensor],
        forward_mode: ForwardMode,
        spec_info: Optional[SpecInfo],
    ) -> None:
        h = self._half(bs)
        self.primary.init_forward_metadata_capture_cuda_graph(
            bs, num_tokens, req_pool_indices, seq_lens, encoder_lens, forward_mode, spec_info
        )
        specs = split_spec_info_for_graph(spec_info, h, seq_lens[:bs].cpu())  # capture is once per size: a sync is fine
        for i, (child, rows) in enumerate(zip(self.children, (slice(0, h), slice(h, bs)))):
            enc = None if encoder_lens is None else encoder_lens[rows]
            child.init_forward_metadata_capture_cuda_graph(
                h, num_tokens // 2, req_pool_indices[rows], seq_lens[rows], enc, forward_mode, specs[i]
            )

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: int,
        encoder_lens: Optional[torch.Tensor],
        forward_mode: ForwardMode,
        spec_info: Optional[SpecInfo],
        seq_lens_cpu: Optional[torch.Tensor],
    ) -> None:
        """As the protocol; without `seq_lens_cpu` the children's length sums cost one device sync."""
        h = self._half(bs)
        self.primary.init_forward_metadata_replay_cuda_graph(
            bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens, forward_mode, spec_info, seq_lens_cpu
        )
        host = seq_lens[:bs].cpu() if seq_lens_cpu is None else seq_lens_cpu[:bs]
        specs = split_spec_info_for_graph(spec_info, h, host)
        for i, (child, rows) in enumerate(zip(self.children, (slice(0, h), slice(h, bs)))):
            enc = None if encoder_lens is None else encoder_lens[rows]
            child.init_forward_metadata_replay_cuda_graph(
                h, req_pool_indices[rows], seq_lens[rows], int(host[rows].sum()), enc, forward_mode, specs[i], host[rows]
            )

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.primary.get_cuda_graph_seq_len_fill_value()

    def support_triton(self) -> bool:
        return self.primary.support_triton() and all(c.support_triton() for c in self.children)
