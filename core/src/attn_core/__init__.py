"""attn-core: the attention-backend contract, KV-cache types, registry and reference backend.

`import attn_core` is light: torch is imported only when a torch-backed name is first used, so listing
backends costs no torch import.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (loaded on first access)
_EXPORTS = {
    # torch-free
    "AttnError": "attn_core.errors",
    "InvalidArgumentError": "attn_core.errors",
    "UnsupportedFeatureError": "attn_core.errors",
    "KVCacheError": "attn_core.errors",
    "InvalidBatchError": "attn_core.errors",
    "StaleMetadataError": "attn_core.errors",
    "DeviceIndexError": "attn_core.errors",
    "RegistryError": "attn_core.errors",
    "UnknownBackendError": "attn_core.errors",
    "BackendNotInstalledError": "attn_core.errors",
    "BackendUnavailableError": "attn_core.errors",
    "IncompatibleBackendError": "attn_core.errors",
    "NoBackendError": "attn_core.errors",
    "ApiVersionMismatchError": "attn_core.errors",
    "DuplicateBackendError": "attn_core.errors",
    "BackendLoadError": "attn_core.errors",
    "InvalidSpecError": "attn_core.errors",
    "HookPluginError": "attn_core.errors",
    "ForwardMode": "attn_core.forward_mode",
    "Capabilities": "attn_core.capabilities",
    "CudaGraphLevel": "attn_core.capabilities",
    "Feature": "attn_core.capabilities",
    "Requirements": "attn_core.capabilities",
    "BackendSpec": "attn_core.spec",
    "API_VERSION": "attn_core.spec",
    "list_backends": "attn_core.registry",
    "get_backend_class": "attn_core.registry",
    "create_backend": "attn_core.registry",
    "select_backend": "attn_core.registry",
    "explain_selection": "attn_core.registry",
    "PhasePriority": "attn_core.selection",
    "Selection": "attn_core.selection",
    "explain": "attn_core.registry",
    "register_backend": "attn_core.registry",
    # torch-backed
    "AttentionBackend": "attn_core.backend",
    "BackendContext": "attn_core.context",
    "dtype_name": "attn_core.context",
    "AttentionLayer": "attn_core.layer",
    "AttentionType": "attn_core.layer",
    "RaggedBatch": "attn_core.ragged",
    "ragged_batch": "attn_core.ragged",
    "ragged_batch_from_cu_seqlens": "attn_core.ragged",
    "ragged_context": "attn_core.ragged",
    "VisionAttention": "attn_core.vision",
    "vision_backend": "attn_core.vision",
    "update_vit_attn_dummy_heads_config": "attn_core.vision_utils",
    "pad_vit_attn_dummy_heads": "attn_core.vision_utils",
    "ForwardBatch": "attn_core.batch",
    "SpecInfo": "attn_core.batch",
    "Request": "attn_core.requests",
    "RequestPool": "attn_core.requests",
    "build_step": "attn_core.step_builder",
    "step_mode": "attn_core.step_builder",
    "chain_verify_mask": "attn_core.step_builder",
    "positions_from_lens": "attn_core.positions",
    "extend_start_loc_from_lens": "attn_core.positions",
    "RequestShape": "attn_core.batch_builder",
    "build_forward_batch": "attn_core.batch_builder",
    "release_forward_batch": "attn_core.batch_builder",
    "ReqToTokenPool": "attn_core.memory",
    "TokenAllocator": "attn_core.memory",
    "PagedTokenAllocator": "attn_core.memory",
    "KVSlotError": "attn_core.memory",
    "PageTailError": "attn_core.memory",
    "MHATokenToKVPool": "attn_core.memory",
    "MLATokenToKVPool": "attn_core.memory",
    "EngineKVPool": "attn_core.memory",
    "EngineBatches": "attn_core.engine_batch",
    "merge_state": "attn_core.ops.merge_state",
    "HybridAttnBackend": "attn_core.wrappers.hybrid",
    "TboAttnBackend": "attn_core.wrappers.tbo",
    "MultiStepDraftBackend": "attn_core.wrappers.multi_step_draft",
    "CudaGraphRunner": "attn_core.graph_runner",
    "CudaGraphStep": "attn_core.graph_step",
    "GraphPadding": "attn_core.graph_step",
    "graph_padding": "attn_core.graph_step",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'attn_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
