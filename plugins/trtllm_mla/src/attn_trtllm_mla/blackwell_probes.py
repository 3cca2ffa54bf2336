"""Probe checks shared by `trtllm_mha` and `cutlass_mla` (import-light: no torch until a GPU device exists).

Each returns None when it passes, else the reason `attn-core list` shows. Example on an H100:
`needs_sm100()` -> "needs compute capability 10.x, found 9.0"; on a machine without a GPU:
"needs CUDA (no GPU device on this machine)".
"""

from __future__ import annotations

import importlib.util
from typing import Optional

from attn_core.discovery.probes import needs_compute_capability

#: Blackwell datacenter GPUs (SM100 / SM103): where the trtllm-gen MHA and the CUTLASS MLA kernels run
needs_sm100 = needs_compute_capability((10, 0), (10, 9))


def flashinfer_missing() -> Optional[str]:
    """Reason when flashinfer-python cannot be imported."""
    if importlib.util.find_spec("flashinfer") is None:
        return "not installed: pip install attn-trtllm-mla (flashinfer-python >= 0.6.6; a CUDA build of torch first)"
    return None


def sgl_kernel_missing() -> Optional[str]:
    """Reason when sgl-kernel (the CUTLASS MLA decode kernel's package) cannot be imported."""
    if importlib.util.find_spec("sgl_kernel") is None:
        return "not installed: pip install 'attn-trtllm-mla[cutlass]' (sgl-kernel; a CUDA build of torch first)"
    return None
