"""vLLM's CUSTOM attention backend on attn (vLLM 0.32's v1 interface).

- `AttnVllmImpl.__init__` (vLLM builds the model): the layer's settings as attn `Requirements`, the attn
  backend named or selected for them (`attn_vllm.selection`): anything the backend does not declare
  (sliding window, sinks, logit cap, head dim, dtype, block size, an engine-owned KV pool) or vLLM asks
  that attn does not do (ALiBi, encoder attention, KV sharing, quantized KV / output) raises attn's typed
  error here, at start-up.
- `AttnVllmMetadataBuilder.build` (once per step and KV-cache group): on the first step an
  `attn_core.EngineKVPool` over the group's per-layer caches as vLLM allocated them (`[blocks, heads,
  block_size, 2 * head_size]` views in the layout vLLM resolved; K the first half of the last
  dimension, V the second), an `attn_core.EngineBatches` and the attn backend; then per step the
  `ForwardBatch` from vLLM's `CommonAttentionMetadata` and the backend's `init_forward_metadata`.
- `do_kv_cache_update` (per layer; `forward_includes_kv_cache_update` is False): the step's new K/V
  through attn's write step, `backend.save_kv` (the pool's checked `set_kv_buffer` at vLLM's slots).
- `forward` (per layer): attention through `backend.forward(..., save_kv_cache=False, out=output)`,
  after checking that the cache vLLM passes is still the memory the pool wraps (never a copy).

`attn_vllm.stats.STATS` counts steps, layer calls, K/V writes and cache checks in this process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch
from vllm.config import get_current_vllm_config, get_layers_from_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.platforms import current_platform
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import KVCacheLayout

from attn_core import AttentionLayer, EngineBatches, EngineKVPool, create_backend
from attn_core.contract.backend import AttentionBackend as AttnBackend
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.capabilities import Feature
from attn_core.contract.context import BackendContext, dtype_name
from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.discovery.registry import default_registry
from attn_vllm import VALIDATION_ENV
from attn_vllm.selection import VLLM_MODES, backend_for, engine_layouts, requirements
from attn_vllm.stats import STATS

#: what attn calls vLLM in its errors
ENGINE = "vllm"
#: attn backends chosen by this process's layers (`supported_kv_cache_layouts` asks them all)
CHOSEN: set[str] = set()


class AttnVllmBackend(AttentionBackend):
    """vLLM's view of attn: K/V written by `do_kv_cache_update`, attention by `forward`, both in place."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[AttnVllmImpl]:
        return AttnVllmImpl

    @staticmethod
    def get_builder_cls() -> type[AttnVllmMetadataBuilder]:
        return AttnVllmMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        sizes = None
        for name in CHOSEN or _named_backend():
            caps = default_registry().resolve(name).spec.capabilities
            if caps.page_sizes is not None:
                sizes = set(caps.page_sizes) if sizes is None else sizes & caps.page_sizes
        return [MultipleOf(1)] if sizes is None else sorted(sizes)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        """The layouts every chosen attn backend reads in place (`attn_vllm.selection.engine_layouts`)."""
        names = CHOSEN or _named_backend()
        layouts: Optional[list[str]] = None
        for name in names:
            mine = engine_layouts(default_registry().resolve(name).spec.capabilities)
            layouts = list(mine) if layouts is None else [x for x in layouts if x in mine]
        if layouts is None:  # nothing chosen yet: the layouts attn's own pools read
            layouts = ["LBNHC", "LBHNC"]
        return tuple(KVCacheLayout[x] for x in layouts)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


def _named_backend() -> set[str]:
    from attn_vllm import BACKEND_ENV

    name = os.environ.get(BACKEND_ENV)
    return {default_registry().resolve(name).name} if name else set()


class AttnVllmImpl(AttentionImpl):
    """One vLLM attention layer: its settings, checked against the attn backend at construction."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: Optional[list[float]],
        sliding_window: Optional[int],
        kv_cache_dtype: str,
        logits_soft_cap: Optional[float] = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: Optional[str] = None,
        sinks: Optional[torch.Tensor] = None,
    ) -> None:
        if alibi_slopes is not None:
            raise UnsupportedFeatureError(ENGINE, "ALiBi slopes through attn")
        if attn_type != AttentionType.DECODER:
            raise UnsupportedFeatureError(ENGINE, f"attention type {attn_type} through attn (decoder attention only)")
        if kv_sharing_target_layer_name is not None:
            raise UnsupportedFeatureError(ENGINE, "KV cache sharing between layers through attn")
        if kv_cache_dtype != "auto":
            raise UnsupportedFeatureError(
                ENGINE, f"kv_cache_dtype {kv_cache_dtype!r} through attn (the model dtype only)"
            )
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.sliding_window = sliding_window if sliding_window and sliding_window > 0 else None
        self.logit_cap = float(logits_soft_cap or 0.0)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        self.sinks = sinks
        config = get_current_vllm_config()
        req = requirements(
            device_type=current_platform.device_type,
            dtype_name=dtype_name(config.model_config.dtype),
            head_dim=head_size,
            page_size=config.cache_config.block_size or 1,
            sliding_window=self.sliding_window,
            sinks=sinks is not None,
            logit_cap=self.logit_cap,
        )
        #: the attn backend this layer runs on (typed error above when none can serve it)
        self.backend_name = backend_for(req)
        CHOSEN.add(self.backend_name)

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Optional[AttnVllmMetadata],
        output: torch.Tensor,
        output_scale: Optional[torch.Tensor] = None,
        output_block_scale: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Attention of the step's tokens into `output[:T]` through the attn backend (vLLM has written
        their K/V through `do_kv_cache_update`). `attn_metadata` None: a warm-up run, nothing to do."""
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedFeatureError(ENGINE, "fused output quantization through attn")
        if attn_metadata is None:
            return output
        m = attn_metadata
        alayer = m.layer(layer.layer_name, kv_cache)
        T = m.batch.num_tokens
        extras = {} if self.sinks is None else {"sinks": self.sinks.to(torch.float32)}
        m.backend.forward(query[:T], key[:T], value[:T], alayer, m.batch, save_kv_cache=False, out=output[:T], **extras)
        STATS.attention_calls += 1
        return output

    def do_kv_cache_update(
        self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ):
        """Write the step's new K/V into vLLM's cache: attn's write step (`save_kv`) at the step's slots."""
        m = _step_metadata(layer.layer_name)
        if m is None:
            return
        alayer = m.layer(layer.layer_name, kv_cache)
        T = m.batch.num_tokens
        m.backend.save_kv(key[:T], value[:T], alayer, m.batch)
        STATS.kv_writes += 1


