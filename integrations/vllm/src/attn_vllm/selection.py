"""Which attn backend vLLM's CUSTOM backend runs, and what it must declare.

`requirements(...)` states, as attn `Requirements`, what one vLLM attention layer asks of a backend:
device, dtypes, head dim, page size (vLLM's block size), the features the layer uses (sliding window,
sinks, logit cap), the step modes vLLM produces (EXTEND, DECODE, MIXED) and an engine-owned KV pool.
`backend_for(...)` names the backend: `$ATTN_VLLM_BACKEND`, else `attn_core.select_backend`; a named
backend that cannot serve the layer raises attn's typed error (`IncompatibleBackendError`,
`BackendUnavailableError`, ...) when vLLM builds the model, before any step runs.
"""

from __future__ import annotations

import os
from typing import Optional

from attn_core.contract.capabilities import Capabilities, Feature, Requirements
from attn_core.contract.forward_mode import ForwardMode
from attn_core.discovery.registry import default_registry
from attn_vllm import BACKEND_ENV

#: the step modes vLLM's scheduler produces (chunked prefill mixes decodes and prefill chunks)
VLLM_MODES = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED})

#: vLLM 0.32 KV cache layouts (`vllm.v1.kv_cache_layout.KVCacheLayout` names) by the view attn gets of a
#: layer's K: one run of slots per page (`EngineKVPool` "NHD") or pages read through an HND view
NHD_LAYOUTS = ("LBNHC",)
HND_LAYOUTS = ("LBHNC", "BLHNC", "BLNHC", "BHLNC")


def requirements(
    *,
    device_type: str,
    dtype_name: str,
    head_dim: int,
    page_size: int,
    sliding_window: Optional[int] = None,
    sinks: bool = False,
    logit_cap: float = 0.0,
    kv_layout: str = "HND",
    compute_capability: Optional[tuple[int, int]] = None,
    cpu_flags: Optional[frozenset[str]] = None,
) -> Requirements:
    """What a vLLM decoder attention layer with these settings needs from an attn backend."""
    features = set()
    if sliding_window:
        features.add(Feature.SLIDING_WINDOW)
    if sinks:
        features.add(Feature.SINKS)
    if logit_cap:
        features.add(Feature.LOGIT_CAP)
    return Requirements(
        device_type=device_type,
        compute_capability=compute_capability,
        cpu_flags=cpu_flags,
        q_dtype=dtype_name,
        kv_dtype=dtype_name,
        head_dim=head_dim,
        page_size=page_size,
        features=frozenset(features),
        forward_modes=VLLM_MODES,
        kv_layout=kv_layout,
        engine_kv=True,
    )


def backend_for(req: Requirements, name: Optional[str] = None) -> str:
    """The attn backend for `req`: `name`, else `$ATTN_VLLM_BACKEND`, else the registry's choice.
    A named backend is checked (typed error listing every reason it cannot serve `req`)."""
    name = name or os.environ.get(BACKEND_ENV) or None
    registry = default_registry()
    if name is None:
        return registry.select_backend(req)
    return registry.check(name, req).name


def engine_layouts(caps: Capabilities) -> tuple[str, ...]:
    """vLLM KV cache layouts (names) a backend with `caps` reads in place, NHD views first.
    Example: engine_kv_layouts {"NHD", "HND"} -> ("LBNHC", "LBHNC", "BLHNC", "BLNHC", "BHLNC")."""
    out: tuple[str, ...] = ()
    if "NHD" in caps.engine_kv_layouts:
        out += NHD_LAYOUTS
    if "HND" in caps.engine_kv_layouts:
        out += HND_LAYOUTS
    return out
