"""attn-core: the attention-backend contract, KV-cache types, registry and reference backend.

`import attn_core` is light: torch is imported only when a torch-backed name is first used, so listing
backends costs no torch import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

# The same names for type checkers (mypy, pyright), which do not run `__getattr__`: nothing is imported at
# run time; `X as X` marks each as re-exported (PEP 484).
if TYPE_CHECKING:
    from attn_core.batching.positions import (
        extend_start_loc_from_lens as extend_start_loc_from_lens,
    )
    from attn_core.batching.positions import (
        positions_from_lens as positions_from_lens,
    )
    from attn_core.contract.backend import AttentionBackend as AttentionBackend
    from attn_core.contract.batch import ForwardBatch as ForwardBatch
    from attn_core.contract.batch import SpecInfo as SpecInfo
    from attn_core.contract.capabilities import (
        Capabilities as Capabilities,
    )
    from attn_core.contract.capabilities import (
        CudaGraphLevel as CudaGraphLevel,
    )
    from attn_core.contract.capabilities import (
        Feature as Feature,
    )
    from attn_core.contract.capabilities import (
        Requirements as Requirements,
    )
    from attn_core.contract.context import BackendContext as BackendContext
    from attn_core.contract.context import dtype_name as dtype_name
    from attn_core.contract.errors import (
        ApiVersionMismatchError as ApiVersionMismatchError,
    )
    from attn_core.contract.errors import (
        AttnError as AttnError,
    )
    from attn_core.contract.errors import (
        BackendLoadError as BackendLoadError,
    )
    from attn_core.contract.errors import (
        BackendNotInstalledError as BackendNotInstalledError,
    )
    from attn_core.contract.errors import (
        BackendUnavailableError as BackendUnavailableError,
    )
    from attn_core.contract.errors import (
        DeviceFaultError as DeviceFaultError,
    )
    from attn_core.contract.errors import (
        DeviceIndexError as DeviceIndexError,
    )
    from attn_core.contract.errors import (
        DuplicateBackendError as DuplicateBackendError,
    )
    from attn_core.contract.errors import (
        GraphShapeError as GraphShapeError,
    )
    from attn_core.contract.errors import (
        HookPluginError as HookPluginError,
    )
    from attn_core.contract.errors import (
        IncompatibleBackendError as IncompatibleBackendError,
    )
    from attn_core.contract.errors import (
        InvalidArgumentError as InvalidArgumentError,
    )
    from attn_core.contract.errors import (
        InvalidBatchError as InvalidBatchError,
    )
    from attn_core.contract.errors import (
        InvalidSpecError as InvalidSpecError,
    )
    from attn_core.contract.errors import (
        KVCacheError as KVCacheError,
    )
    from attn_core.contract.errors import (
        NoBackendError as NoBackendError,
    )
    from attn_core.contract.errors import (
        RegistryError as RegistryError,
    )
    from attn_core.contract.errors import (
        StaleMetadataError as StaleMetadataError,
    )
    from attn_core.contract.errors import (
        StaleRequestError as StaleRequestError,
    )
    from attn_core.contract.errors import (
        UnknownBackendError as UnknownBackendError,
    )
    from attn_core.contract.errors import (
        UnsupportedFeatureError as UnsupportedFeatureError,
    )
    from attn_core.contract.forward_mode import ForwardMode as ForwardMode
    from attn_core.contract.graph_step import (
        CudaGraphStep as CudaGraphStep,
    )
    from attn_core.contract.graph_step import (
        GraphPadding as GraphPadding,
    )
    from attn_core.contract.graph_step import (
        graph_padding as graph_padding,
    )
    from attn_core.contract.layer import AttentionLayer as AttentionLayer
    from attn_core.contract.layer import AttentionType as AttentionType
    from attn_core.contract.ragged import (
        RaggedBatch as RaggedBatch,
    )
    from attn_core.contract.ragged import (
        ragged_batch as ragged_batch,
    )
    from attn_core.contract.ragged import (
        ragged_batch_from_cu_seqlens as ragged_batch_from_cu_seqlens,
    )
    from attn_core.contract.ragged import (
        ragged_context as ragged_context,
    )
    from attn_core.contract.spec import API_VERSION as API_VERSION
    from attn_core.contract.spec import BackendSpec as BackendSpec
    from attn_core.discovery.registry import (
        create_backend as create_backend,
    )
    from attn_core.discovery.registry import (
        explain as explain,
    )
    from attn_core.discovery.registry import (
        explain_selection as explain_selection,
    )
    from attn_core.discovery.registry import (
        get_backend_class as get_backend_class,
    )
    from attn_core.discovery.registry import (
        list_backends as list_backends,
    )
    from attn_core.discovery.registry import (
        register_backend as register_backend,
    )
    from attn_core.discovery.registry import (
        select_backend as select_backend,
    )
    from attn_core.discovery.selection import PhasePriority as PhasePriority
    from attn_core.discovery.selection import Selection as Selection
    from attn_core.engine.engine_batch import EngineBatches as EngineBatches
    from attn_core.engine.graph_runner import CudaGraphRunner as CudaGraphRunner
    from attn_core.engine.requests import Request as Request
    from attn_core.engine.requests import RequestPool as RequestPool
    from attn_core.engine.step_builder import (
        build_step as build_step,
    )
    from attn_core.engine.step_builder import (
        chain_verify_mask as chain_verify_mask,
    )
    from attn_core.engine.step_builder import (
        step_mode as step_mode,
    )
    from attn_core.memory import (
        EngineKVPool as EngineKVPool,
    )
    from attn_core.memory import (
        KVSlotError as KVSlotError,
    )
    from attn_core.memory import (
        MHATokenToKVPool as MHATokenToKVPool,
    )
    from attn_core.memory import (
        MLATokenToKVPool as MLATokenToKVPool,
    )
    from attn_core.memory import (
        PagedTokenAllocator as PagedTokenAllocator,
    )
    from attn_core.memory import (
        PageTailError as PageTailError,
    )
    from attn_core.memory import (
        ReqToTokenPool as ReqToTokenPool,
    )
    from attn_core.memory import (
        TokenAllocator as TokenAllocator,
    )
    from attn_core.ops.merge_state import merge_state as merge_state
    from attn_core.vision.attention import VisionAttention as VisionAttention
    from attn_core.vision.attention import vision_backend as vision_backend
    from attn_core.vision.utils import (
        pad_vit_attn_dummy_heads as pad_vit_attn_dummy_heads,
    )
    from attn_core.vision.utils import (
        update_vit_attn_dummy_heads_config as update_vit_attn_dummy_heads_config,
    )
    from attn_core.wrappers.hybrid import HybridAttnBackend as HybridAttnBackend
    from attn_core.wrappers.multi_step_draft import MultiStepDraftBackend as MultiStepDraftBackend
    from attn_core.wrappers.tbo import TboAttnBackend as TboAttnBackend

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
