"""Building blocks for a spec's `probe()`: each returns None when the check passes, else the reason.

Import-light: torch is imported only inside the checks that need it, when a probe runs.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Callable, Optional

Check = Callable[[], Optional[str]]


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """CPU feature flags of this machine from /proc/cpuinfo (empty where that file does not exist)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def module_missing(module: str, install_hint: str) -> Optional[str]:
    """Reason when `module` cannot be imported, e.g. "triton not installed (pip install attn-triton)"."""
    if importlib.util.find_spec(module) is None:
        return f"{module} not installed ({install_hint})"
    return None


def triton_interpreter_enabled() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


#: device nodes of the GPU drivers torch can use: NVIDIA, AMD ROCm, and WSL's GPU paravirtualization
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def gpu_device_present(nodes: tuple[str, ...] = GPU_DEVICE_NODES) -> bool:
    """Whether this machine exposes a GPU driver's device node (one `os.path.exists` per node, no torch
    import). False means torch can see no CUDA or ROCm device, so a probe can say so without paying for
    `import torch` (seconds, cold); True means "ask torch". Example: on a CPU-only container,
    `gpu_device_present()` is False and `needs_cuda()` returns its reason without importing torch."""
    return any(os.path.exists(node) for node in nodes)


def needs_cuda() -> Optional[str]:
    """None when torch sees a CUDA (or ROCm) device, else why not; imports torch only where a GPU
    device node exists."""
    if module_missing("torch", "pip install torch"):
        return "needs torch"
    if not gpu_device_present():
        return "needs CUDA (no GPU device on this machine)"
    import torch

    if not torch.cuda.is_available():
        return "needs CUDA (no CUDA device visible to torch)"
    return None


def needs_compute_capability(minimum: tuple[int, int], maximum: Optional[tuple[int, int]] = None) -> Check:
    """A check that the current CUDA device's compute capability is within [minimum, maximum]."""

    def check() -> Optional[str]:
        reason = needs_cuda()
        if reason:
            return reason
        import torch

        cc = torch.cuda.get_device_capability()
        found = f"{cc[0]}.{cc[1]}"
        if maximum is not None and minimum[0] == maximum[0] and not minimum <= cc <= maximum:
            return f"needs compute capability {minimum[0]}.x, found {found}"
        if cc < minimum:
            return f"needs compute capability >= {minimum[0]}.{minimum[1]}, found {found}"
        if maximum is not None and cc > maximum:
            return f"needs compute capability <= {maximum[0]}.{maximum[1]}, found {found}"
        return None

    return check


def first_reason(*checks: Check) -> Optional[str]:
    """Run checks in order; the first reason wins."""
    for check in checks:
        reason = check()
        if reason:
            return reason
    return None
