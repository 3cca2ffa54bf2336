"""`CachedLaunch`: launch a Triton kernel that has no value/alignment specialization through its
compiled handle, skipping the per-call argument binding, specialization and cache-key work of
`JITFunction.run` (host time matters for per-step metadata kernels, docs/design.md §8).

Safe only for kernels declared with every runtime argument in `do_not_specialize` /
`do_not_specialize_on_alignment`: then one binary per (device, argument types, constexprs, num_warps)
serves every call. The first call of a key goes through the normal launcher (compiling) and keeps the
compiled kernel; later calls go to the compiled kernel's launcher (`CompiledKernel.run`, called as
Triton's own handle calls it, on the current stream of the first tensor's device), or to the compiled
handle when a launch hook is set.

Calling the compiled handle relies on Triton's internal launcher ABI, so the shortcut is gated:

- it is on only for the Triton versions it was verified with on a GPU (`VERIFIED_TRITON`, see
  docs/dev/gpu-runs.md); another version uses the normal launcher and says so once in the log
  (`ATTN_TRITON_CACHED_LAUNCH=force` tries the shortcut anyway);
- `ATTN_TRITON_CACHED_LAUNCH=0` turns it off;
- under the interpreter, and for CPU tensors, every call uses the normal launcher;
- if the handle rejects a call (`TypeError` / `ValueError`: an argument list this Triton does not
  expect), the call is repeated through the normal launcher (the kernel must be idempotent) and the
  shortcut is turned off for good, logged once; any other error propagates.

Why a launcher is off is queryable: `launch.off_reason` per launcher, and `cached_launch_status()` for
the installed Triton. Imports no Triton itself: the kernel handed in brings it.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Optional

from attn_core.discovery.probes import triton_interpreter_enabled

if TYPE_CHECKING:  # annotations only: torch is imported on first launch
    import torch

#: (major, minor) Triton versions whose compiled-handle call was verified on a GPU (docs/dev/gpu-runs.md)
VERIFIED_TRITON = ((3, 6),)
#: the switch: "1" (default: on for verified versions), "0" (off), "force" (on for any version)
ENV_SWITCH = "ATTN_TRITON_CACHED_LAUNCH"

log = logging.getLogger(__name__)
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.warning(message)


def parse_version(text: str) -> Optional[tuple[int, int]]:
    """(major, minor) of a version string: `parse_version("3.6.0+git1a2b") == (3, 6)`; None if unreadable."""
    parts = text.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or "x")
    except (IndexError, ValueError):
        return None


def version_gate(triton_version: Optional[str], switch: Optional[str] = None) -> Optional[str]:
    """Why the shortcut is off for `triton_version` under the switch value `switch` (default: the
    environment's), or None when it is on. `version_gate("3.6.0", "1")` is None;
    `version_gate("3.9.0", "1")` names the verified versions; `version_gate("3.9.0", "force")` is None."""
    switch = (os.environ.get(ENV_SWITCH, "1") if switch is None else switch).strip().lower()
    if switch == "0":
        return f"{ENV_SWITCH}=0"
    if switch == "force":
        return None
    if triton_version is None:
        return "Triton is not installed"
    if parse_version(triton_version) not in VERIFIED_TRITON:
        verified = ", ".join(f"{a}.{b}" for a, b in VERIFIED_TRITON)
        return (
            f"Triton {triton_version} is not among the versions it was verified with "
            f"({verified}; {ENV_SWITCH}=force tries it)"
        )
    return None


def _installed_triton_version() -> Optional[str]:
    import importlib.metadata

    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def cached_launch_status() -> str:
    """One line for reports: "on (Triton 3.6.0)" or "off: <reason>" for the installed Triton and the
    current environment (the interpreter and a rejected call are reported per launcher)."""
    version = _installed_triton_version()
    reason = (
        "TRITON_INTERPRET=1 (the interpreter launches every call the normal way)"
        if triton_interpreter_enabled()
        else version_gate(version)
    )
    return f"on (Triton {version})" if reason is None else f"off: {reason}"


class CachedLaunch:
    """`CachedLaunch(kernel)(grid, *args, **constexprs_and_options)`; constexprs must be passed by
    keyword, in the kernel's signature order, after the runtime arguments; options: num_warps.
    `off_reason` is None while the shortcut may be used, else why it is not. Whether Triton interprets
    is read once, at construction (as Triton itself decides it when the kernel is decorated). Per call,
    the shortcut costs one pass over the arguments (their types for the cache key, tensors' addresses
    for the handle: see `_types_and_pointers`) and a dict look-up."""

    def __init__(self, kernel):
        self.kernel = kernel
        # key -> (compiled kernel, the constexpr values in signature order)
        self.compiled: dict[tuple, tuple[Any, tuple]] = {}
        self.off_reason: Optional[str] = None
        if os.environ.get(ENV_SWITCH, "1").strip() == "0":
            self.off_reason = f"{ENV_SWITCH}=0"
        elif triton_interpreter_enabled():
            self.off_reason = "TRITON_INTERPRET=1 (the interpreter launches every call the normal way)"
        self._gated = False
        #: hand the compiled handle tensors' addresses, not the tensors (see `_types_and_pointers`);
        #: False passes the tensors as Triton's own launch does (benchmarks compare the two)
        self.pointers_as_ints = True
        #: Triton's launch hooks (`triton.knobs.runtime`) and its current-stream query, looked up at the
        #: first GPU call; with both, a launch calls the compiled kernel's launcher directly (see `_launch`)
        self._runtime: Any = None
        self._stream_of: Any = None
        #: torch.Tensor, imported at the first GPU call (this module imports neither torch nor Triton)
        self._tensor_type: Optional[type[torch.Tensor]] = None
        #: the keyword names of the first compiled call (see `__call__`'s cache key)
        self._names: Optional[tuple[str, ...]] = None

    @property
    def enabled(self) -> bool:
        return self.off_reason is None

    def _turn_off(self, reason: str) -> None:
        self.off_reason = reason
        self.compiled.clear()
        _log_once(
            f"attn-core: cached Triton launch of {getattr(self.kernel, '__name__', self.kernel)!s} is off: {reason}"
        )

    def _check_version(self) -> None:
        """Gate on the installed Triton (the one the kernel came with), once, at the first GPU call."""
        self._gated = True
        reason = version_gate(_installed_triton_version())
        if reason is not None:
            self._turn_off(reason)
            return
        import torch

        self._tensor_type = torch.Tensor
        try:  # Triton's own objects, as its compiled handle reads them per call
            from triton import knobs
            from triton.runtime import driver

            self._runtime, self._stream_of = knobs.runtime, driver.active.get_current_stream
        except Exception as exc:  # noqa: BLE001 - no direct launch; the compiled handle still serves
            _log_once(
                "attn-core: cached Triton launch calls the compiled handle, not its launcher "
                f"({type(exc).__name__}: {exc})"
            )

    def __call__(self, grid: tuple[int, ...], *args, **kwargs) -> None:
        if self.off_reason is not None or not getattr(args[0], "is_cuda", False):
            self.kernel[grid](*args, **kwargs)
            return
        if not self._gated:
            self._check_version()
            if self.off_reason is not None:
                self.kernel[grid](*args, **kwargs)
                return
        # what still selects a binary without value specialization: argument types (a tensor's dtype,
        # an int's width), constexprs and options
        if self.pointers_as_ints:
            types, launch_args = _types_and_pointers(args, self._tensor_type)
        else:
            types, launch_args = tuple(map(_arg_type, args)), tuple(args)
        if launch_args is None:  # a tensor off the GPU: the normal launcher refuses it with Triton's error
            self.kernel[grid](*args, **kwargs)
            return
        device = args[0].get_device()
        hit = self._entry(device, types, kwargs)
        if hit is None:
            names = tuple(kwargs)
            if self._names is None:
                self._names = names
            constexprs = tuple(v for k, v in kwargs.items() if k not in ("num_warps", "num_stages"))
            self.compiled[self._key(device, types, kwargs)] = (self.kernel[grid](*args, **kwargs), constexprs)
            return
        self._launch_or_fall_back(hit, tuple(grid) + (1,) * (3 - len(grid)), device, launch_args, grid, args, kwargs)

    def bind(self, grid: tuple[int, ...], **kwargs) -> BoundLaunch:
        """The launches of one call site whose grid, constexprs and options (`kwargs`, as `__call__` takes
        them) never change: `launch.bind((n,), BLOCK=64, num_warps=4)(*args)` launches like
        `launch((n,), *args, BLOCK=64, num_warps=4)` with less host work per call (`BoundLaunch`)."""
        return BoundLaunch(self, grid, kwargs)

    def _key(self, device: int, types: tuple, kwargs: dict) -> tuple:
        # constexpr / option values; their names too unless they are the names of the first call
        # (hashing the names per call costs ~1 µs: a call site passes the same names every time)
        names, values = tuple(kwargs), tuple(kwargs.values())
        return (device, types, values) if names == self._names else (device, types, names, values)

    def _entry(self, device: int, types: tuple, kwargs: dict) -> Optional[tuple[Any, tuple]]:
        """(compiled kernel, constexpr values) of a call with these argument types and keywords, or None
        before its first (compiling) call."""
        return self.compiled.get(self._key(device, types, kwargs))

    def _launch_or_fall_back(
        self,
        hit: tuple[Any, tuple],
        grid3: tuple[int, ...],
        device: int,
        launch_args: tuple,
        grid: tuple[int, ...],
        args: tuple,
        kwargs: dict,
    ) -> None:
        compiled, constexprs = hit
        try:
            self._launch(compiled, grid3, device, launch_args + constexprs)
        except (TypeError, ValueError) as exc:  # the launcher rejects the arguments before launching (another ABI)
            self._turn_off(f"the compiled handle rejected a call ({type(exc).__name__}: {exc})")
            self.kernel[grid](*args, **kwargs)

    def _launch(self, compiled, grid: tuple[int, ...], device: int, args: tuple) -> None:
        """One launch of `compiled` (a Triton `CompiledKernel` whose handles are loaded) on the current
        stream of `device`. Triton's handle (`compiled[grid](*args)`) looks up the current device and
        stream, builds the launch metadata for the enter hook and calls `compiled.run(grid..., stream,
        function, packed_metadata, metadata, enter_hook, exit_hook, *args)`; with no enter hook set this
        makes that call itself, with the device known from the first tensor argument and no metadata
        (~3 µs less per launch on the H100 host, docs/dev/perf-notebook.md). With an enter hook (a profiler wants
        Triton's launch metadata), or an object without those handles, the compiled handle is called."""
        rt, stream_of = self._runtime, self._stream_of
        function = getattr(compiled, "function", None)
        if stream_of is None or function is None or _hooked(rt.launch_enter_hook):
            compiled[grid](*args)
            return
        exit_hook = rt.launch_exit_hook
        stream = stream_of(device)
        compiled.run(
            grid[0],
            grid[1],
            grid[2],
            stream,
            function,
            compiled.packed_metadata,
            None,
            None,
            exit_hook if _hooked(exit_hook) else None,
            *args,
        )


class BoundLaunch:
    """`CachedLaunch.bind(grid, **kwargs)`: launches of `kernel[grid](*args, **kwargs)` for one fixed grid
    and fixed constexprs / options, called with the runtime arguments alone (`bound(*args)`).

    Per call: one pass over the arguments (`_types_and_pointers`: their types, tensors' addresses), a dict
    look-up by (device, types), then the compiled kernel's launcher (`CachedLaunch._launch`). What
    `CachedLaunch.__call__` adds per call is left out: the keywords' names and values in the cache key and
    the grid padded to 3-D (~4 µs of a launch with 11 constexprs on the H100 host, docs/dev/perf-notebook.md).
    Everything else is the parent's: a call whose types it has not seen yet (the first, compiling) goes
    through `parent(grid, *args, **kwargs)` and keeps the parent's compiled entry; while the parent's
    shortcut is off (another Triton,
    the interpreter, a rejected call), the tensors are off the GPU or `pointers_as_ints` is False, every
    call goes through the parent; so does a call whose first argument is not a CUDA tensor (the device
    comes from it)."""

    def __init__(self, parent: CachedLaunch, grid: tuple[int, ...], kwargs: dict) -> None:
        self.parent, self.grid, self.kwargs = parent, tuple(grid), kwargs
        self._grid3 = self.grid + (1,) * (3 - len(self.grid))
        self._entries: dict[tuple, tuple[Any, tuple]] = {}  # (device, types) -> the parent's compiled entry

    def __call__(self, *args) -> None:
        p = self.parent
        if (
            p.off_reason is not None
            or p._tensor_type is None
            or not p.pointers_as_ints
            or not getattr(args[0], "is_cuda", False)
        ):
            p(self.grid, *args, **self.kwargs)  # the gates (the first call passes them), the fallbacks
            return
        types, launch_args = _types_and_pointers(args, p._tensor_type)
        if launch_args is None:
            p(self.grid, *args, **self.kwargs)
            return
        device = args[0].get_device()
        hit = self._entries.get((device, types))
        if hit is None:
            p(self.grid, *args, **self.kwargs)
            hit = p._entry(device, types, self.kwargs)
            if hit is not None:
                self._entries[(device, types)] = hit
            return
        p._launch_or_fall_back(hit, self._grid3, device, launch_args, self.grid, args, self.kwargs)


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set: a callable, or a `triton.knobs.HookChain` holding one (Triton's
    knobs hold an empty chain, never None, when nothing is hooked). `_hooked(None)` is False."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _types_and_pointers(
    args: tuple[Any, ...], tensor_type: Optional[type[torch.Tensor]] = None
) -> tuple[tuple, Optional[tuple]]:
    """(what of each argument selects a binary, as `_arg_type`; the arguments with every tensor replaced
    by its `data_ptr()`), or (types, None) when a tensor argument is not on a CUDA device.

    Triton's launcher turns a tensor into its address by calling `data_ptr()` and then asks the CUDA
    driver whether the address is a device pointer (`cuPointerGetAttribute`, one driver call per
    tensor argument and launch; an int it takes as the address itself), so handing it the addresses
    saves one driver call per tensor. The check that call made (a CPU tensor cannot be launched on) is
    kept here: a tensor with `is_cuda` False sends the launch to the normal launcher, which refuses it.
    `tensor_type` (torch.Tensor) takes its arguments down the shortest branch.
    Example: `(t_int32_cuda, 7, 2**40)` -> `((torch.int32, "i32", "i64"), (t.data_ptr(), 7, 2**40))`."""
    types: list[Any] = []
    out: list[Any] = []
    last: Any = None
    last_type: Any = None
    last_ptr: Any = None  # the previous tensor: kernels take one tensor for several absent arguments
    for a in args:
        if type(a) is tensor_type:  # torch.Tensor, the common case, first (subclasses take the general branch)
            if a is not last:
                if not a.is_cuda:
                    return tuple(types), None
                last, last_type, last_ptr = a, a.dtype, a.data_ptr()
            types.append(last_type)
            out.append(last_ptr)
            continue
        if type(a) is int:
            types.append("i32" if -(2**31) <= a < 2**31 else "i64")
            out.append(a)
            continue
        dtype = getattr(a, "dtype", None)
        if dtype is None:
            types.append(_arg_type(a))
            out.append(a)
        elif getattr(a, "is_cuda", False):
            types.append(dtype)
            out.append(a.data_ptr())
        else:
            return tuple(types), None
    return tuple(types), tuple(out)


def _arg_type(a) -> object:
    """What of an argument selects a binary: a tensor's dtype, an int's width (i32 / i64), else its type."""
    dtype = getattr(a, "dtype", None)
    if dtype is not None:
        return dtype
    if type(a) is int or (isinstance(a, int) and not isinstance(a, bool)):
        return "i32" if -(2**31) <= a < 2**31 else "i64"
    return type(a)
