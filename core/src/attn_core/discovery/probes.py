"""Building blocks for a spec's `probe()`: each returns None when the check passes, else the reason.
Also `TimedCheck`, which the registry uses to run a spec's probe with a time limit.

Import-light: torch is imported only inside the checks that need it, when a probe runs.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import threading
import time
from typing import Callable, Optional, Union

from attn_core.contract.errors import InvalidArgumentError

Check = Callable[[], Optional[str]]

#: Environment variable overriding the registry's time limit for one probe, in seconds.
PROBE_TIMEOUT_ENV = "ATTN_CORE_PROBE_TIMEOUT"
#: Default time limit for one probe (seconds): room for a cold `import torch` and CUDA initialisation.
DEFAULT_PROBE_TIMEOUT_S = 10.0


def probe_timeout(seconds: Optional[float] = None) -> float:
    """The time limit for one probe, in seconds: `seconds` when given, else `$ATTN_CORE_PROBE_TIMEOUT`,
    else `DEFAULT_PROBE_TIMEOUT_S`. Raises `InvalidArgumentError` unless it is a finite number > 0.

    Example: with `ATTN_CORE_PROBE_TIMEOUT=2.5` in the environment, `probe_timeout()` is 2.5 and
    `probe_timeout(30)` is 30.0.
    """
    value: Union[float, str, None]
    argument, value = "probe_timeout", seconds
    if value is None:
        argument, value = PROBE_TIMEOUT_ENV, os.environ.get(PROBE_TIMEOUT_ENV)
        if value is None or not value.strip():
            return DEFAULT_PROBE_TIMEOUT_S
    try:
        limit = float(value)
    except (TypeError, ValueError):
        limit = math.nan
    if isinstance(value, bool) or not (math.isfinite(limit) and limit > 0):
        raise InvalidArgumentError(argument, "a finite number of seconds > 0", repr(value))
    return limit


class TimedCheck:
    """One run of a check (a spec's probe or info function) in a daemon thread, so that a check that
    hangs or raises cannot hang or break its caller.

    `result(limit)` waits until `limit` seconds after `start()` at most and returns what the check
    returned, or a sentence saying what went wrong: "probe failed: SystemExit: 3" for anything it
    raised (`BaseException` included: `sys.exit` or a `KeyboardInterrupt` raised by the check itself
    is contained; a Ctrl-C from the user still reaches the main thread, which is only waiting), or
    "probe timed out after 10 s" (a later `result` returns the real answer once the thread finishes).
    The check runs once; an `os._exit` or a crash of the interpreter inside it cannot be contained.

    Example: `TimedCheck(lambda: time.sleep(60), "probe").result(0.1)` returns
    "probe timed out after 0.1 s" after 0.1 s.
    """

    def __init__(self, check: Callable[[], object], label: str = "probe"):
        self._check = check
        self._label = label
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._started_at: Optional[float] = None
        self._outcome: Optional[str] = None

    def start(self) -> None:
        """Start the check in its thread (once; later calls do nothing)."""
        with self._lock:
            if self._started_at is not None:
                return
            self._started_at = time.monotonic()
            threading.Thread(target=self._run, name=f"attn-core {self._label}", daemon=True).start()

    def _run(self) -> None:
        try:
            value = self._check()
            if value is not None and not isinstance(value, str):
                value = f"{self._label} returned {value!r} (expected None or a reason string)"
            self._outcome = value or None
        except BaseException as exc:  # contained on purpose: see the class docstring
            self._outcome = f"{self._label} failed: {type(exc).__name__}: {exc}"
        finally:
            self._done.set()

    def result(self, limit: float) -> Optional[str]:
        """What the check returned (None or a reason), or why there is no answer within `limit` s."""
        self.start()
        started = self._started_at if self._started_at is not None else time.monotonic()  # set by start()
        remaining = started + limit - time.monotonic()
        if not self._done.wait(max(remaining, 0.0)):
            return f"{self._label} timed out after {limit:g} s"
        return self._outcome


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
    """Reason when `module` cannot be imported, e.g. "triton not installed (pip install triton)"."""
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


#: device node of AMD's ROCm kernel driver (KFD): present on every machine with a ROCm-usable AMD GPU
ROCM_DEVICE_NODE = "/dev/kfd"
#: the reason `needs_rocm` gives, first words
NEEDS_ROCM = "needs ROCm and an AMD GPU"


def needs_rocm(node: str = ROCM_DEVICE_NODE) -> Optional[str]:
    """None when torch is a ROCm build that sees an AMD GPU, else why not, starting with `NEEDS_ROCM`;
    imports torch only where AMD's device node `node` exists (one `os.path.exists`, no torch, elsewhere).

    Example: on a CPU-only machine, or one with NVIDIA GPUs only, `needs_rocm()` is
    "needs ROCm and an AMD GPU (no AMD GPU device on this machine)"."""
    if not os.path.exists(node):
        return f"{NEEDS_ROCM} (no AMD GPU device on this machine)"
    if module_missing("torch", "pip install torch"):
        return f"{NEEDS_ROCM} (torch is not installed: a ROCm build of torch first)"
    import torch

    if not getattr(torch.version, "hip", None):
        return f"{NEEDS_ROCM} (torch {torch.__version__} is not a ROCm build)"
    if not torch.cuda.is_available():
        return f"{NEEDS_ROCM} (no GPU visible to torch)"
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
