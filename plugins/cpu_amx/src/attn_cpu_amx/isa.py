"""Which kernel path this CPU runs, decided from /proc/cpuinfo flags without importing torch.

Paths, best first:
- ``amx``: bf16 matrix products on AMX tiles (needs amx_tile, amx_bf16, avx512_bf16 and the AVX-512
  base set, plus Linux's permission for tile state); float32 calls on this path run the AVX-512 kernels,
  because AMX has no float32 product.
- ``avx512``: float32 math on 512-bit FMAs (avx512f/bw/vl/dq); bf16 K/V are widened per block.
- ``portable``: plain C++ for any CPU the compiler targets.

``ATTN_CPU_AMX_ISA`` (or the backend option ``isa``) forces a path: ``auto`` (default), ``amx``,
``avx512`` or ``portable``. Forcing a path this CPU cannot run is an error, never a silent fallback.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from typing import Optional

from attn_core.discovery.probes import cpu_flags

PATHS = ("amx", "avx512", "portable")
PATH_IDS = {"portable": 0, "avx512": 1, "amx": 2}
ENV_VAR = "ATTN_CPU_AMX_ISA"
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
AMX_FLAGS = AVX512_FLAGS | {"avx512_bf16", "amx_tile", "amx_bf16"}
_SYS_ARCH_PRCTL = 158  # x86-64 syscall number
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.lru_cache(maxsize=1)
def amx_permission() -> bool:
    """Ask Linux for AMX tile state for this process (idempotent); True when granted."""
    if not is_x86_64() or platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def runnable_paths(flags: Optional[frozenset[str]] = None, amx_granted: Optional[bool] = None) -> tuple[str, ...]:
    """Paths this CPU can run, best first (`flags` / `amx_granted` default to this machine's)."""
    x86 = is_x86_64() if flags is None else True
    flags = cpu_flags() if flags is None else flags
    out = []
    if x86 and AMX_FLAGS <= flags and (amx_permission() if amx_granted is None else amx_granted):
        out.append("amx")
    if x86 and AVX512_FLAGS <= flags:
        out.append("avx512")
    out.append("portable")
    return tuple(out)


def requested_path(option: Optional[str] = None) -> str:
    """The path asked for: the `isa` option, else $ATTN_CPU_AMX_ISA, else "auto" (lower-cased)."""
    value = option if option is not None else os.environ.get(ENV_VAR, "auto")
    return value.strip().lower() or "auto"


def choose_path(
    requested: str = "auto", runnable: Optional[tuple[str, ...]] = None
) -> tuple[Optional[str], Optional[str]]:
    """(path, None) for the path to run, or (None, reason) when `requested` cannot run here."""
    runnable = runnable_paths() if runnable is None else runnable
    if requested == "auto":
        return runnable[0], None
    if requested not in PATHS:
        return None, f"{ENV_VAR}/isa={requested!r} is not one of auto, {', '.join(PATHS)}"
    if requested not in runnable:
        missing = sorted((AMX_FLAGS if requested == "amx" else AVX512_FLAGS) - cpu_flags())
        why = f"missing CPU flags {missing}" if missing else "the OS did not grant AMX tile state"
        return None, f"path {requested!r} cannot run on this CPU ({why}); runnable: {', '.join(runnable)}"
    return requested, None


def kernel_path(path: str, q_dtype: str, kv_dtype: str, head_dim: int, v_head_dim: int) -> str:
    """The kernels a call runs on `path`: AMX only for bf16 q and K/V with head dims that are multiples
    of 32; otherwise the AVX-512 kernels stand in on an AMX machine."""
    if path == "amx" and not (q_dtype == kv_dtype == "bfloat16" and head_dim % 32 == 0 and v_head_dim % 32 == 0):
        return "avx512"
    return path


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The "model name" line of /proc/cpuinfo (or platform.processor())."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(requested: Optional[str] = None) -> str:
    """One line for `attn-core list`: CPU, ISA flags found, the path chosen (per dtype)."""
    flags = cpu_flags()
    found = sorted(f for f in flags if f in AMX_FLAGS) or ["no AVX-512/AMX"]
    path, reason = choose_path(requested_path(requested))
    chosen = reason if path is None else ("path amx (bf16), avx512 (fp32)" if path == "amx" else f"path {path}")
    return f"{cpu_model()}; isa {' '.join(found)}; {chosen}; {os.cpu_count()} cpus"
