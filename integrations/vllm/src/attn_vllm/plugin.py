"""vLLM's entry points (pyproject: `vllm.general_plugins` and `vllm.platform_plugins`).

- `register()` (every vLLM process): vLLM's `AttentionBackendEnum.CUSTOM` becomes
  `attn_vllm.backend.AttnVllmBackend`. A vLLM release other than `TESTED_VLLM` gets a warning.
- `cpu_platform()` (platform detection): on vLLM's CPU build, whose platform never hands out CUSTOM
  (it logs "Cannot use ... on CPU" and returns its own backend), the same CPU platform but honouring
  CUSTOM (`attn_vllm.platform.AttnCpuPlatform`); elsewhere None (CUDA honours CUSTOM itself). vLLM skips
  platform plugins while `VLLM_TARGET_DEVICE=cpu` is set: leave it unset to select CUSTOM on the CPU.
"""

from __future__ import annotations

import logging
from typing import Optional

from attn_vllm import TESTED_VLLM

BACKEND_PATH = "attn_vllm.backend.AttnVllmBackend"
CPU_PLATFORM = "vllm.platforms.cpu.CpuPlatform"
ATTN_CPU_PLATFORM = "attn_vllm.platform.AttnCpuPlatform"

logger = logging.getLogger("attn_vllm")


def register() -> None:
    """Register attn as vLLM's CUSTOM attention backend (idempotent)."""
    import vllm
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(TESTED_VLLM):
        logger.warning("attn-vllm is tested against vLLM %s; this is vLLM %s", TESTED_VLLM, version)
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)


def cpu_platform() -> Optional[str]:
    """The CPU platform that honours CUSTOM, on vLLM's CPU build (where vLLM's own detection finds
    `CpuPlatform`); None on any other platform."""
    from vllm.platforms import cpu_platform_plugin

    return ATTN_CPU_PLATFORM if cpu_platform_plugin() == CPU_PLATFORM else None
