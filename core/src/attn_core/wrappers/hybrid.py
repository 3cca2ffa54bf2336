"""`HybridAttnBackend`: one backend for decode, another for everything else.

Typical use: a kernel library that is fastest (or graph-capturable) for decode paired with another
for prefill. Both backends read and write the same KV cache, so they must agree on its layout;
construction refuses pairs that do not.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from attn_core.contract.backend import AttentionBackend, Output
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.capabilities import Capabilities, CudaGraphLevel, Feature
from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.contract.layer import AttentionLayer
from attn_core.wrappers.compose import check_same_kv_layout, intersect_capabilities

_CHOICES = ("prefill", "decode")


class HybridAttnBackend(AttentionBackend[AttentionBackend]):
    """Routes each step by its forward mode: DECODE and the no-token modes (IDLE, DUMMY_FIRST) go to
    `decode`, TARGET_VERIFY and
    DRAFT_EXTEND to the backend named by `target_verify` / `draft_extend` ("prefill" or "decode",
    default "prefill"), every other mode to `prefill`.

    CUDA graphs: a mode may run in a graph when the backend it routes to can run it in one (see
    `capabilities.cuda_graph`); graph state, capture and replay go to that backend and the padding
    fill value is the decode backend's. Raises `InvalidArgumentError` at construction when the two
    backends disagree on the KV layout (page size, KV dtype, heads, arch, pools) or, when both run
    inside graphs, on the fill value.

    `capabilities` is an instance attribute derived from the two: a mode is supported when its
    backend supports it; layer features (window, logit cap, sinks, ...) need both; the custom mask
    comes from the backend that runs TARGET_VERIFY. Per-layer validation is the routed backend's own.

    Metadata: the routed child (`forward_metadata` is the child that holds this step's metadata); the
    child validates the batch and refuses stale metadata, so the wrapper adds no check of its own.
    """

    name = "hybrid"

    def __init__(
        self,
        prefill: AttentionBackend,
        decode: AttentionBackend,
        *,
        target_verify: str = "prefill",
        draft_extend: str = "prefill",
    ):
        for arg, value in (("target_verify", target_verify), ("draft_extend", draft_extend)):
            if value not in _CHOICES:
                raise InvalidArgumentError(arg, f"one of {_CHOICES}", value)
        check_same_kv_layout([("prefill", prefill), ("decode", decode)])
        super().__init__(decode.ctx)
        self.prefill = prefill
        self.decode = decode
        self._by_choice = {"prefill": prefill, "decode": decode}
        self._routes = {ForwardMode.TARGET_VERIFY: target_verify, ForwardMode.DRAFT_EXTEND: draft_extend}
        self.capabilities = self._derive_capabilities()
        self._graph_backends = self._graph_backends_of(self.capabilities.cuda_graph)
        fills = {id(b): b.get_cuda_graph_seq_len_fill_value() for b in self._graph_backends}
        if len(set(fills.values())) > 1:
            raise InvalidArgumentError(
                "prefill",
                f"the CUDA-graph seq_len fill value {decode.get_cuda_graph_seq_len_fill_value()} of decode "
                "(both run inside graphs)",
                prefill.get_cuda_graph_seq_len_fill_value(),
            )

    # ---- routing -------------------------------------------------------------------------------
    def backend_for(self, mode: ForwardMode) -> AttentionBackend:
        """The backend that runs steps of `mode`."""
        if mode.is_decode() or mode.is_no_tokens():
            return self.decode
        return self._by_choice[self._routes.get(mode, "prefill")]

    def _derive_capabilities(self) -> Capabilities:
        both = intersect_capabilities([self.prefill.capabilities, self.decode.capabilities])
        modes = frozenset(m for m in ForwardMode if m in self.backend_for(m).capabilities.forward_modes)
        features = set(both.features) - {Feature.CUSTOM_MASK}
        if Feature.CUSTOM_MASK in self.backend_for(ForwardMode.TARGET_VERIFY).capabilities.features:
            features.add(Feature.CUSTOM_MASK)
        level = CudaGraphLevel.NEVER
        for candidate in sorted(CudaGraphLevel, reverse=True):
            if all(self.backend_for(m).capabilities.cuda_graph.covers(m) for m in ForwardMode if candidate.covers(m)):
                level = candidate
                break
        return Capabilities(
            devices=both.devices,
            q_dtypes=both.q_dtypes,
            kv_dtypes=both.kv_dtypes,
            archs=both.archs,
            head_dims=both.head_dims,
            page_sizes=both.page_sizes,
            forward_modes=modes,
            features=frozenset(features),
            cuda_graph=level,
            min_compute_capability=both.min_compute_capability,
            max_compute_capability=both.max_compute_capability,
            cpu_isa=both.cpu_isa,
            kv_layouts=both.kv_layouts,
        )

    def _graph_backends_of(self, level: CudaGraphLevel) -> list[AttentionBackend]:
        out: list[AttentionBackend] = []
        for m in ForwardMode:
            b = self.backend_for(m)
            if level.covers(m) and all(b is not o for o in out):
                out.append(b)
        return out

    def _graph_backend(self, mode: ForwardMode) -> AttentionBackend:
        if not self.capabilities.cuda_graph.covers(mode):
            raise UnsupportedFeatureError(
                self.name, f"CUDA graphs for {mode.name} (level {self.capabilities.cuda_graph.name})"
            )
        return self.backend_for(mode)

    # ---- metadata ------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Routing only: the child's `init_forward_metadata` validates (no second validation here)."""
        self.forward_metadata = self.build_forward_metadata(forward_batch)

    def build_forward_metadata(self, forward_batch: ForwardBatch) -> AttentionBackend:
        child = self.backend_for(forward_batch.forward_mode)
        child.init_forward_metadata(forward_batch)
        return child

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if not self._graph_backends:
            raise UnsupportedFeatureError(self.name, "CUDA graphs")
        for b in self._graph_backends:
            b.init_cuda_graph_state(max_bs, max_num_tokens)

    def trust_graph_slots(self, buffer: torch.Tensor) -> None:
        super().trust_graph_slots(buffer)
        for b in self._graph_backends:
            b.trust_graph_slots(buffer)

    def capture_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        self._graph_backend(step.forward_mode).capture_graph_step(step)

    def replay_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        # the child's replay entry: its fault word is read and its host copy refreshed too
        self._graph_backend(step.forward_mode).replay_graph_step(step)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.decode.get_cuda_graph_seq_len_fill_value()

    def support_triton(self) -> bool:
        return self.prefill.support_triton() and self.decode.support_triton()

    # ---- attention: the routed backend validates and runs ----------------------------------------
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
        backend = self.backend_for(forward_batch.forward_mode)
        return backend.forward(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **extras)

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
        return self.decode.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **extras)

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
        backend = self.backend_for(forward_batch.forward_mode)
        return backend.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **extras)
