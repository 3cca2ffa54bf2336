"""Build the C++ kernels on first use and load them (torch.utils.cpp_extension + ninja).

The build lives in ``$ATTN_CPU_AMX_CACHE`` (default ``~/.cache/attn_cpu_amx``) under a folder named by
the torch version, the Python version and a hash of the sources and flags, so a changed source, torch
or Python never reuses a stale build. Later processes load the cached library in well under a second.
Every file is compiled for the baseline ISA of the compiler; the AVX-512 and AMX kernels turn their
ISA on per file with ``#pragma GCC target``, so one build serves every x86-64 CPU.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Optional

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("bindings.cpp", "portable.cpp", "avx512.cpp", "amx.cpp")
HEADERS = ("common.h", "loop.h", "avx512_math.h")
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)
CACHE_ENV = "ATTN_CPU_AMX_CACHE"


@dataclass(frozen=True)
class BuildInfo:
    directory: Path
    seconds: float  # wall time of the load call (compiling included when it compiled)
    compiled: bool


_last: Optional[BuildInfo] = None


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "attn_cpu_amx")


def source_digest() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    """The cache folder of this source / torch / Python combination (reads no torch module)."""
    torch_version = importlib.metadata.version("torch")
    tag = f"torch{torch_version}-py{sys.version_info.major}{sys.version_info.minor}-{source_digest()}"
    return cache_root() / tag


def missing_tools() -> Optional[str]:
    """Why the kernels cannot be built here (None when a C++ compiler and ninja are on PATH)."""
    if shutil.which(os.environ.get("CXX", "c++")) is None and shutil.which("g++") is None:
        return "no C++ compiler on PATH (install g++ >= 11)"
    if shutil.which("ninja") is None:
        return "ninja not found (pip install ninja)"
    return None


def is_built() -> bool:
    d = build_dir()
    return d.is_dir() and any(d.glob("*.so"))


@functools.lru_cache(maxsize=1)
def load_kernels() -> ModuleType:
    """The compiled kernels module (built into the cache on first use)."""
    global _last
    from torch.utils import cpp_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    compiled = not any(directory.glob("*.so"))
    start = time.perf_counter()
    module = cpp_extension.load(
        name=f"attn_cpu_amx_kernels_{source_digest()[:8]}",
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        extra_include_paths=[str(CSRC)],
        build_directory=str(directory),
        verbose=False,
    )
    _last = BuildInfo(directory, time.perf_counter() - start, compiled)
    return module


def last_build() -> Optional[BuildInfo]:
    """Where and how long the last `load_kernels` took (None before the first call)."""
    return _last
