"""`CachedLaunch`: launch a Triton kernel that has no value/alignment specialization through its
compiled handle, skipping the per-call argument binding, specialization and cache-key work of
`JITFunction.run` (host time matters for per-step metadata kernels, DESIGN §7).

Safe only for kernels declared with every runtime argument in `do_not_specialize` /
`do_not_specialize_on_alignment`: then one binary per (device, argument types, constexprs, num_warps)
serves every call. The first call of a key goes through the normal launcher (compiling) and keeps the
compiled kernel; under the interpreter, or if the compiled handle cannot be called the way this Triton
version expects, every call uses the normal launcher (the kernel must be idempotent: a failed shortcut
call is repeated the normal way). `ATTN_TRITON_CACHED_LAUNCH=0` turns the shortcut off.

Imports no Triton itself: the kernel handed in brings it.
"""

from __future__ import annotations

import os
from typing import Any

from attn_core.probes import triton_interpreter_enabled


class CachedLaunch:
    """`CachedLaunch(kernel)(grid, *args, **constexprs_and_options)`; constexprs must be passed by
    keyword, in the kernel's signature order, after the runtime arguments; options: num_warps.

    Whether Triton interprets is read once, at construction (as Triton itself decides it when the kernel
    is decorated). Per call, the shortcut costs one cache key over the arguments' types and a dict look-up."""

    def __init__(self, kernel):
        self.kernel = kernel
        # key -> (compiled kernel, the constexpr values in signature order)
        self.compiled: dict[tuple, tuple[Any, tuple]] = {}
        self.enabled = os.environ.get("ATTN_TRITON_CACHED_LAUNCH", "1") != "0" and not triton_interpreter_enabled()

    def __call__(self, grid: tuple[int, ...], *args, **kwargs) -> None:
        if not self.enabled or not getattr(args[0], "is_cuda", False):
            self.kernel[grid](*args, **kwargs)
            return
        # what still selects a binary without value specialization: argument types (a tensor's dtype,
        # an int's width), constexprs and options
        key = (args[0].get_device(), *map(_arg_type, args), *kwargs.items())
        hit = self.compiled.get(key)
        if hit is None:
            constexprs = tuple(v for k, v in kwargs.items() if k not in ("num_warps", "num_stages"))
            self.compiled[key] = (self.kernel[grid](*args, **kwargs), constexprs)
            return
        compiled, constexprs = hit
        try:
            compiled[tuple(grid) + (1,) * (3 - len(grid))](*args, *constexprs)
        except Exception:  # the launcher rejects the call before launching (another Triton ABI): stop using the shortcut
            self.enabled = False
            self.kernel[grid](*args, **kwargs)


def _arg_type(a) -> object:
    """What of an argument selects a binary: a tensor's dtype, an int's width (i32 / i64), else its type."""
    dtype = getattr(a, "dtype", None)
    if dtype is not None:
        return dtype
    if type(a) is int or (isinstance(a, int) and not isinstance(a, bool)):
        return "i32" if -(2**31) <= a < 2**31 else "i64"
    return type(a)
