"""Build the C++ kernels on first use and load them (torch.utils.cpp_extension + ninja).

Every file is compiled for the baseline ISA of the compiler; the AVX-512 and AMX kernels turn their ISA
on per file with ``#pragma GCC target``, so one build serves every x86-64 CPU.

The cache
---------
The build lives in ``$ATTN_CPU_AMX_CACHE`` (default ``~/.cache/attn_cpu_amx``), in a folder named by
the cache key: a hash of the sources and headers (by file name and content), the flags, the compiler's
version line, torch's version, the Python ABI tag and the machine type. No path enters the key, so two
checkouts or virtual environments with the same sources, compiler, torch and flags share one build, and a
changed source, compiler, torch or Python never reuses a stale one. Folders are created 0700 (the
library is code this process will run). A key folder holds:

- ``attn_cpu_amx_kernels_<key>.so``: the library, and ``....so.sha256``: its hash, recorded when it was
  built. The hash is checked before every load; a library that is missing, truncated or altered is
  rebuilt, never loaded (loading a truncated library kills the process with SIGBUS).
- ``build.lock``: builds take an OS lock on it (``fcntl.flock``). The kernel releases the lock when its
  holder exits or is killed (SIGTERM, SIGKILL, OOM), so a killed build never blocks later processes; a
  process that finds a live build under way waits for it, then loads what it built.
- ``scratch-*``: the folder of a build in progress. The compiler runs in a subprocess there; the library
  is moved into place with an atomic rename and its hash written after it, so no reader ever sees half a
  library. Scratch folders left by killed builds are removed by the next build.

The first build takes 26 s on 2 cores (g++ 12); later loads take ~10 ms (hash check included).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator, Optional

from attn_core.cli.progress import working
from attn_core.contract.errors import BackendLoadError

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("bindings.cpp", "portable.cpp", "avx512.cpp", "amx.cpp")
HEADERS = ("common.h", "loop.h", "avx512_math.h")
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)
CACHE_ENV = "ATTN_CPU_AMX_CACHE"
LOCK_NAME = "build.lock"
SCRATCH_PREFIX = "scratch-"

#: A compile step: (module name, empty scratch folder) -> path of the built library inside that folder.
#: `ensure_built` takes one so tests can build a tiny stand-in library instead of the real kernels.
Compile = Callable[[str, Path], Path]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildInfo:
    directory: Path  # the key folder
    library: Path  # the verified library in it
    seconds: float  # wall time of the call (compiling included when it compiled)
    compiled: bool  # whether this call compiled (False: loaded a build already in the cache)


_last: Optional[BuildInfo] = None


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "attn_cpu_amx")


@functools.lru_cache(maxsize=1)
def compiler_id() -> str:
    """The first line of `$CXX --version` (the compiler torch's build uses), or "none"."""
    try:
        out = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "none"
    return (out.stdout.splitlines() or ["none"])[0].strip()


def cache_key() -> str:
    """Hash of everything the library depends on, no path included (reads no torch module).

    Example: the same sources, flags, compiler, torch and Python in two checkouts give the same key,
    e.g. "3f9c0a7d12e4b6a1"; editing one byte of a source or header gives another.
    """
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        content = (CSRC / name).read_bytes()
        h.update(f"{name}\0{len(content)}\0".encode())
        h.update(content)
    inputs = (" ".join(CFLAGS), " ".join(LDFLAGS), compiler_id(), importlib.metadata.version("torch"))
    h.update("\0".join(inputs + (sys.implementation.cache_tag, platform.machine())).encode())
    return h.hexdigest()[:16]


def module_name() -> str:
    """The extension's module name (its PyInit symbol), unique per cache key."""
    return f"attn_cpu_amx_kernels_{cache_key()}"


def build_dir() -> Path:
    """The cache folder of this build's key."""
    return cache_root() / cache_key()


def library_path() -> Path:
    return build_dir() / f"{module_name()}.so"


def missing_tools() -> Optional[str]:
    """Why the kernels cannot be built here (None when a C++ compiler and ninja are on PATH)."""
    if shutil.which(os.environ.get("CXX", "c++")) is None and shutil.which("g++") is None:
        return "no C++ compiler on PATH (install g++ >= 11)"
    if shutil.which("ninja") is None:
        return "ninja not found (pip install ninja)"
    return None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _hash_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def is_verified(library: Path) -> bool:
    """Whether `library` exists and its sha256 is the one recorded when it was built."""
    try:
        recorded = _hash_path(library).read_text().strip()
        return recorded == file_sha256(library)
    except OSError:
        return False


def is_built() -> bool:
    """Whether the cache holds a verified build of the current key (reads no torch module)."""
    return is_verified(library_path())


def _private_dir(path: Path) -> None:
    """Create `path` (and missing parents) with mode 0700; existing folders are left as they are."""
    if not path.parent.exists():
        _private_dir(path.parent)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold the build lock of a key folder: an `fcntl.flock` the kernel drops when this process exits
    or is killed, so a dead holder never blocks anyone."""
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process building the cpu_amx kernels in %s", directory)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


_COMPILE_SCRIPT = """
import json, sys
from torch.utils import cpp_extension
a = json.loads(sys.argv[1])
cpp_extension.load(name=a["name"], sources=a["sources"], extra_cflags=a["cflags"], extra_ldflags=a["ldflags"],
                   extra_include_paths=[a["include"]], build_directory=a["directory"], verbose=False)
"""


def compile_kernels(name: str, scratch: Path) -> Path:
    """Compile the kernels into `scratch` with torch.utils.cpp_extension + ninja, in a subprocess (so
    the build never loads anything into this process), and return the library's path."""
    args = {
        "name": name,
        "sources": [str(CSRC / s) for s in SOURCES],
        "cflags": list(CFLAGS),
        "ldflags": list(LDFLAGS),
        "include": str(CSRC),
        "directory": str(scratch),
    }
    out = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(args)], capture_output=True, text=True)
    library = scratch / f"{name}.so"
    if out.returncode != 0 or not library.is_file():
        tail = (out.stdout + out.stderr)[-4000:]
        raise BackendLoadError(
            "cpu_amx", f"compiling the kernels in {scratch}", RuntimeError(f"exit status {out.returncode}:\n{tail}")
        )
    return library


