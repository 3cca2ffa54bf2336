"""Known limits of the machine a kit runs on: the checks whose result here would say nothing about the
backend, as {check-id glob: reason}. `make_plan` adds them to every plan, so `attn-core check` and a
plugin's `ConformanceSuite` skip the same checks for the same printed reason.

Today one limit is known: Triton's CPU interpreter (`TRITON_INTERPRET=1`) multiplies the raw bit
patterns of bfloat16 operands in `tl.dot` (triton-lang/triton#11584, open in Triton 3.9), so the bf16
checks of a backend whose kernels are Triton kernels are skipped on the CPU under the interpreter; they
run on a GPU.
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Collection, Optional

from attn_core.discovery.probes import triton_interpreter_enabled

BF16_INTERPRETER_REASON = (
    "the Triton interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584); bf16 is checked on a GPU"
)


@functools.cache
def distribution_requires(distribution: str, package: str) -> bool:
    """Whether installed `distribution` declares `package` among its (non-extra) requirements, e.g.
    `distribution_requires("attn-triton", "triton")` is True; False for an unknown distribution."""
    try:
        requirements = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return False
    names = []
    for req in requirements:
        if "extra ==" in req.replace('"', "").replace("'", ""):
            continue
        head = req.split(";", 1)[0].strip()
        for sep in "<>=!~[ (":
            head = head.split(sep, 1)[0]
        names.append(head.strip().lower().replace("_", "-"))
    return package.lower().replace("_", "-") in names


def distribution_of_module(module: str) -> Optional[str]:
    """The installed distribution that provides top-level package of `module` ("attn_triton.backend" →
    "attn-triton"), or None."""
    top = module.split(".", 1)[0]
    found = importlib.metadata.packages_distributions().get(top)
    return found[0] if found else None


def runs_in_triton_interpreter(distribution: Optional[str], device: str) -> bool:
    """Whether a backend shipped by `distribution` runs its kernels through Triton's CPU interpreter on
    `device`: a CPU device, `TRITON_INTERPRET=1`, and a distribution that requires triton.

    Example: under `TRITON_INTERPRET=1`, ("attn-triton", "cpu") → True, ("attn-triton", "cuda:0") →
    False, ("attn-core", "cpu") → False (attn-core does not require triton)."""
    return (
        device.split(":", 1)[0] == "cpu"
        and triton_interpreter_enabled()
        and bool(distribution)
        and distribution_requires(distribution, "triton")
    )


def environment_skips(distribution: Optional[str], q_dtypes: Collection[str], device: str) -> dict[str, str]:
    """The {check-id glob: reason} of the checks this machine cannot judge for a backend of
    `distribution` declaring `q_dtypes` (dtype names, as in `Capabilities.q_dtypes`), run on `device`.

    Example: `environment_skips("attn-triton", {"float16", "bfloat16"}, "cpu")` under
    `TRITON_INTERPRET=1` gives {"dtype-bfloat16-*": BF16_INTERPRETER_REASON, "fp8_kv-*-dtype-bfloat16-*":
    BF16_INTERPRETER_REASON, "ragged-dtype-bfloat16": BF16_INTERPRETER_REASON} (bf16 queries over an
    fp8 cache, and the ragged op's bf16 check, too); on "cuda", {}."""
    skips: dict[str, str] = {}
    if "bfloat16" in q_dtypes and runs_in_triton_interpreter(distribution, device):
        skips["dtype-bfloat16-*"] = BF16_INTERPRETER_REASON
        skips["fp8_kv-*-dtype-bfloat16-*"] = BF16_INTERPRETER_REASON
        skips["ragged-dtype-bfloat16"] = BF16_INTERPRETER_REASON
    return skips


__all__ = [
    "BF16_INTERPRETER_REASON",
    "distribution_of_module",
    "distribution_requires",
    "environment_skips",
    "runs_in_triton_interpreter",
]
