"""The accelerator's default validation path, run on CPU tensors (tests only).

On the CPU every step is validated fully (`attn_core.contract.validation.effective_level`), so the path an
accelerator takes at validation "basic" (host checks only, then the step check of
`attn_core.ops.step_checks` on the device tensors, writes through its checked slots, faults raised one
step late) never runs in CPU tests. `accelerator_checks()` makes it run: inside the block the modules that
choose the level take the context's `validation` as given, and the step check is the one named:

- "torch": `check_step_torch`, the reference;
- "triton": `check_step_triton`, the kernel CUDA runs (needs `TRITON_INTERPRET=1` set before Triton was
  imported, as the test suites set it); `attn_core.ops.kv_indices.build_kv_indices` then takes its Triton
  path (device-side bounds) on CPU tables too, as on a GPU.

Example (a test)::

    with accelerator_checks("triton"):
        backend = create_backend("torch_native", replace(ctx, validation="basic"))
        backend.init_forward_metadata(batch)  # the Triton step check, no full validation

Not thread-safe (it swaps module globals for the block), not for production code.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Iterator

#: modules that call `effective_level` to pick a step's validation level
LEVEL_USERS = (
    "attn_core.contract.validation",
    "attn_core.contract.backend",
    "attn_core.engine.graph_runner",
    "attn_core.wrappers.multi_step_draft",
)
#: modules that run the step check (`check_step`)
STEP_CHECK_USERS = ("attn_core.contract.backend", "attn_core.engine.graph_runner")
#: modules that choose the index kernel by device (`index_kernel_runs_on`)
INDEX_KERNEL_USERS = ("attn_core.ops.kv_indices",)
STEP_CHECKS = ("torch", "triton")


def _step_check(name: str) -> Callable:
    if name == "torch":
        from attn_core.ops.step_checks import check_step_torch

        return check_step_torch
    from attn_core.ops.step_checks_triton import check_step_triton

    return check_step_triton


def _everywhere(req_to_token) -> bool:
    """The index kernel's Triton path on any device (CPU tensors: under the interpreter)."""
    return True


def _as_given(ctx) -> str:
    """The context's own validation level (what an accelerator uses)."""
    return ctx.validation


@contextlib.contextmanager
def accelerator_checks(step_check: str = "torch") -> Iterator[None]:
    """Inside the block, steps on CPU tensors are validated as on an accelerator (module docstring);
    `step_check` is "torch" or "triton". Everything is restored on exit, also on an error."""
    if step_check not in STEP_CHECKS:
        raise ValueError(f"step_check: expected one of {STEP_CHECKS}, found {step_check!r}")
    check = _step_check(step_check)
    saved: list[tuple[Any, str, Any]] = []  # (module, attribute, the value it had)
    try:
        for name in LEVEL_USERS:
            module: Any = importlib.import_module(name)
            saved.append((module, "effective_level", module.effective_level))
            module.effective_level = _as_given
        for name in STEP_CHECK_USERS:
            module = importlib.import_module(name)
            saved.append((module, "check_step", module.check_step))
            module.check_step = check
        if step_check == "triton":  # the index kernel too: its device-side bounds run as on a GPU
            for name in INDEX_KERNEL_USERS:
                module = importlib.import_module(name)
                saved.append((module, "index_kernel_runs_on", module.index_kernel_runs_on))
                module.index_kernel_runs_on = _everywhere
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


__all__ = ["STEP_CHECKS", "accelerator_checks"]