def _publish(built: Path, library: Path) -> None:
    """Move a freshly built library into place, then record its hash (readers check the hash, so a
    reader between the two steps rebuilds or waits rather than loading an unverified file)."""
    digest = file_sha256(built)
    with open(built, "rb") as f:
        os.fsync(f.fileno())
    _hash_path(library).unlink(missing_ok=True)
    os.replace(built, library)
    tmp = _hash_path(library).with_name(f"{_hash_path(library).name}.tmp{os.getpid()}")
    tmp.write_text(digest + "\n")
    os.replace(tmp, _hash_path(library))


def ensure_built(compile: Compile = compile_kernels) -> BuildInfo:
    """A verified library for the current key: the cached one when its hash checks out, else one built
    now with `compile` under the build lock (or by the process that held the lock while we waited)."""
    start = time.perf_counter()
    directory = build_dir()
    _private_dir(directory)
    library = directory / f"{module_name()}.so"
    compiled = False
    if not is_verified(library):
        with build_lock(directory):
            if not is_verified(library):  # not built by another process while we waited
                if library.exists():
                    log.warning(
                        "cpu_amx kernels at %s fail their sha256 check (truncated or altered): rebuilding", library
                    )
                for stale in directory.glob(SCRATCH_PREFIX + "*"):  # left by killed builds
                    shutil.rmtree(stale, ignore_errors=True)
                scratch = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=directory))  # mode 0700
                try:
                    with working(
                        f"attn-cpu-amx: compiling the C++ kernels (first use, about 25-60 s; cached in {directory})"
                    ):
                        _publish(compile(module_name(), scratch), library)
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
                compiled = True
    return BuildInfo(directory, library, time.perf_counter() - start, compiled)


def import_library(name: str, library: Path) -> ModuleType:
    """Import the extension module `name` from the library file `library`."""
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=1)
def load_kernels() -> ModuleType:
    """The compiled kernels module (built into the cache on first use)."""
    global _last
    start = time.perf_counter()
    import torch  # noqa: F401 -- loads the torch libraries the kernels link against

    info = ensure_built()
    module = import_library(module_name(), info.library)
    _last = BuildInfo(info.directory, info.library, time.perf_counter() - start, info.compiled)
    return module


def last_build() -> Optional[BuildInfo]:
    """Where and how long the last `load_kernels` took (None before the first call)."""
    return _last
