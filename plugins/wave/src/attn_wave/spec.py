"""Registry entry of attn-wave (import-light: no torch, never wave_lang; the probe imports them only on a
machine with an AMD GPU device).

Never ran on hardware: no AMD GPU was available to this project. See README.md for what was verified
(against an emulation of Wave's documented attention templates, on the CPU) and what only an AMD GPU can
settle.
"""

from __future__ import annotations

import importlib.util
from typing import Callable, Optional

from attn_core.contract.capabilities import ARCH_MHA, Capabilities, CudaGraphLevel, Feature
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.spec import BackendSpec
from attn_core.discovery.probes import first_reason, needs_rocm

UNVERIFIED = (
    "its Wave kernels never ran on hardware: verified only against an emulation of Wave's documented attention "
    "templates (paged decode, extend), not on an AMD GPU; the Wave compiler itself never ran"
)
INSTALL = "pip install 'attn-wave[rocm]'"
NOT_INSTALLED = f"not installed: {INSTALL} (Wave, the wave-lang package)"

CAPABILITIES = Capabilities(
    devices=frozenset({"cuda"}),  # ROCm builds of torch name AMD GPUs "cuda"
    q_dtypes=frozenset({"bfloat16", "float16"}),
    kv_dtypes=frozenset({"bfloat16", "float16"}),
    archs=frozenset({ARCH_MHA}),
    head_dims=frozenset({64, 128}),
    page_sizes=None,  # the kernels read slot lists (pages of one token): any page size
    forward_modes=frozenset(
        {
            ForwardMode.EXTEND,
            ForwardMode.DECODE,
            ForwardMode.MIXED,
            ForwardMode.IDLE,
            ForwardMode.TARGET_VERIFY,
            ForwardMode.DRAFT_EXTEND,
            ForwardMode.DUMMY_FIRST,
        }
    ),
    features=frozenset({Feature.CUSTOM_MASK}),
    cuda_graph=CudaGraphLevel.NEVER,  # Wave's own runtime launches its kernels: graph capture not claimed
)


def wave_missing() -> Optional[str]:
    """None when wave_lang is installed, else the install command."""
    return None if importlib.util.find_spec("wave_lang") is not None else NOT_INSTALLED


def probe(checks: tuple[Callable[[], Optional[str]], ...] = (needs_rocm, wave_missing)) -> Optional[str]:
    """None when the backend can run here, else why not: no AMD GPU under a ROCm torch, wave-lang missing."""
    return first_reason(*checks)


def info() -> str:
    """Shown next to "available": how far the backend is verified."""
    return UNVERIFIED


SPEC = BackendSpec(
    name="wave",
    summary="AMD Wave (wave-lang) paged decode and extend attention kernels (never ran on an AMD GPU)",
    capabilities=CAPABILITIES,
    distribution="attn-wave",
    backend_class="attn_wave.backend:WaveBackend",
    priority=5,  # below attn-triton, which serves ROCm too: ask for wave by name
    probe_fn=probe,
    info_fn=info,
    unverified=UNVERIFIED,
)
