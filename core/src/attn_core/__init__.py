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
    "AttnError": "attn_core.contract.errors",
    "InvalidArgumentError": "attn_core.contract.errors",
    "UnsupportedFeatureError": "attn_core.contract.errors",
    "KVCacheError": "attn_core.contract.errors",
    "InvalidBatchError": "attn_core.contract.errors",
    "StaleMetadataError": "attn_core.contract.errors",
    "DeviceIndexError": "attn_core.contract.errors",
    "DeviceFaultError": "attn_core.contract.errors",
    "StaleRequestError": "attn_core.contract.errors",
    "GraphShapeError": "attn_core.contract.errors",
    "RegistryError": "attn_core.contract.errors",
    "UnknownBackendError": "attn_core.contract.errors",
    "BackendNotInstalledError": "attn_core.contract.errors",
    "BackendUnavailableError": "attn_core.contract.errors",
    "IncompatibleBackendError": "attn_core.contract.errors",
    "NoBackendError": "attn_core.contract.errors",
    "ApiVersionMismatchError": "attn_core.contract.errors",
    "DuplicateBackendError": "attn_core.contract.errors",
    "BackendLoadError": "attn_core.contract.errors",
    "InvalidSpecError": "attn_core.contract.errors",
    "HookPluginError": "attn_core.contract.errors",
    "ForwardMode": "attn_core.contract.forward_mode",
    "Capabilities": "attn_core.contract.capabilities",
    "CudaGraphLevel": "attn_core.contract.capabilities",
    "Feature": "attn_core.contract.capabilities",
    "Requirements": "attn_core.contract.capabilities",
    "BackendSpec": "attn_core.contract.spec",
    "API_VERSION": "attn_core.contract.spec",
    "list_backends": "attn_core.discovery.registry",
    "get_backend_class": "attn_core.discovery.registry",
    "create_backend": "attn_core.discovery.registry",
    "select_backend": "attn_core.discovery.registry",
    "explain_selection": "attn_core.discovery.registry",
    "PhasePriority": "attn_core.discovery.selection",
    "Selection": "attn_core.discovery.selection",
    "explain": "attn_core.discovery.registry",
    "register_backend": "attn_core.discovery.registry",
    # torch-backed
    "AttentionBackend": "attn_core.contract.backend",
    "BackendContext": "attn_core.contract.context",
    "dtype_name": "attn_core.contract.context",
    "AttentionLayer": "attn_core.contract.layer",
    "AttentionType": "attn_core.contract.layer",
    "RaggedBatch": "attn_core.contract.ragged",
    "ragged_batch": "attn_core.contract.ragged",
    "ragged_batch_from_cu_seqlens": "attn_core.contract.ragged",
    "ragged_context": "attn_core.contract.ragged",
    "VisionAttention": "attn_core.vision.attention",
    "vision_backend": "attn_core.vision.attention",
    "update_vit_attn_dummy_heads_config": "attn_core.vision.utils",
    "pad_vit_attn_dummy_heads": "attn_core.vision.utils",
    "ForwardBatch": "attn_core.contract.batch",
    "SpecInfo": "attn_core.contract.batch",
    "Request": "attn_core.engine.requests",
    "RequestPool": "attn_core.engine.requests",
    "build_step": "attn_core.engine.step_builder",
    "step_mode": "attn_core.engine.step_builder",
    "chain_verify_mask": "attn_core.engine.step_builder",
    "positions_from_lens": "attn_core.batching.positions",
    "extend_start_loc_from_lens": "attn_core.batching.positions",
    "ReqToTokenPool": "attn_core.memory",
    "TokenAllocator": "attn_core.memory",
    "PagedTokenAllocator": "attn_core.memory",
    "KVSlotError": "attn_core.memory",
    "PageTailError": "attn_core.memory",
    "MHATokenToKVPool": "attn_core.memory",
    "MLATokenToKVPool": "attn_core.memory",
    "EngineKVPool": "attn_core.memory",
    "EngineBatches": "attn_core.engine.engine_batch",
    "merge_state": "attn_core.ops.merge_state",
    "HybridAttnBackend": "attn_core.wrappers.hybrid",
    "TboAttnBackend": "attn_core.wrappers.tbo",
    "MultiStepDraftBackend": "attn_core.wrappers.multi_step_draft",
    "CudaGraphRunner": "attn_core.engine.graph_runner",
    "CudaGraphStep": "attn_core.contract.graph_step",
    "GraphPadding": "attn_core.contract.graph_step",
    "graph_padding": "attn_core.contract.graph_step",
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