def _step_metadata(layer_name: str) -> Optional[AttnVllmMetadata]:
    """This step's metadata of `layer_name` from vLLM's forward context (None: no step, a warm-up)."""
    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):
        meta = meta[0]
    if isinstance(meta, dict):
        meta = meta.get(layer_name)
    return meta if isinstance(meta, AttnVllmMetadata) else None


@dataclass
class AttnVllmMetadata:
    """One step of one KV-cache group: the attn batch (its metadata already built by the backend)."""

    batch: ForwardBatch
    backend: AttnBackend
    pool: EngineKVPool
    layers: dict[str, tuple[int, AttentionLayer]] = field(default_factory=dict)

    def layer(self, name: str, kv_cache: torch.Tensor) -> AttentionLayer:
        """The attn layer of vLLM layer `name`, after checking that `kv_cache` is still the memory the
        pool wraps (`InvalidArgumentError` naming kv_cache otherwise: attn never reads a copy)."""
        lid, alayer = self.layers[name]
        if not self.pool.is_view_of(lid, kv_cache):
            raise InvalidArgumentError(
                f"kv_cache of {name}", "the cache the attn pool wraps (vLLM's own, never copied)", "other memory"
            )
        STATS.cache_checks += 1
        return alayer


@dataclass
class _GroupState:
    """What a builder sets up on its first step: pool, batch builder, backend, layers."""

    pool: EngineKVPool
    batches: EngineBatches
    backend: AttnBackend
    layers: dict[str, tuple[int, AttentionLayer]]


class AttnVllmMetadataBuilder(AttentionMetadataBuilder[AttnVllmMetadata]):
    """Per KV-cache group: the step's attn `ForwardBatch` and backend metadata from vLLM's metadata."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)  # decodes first: attn's MIXED steps split there
        self._state: Optional[_GroupState] = None

    def _setup(self) -> _GroupState:
        found = get_layers_from_vllm_config(self.vllm_config, Attention, self.layer_names)
        names = [n for n in self.layer_names if n in found]
        impls = [found[n].impl for n in names]
        if not impls or not all(isinstance(i, AttnVllmImpl) for i in impls):
            raise InvalidArgumentError("layer_names", "attention layers built by attn-vllm", names)
        first = impls[0]
        backends = {i.backend_name for i in impls}
        if len(backends) != 1:
            raise InvalidArgumentError("attn backends", "one attn backend per KV-cache group", sorted(backends))
        pool = EngineKVPool.from_fused([found[n].kv_cache for n in names], kv_order="HND")
        sched, model = self.vllm_config.scheduler_config, self.vllm_config.model_config
        batches = EngineBatches(
            pool, max_requests=sched.max_num_seqs, max_context_len=model.max_model_len, device=self.device
        )
        windows = [i.sliding_window for i in impls if i.sliding_window]
        ctx = BackendContext(
            device=self.device,
            dtype=model.dtype,
            num_q_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_size,
            page_size=pool.page_size,
            max_batch_size=sched.max_num_seqs,
            max_context_len=batches.req_to_token_pool.max_context_len,
            req_to_token_pool=batches.req_to_token_pool,
            token_to_kv_pool=pool,
            sliding_window_size=max(windows) if windows else None,
            features=frozenset({Feature.SINKS} if any(i.sinks is not None for i in impls) else ()),
            forward_modes=VLLM_MODES,
            validation=os.environ.get(VALIDATION_ENV, "basic"),
        )
        backend = create_backend(first.backend_name, ctx)
        layers = {}
        for lid, (name, impl) in enumerate(zip(names, impls)):
            alayer = AttentionLayer(
                lid,
                impl.num_heads,
                impl.num_kv_heads,
                impl.head_size,
                scaling=impl.scale,
                logit_cap=impl.logit_cap,
                sliding_window_size=impl.sliding_window,
            )
            layers[name] = (lid, alayer)
        STATS.backends.add(first.backend_name)
        STATS.pools.append(pool.describe())
        return _GroupState(pool, batches, backend, layers)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> AttnVllmMetadata:
        st = self._state = self._state or self._setup()
        cm = common_attn_metadata
        seq_cpu = cm.seq_lens_cpu_upper_bound if cm.seq_lens_cpu_upper_bound is not None else cm.seq_lens.cpu()
        batch = st.batches.build(
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            query_start_loc_cpu=cm.query_start_loc_cpu,
            seq_lens_cpu=seq_cpu,
            attn_backend=st.backend,
        )
        st.backend.init_forward_metadata(batch)
        STATS.steps += 1
        STATS.modes[batch.forward_mode.name] = STATS.modes.get(batch.forward_mode.name, 0) + 1
        return AttnVllmMetadata(batch, st.backend, st.pool, st.layers)
