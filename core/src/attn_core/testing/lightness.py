"""The spec of a plugin must import without torch or any vendor library (checked in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from attn_core.testing.outcome import KitFailure, KitSkip
from attn_core.testing.target import KitTarget

#: modules a spec import must not pull in
HEAVY_MODULES = ("torch", "triton", "flashinfer", "torch_npu", "intel_extension_for_pytorch")

_PROBE = """
import importlib, json, sys
module, _, attr = sys.argv[1].partition(":")
spec = getattr(importlib.import_module(module), attr)
from attn_core.contract.spec import BackendSpec
heavy = [m for m in json.loads(sys.argv[2]) if m in sys.modules]
print(json.dumps({"is_spec": isinstance(spec, BackendSpec), "heavy": heavy}))
"""


def spec_import_check(target: KitTarget, timeout_s: float = 60.0):
    """A check: importing the spec's module in a subprocess imports none of `HEAVY_MODULES`."""

    def run() -> str:
        if not target.spec_source:
            raise KitSkip("the backend was not found through an entry point (no spec module to import)")
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE, target.spec_source, json.dumps(HEAVY_MODULES)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if proc.returncode != 0:
            raise KitFailure(f"importing {target.spec_source} failed:\n{proc.stderr.strip()[-2000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        if not result["is_spec"]:
            raise KitFailure(f"{target.spec_source} is not a BackendSpec")
        if result["heavy"]:
            raise KitFailure(
                f"importing {target.spec_source} imported {result['heavy']}; a spec must stay import-light"
            )
        return f"{target.spec_source} imports none of {', '.join(HEAVY_MODULES)}"

    return run


def spec_matches_class_check(target: KitTarget):
    """A check: the spec's name and capabilities are the class's (the registry matches on the spec)."""

    def run() -> str:
        if target.spec is None:
            raise KitSkip("no spec (the backend was given as a class)")
        cls: Any = target.backend_class  # an AttentionBackend subclass (checks read its class attributes)
        problems = []
        if getattr(cls, "name", "") and cls.name != target.spec.name:
            problems.append(f"class name {cls.name!r} != spec name {target.spec.name!r}")
        if cls.capabilities != target.spec.capabilities:
            problems.append("the class's capabilities differ from the spec's")
        if problems:
            raise KitFailure("; ".join(problems))
        return "spec and class agree"

    return run
