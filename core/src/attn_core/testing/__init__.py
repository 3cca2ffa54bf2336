"""attn-core's conformance kit: the float64 oracle, the case harness, and the capability-driven suite.

- `ConformanceSuite`: subclass it in a plugin's tests to get every check (see `attn_core.testing.suite`).
- `make_plan` / `run_plan`: the same checks without pytest (what `attn-core check NAME` runs).
- `AttnCase`, `run_case`, `assert_case`: one case against the reference (`harness`).
- `reference_attention`, `tolerance`, `relative_error`: the oracle (`reference`).
- `run_ranks`, `RankFailure`: a function on N torch.distributed ranks inside one test (`distributed`).

Names load on first use, so importing this package (the pytest plugin does) costs no torch import.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ConformanceSuite": "attn_core.testing.suite",
    "make_plan": "attn_core.testing.kit",
    "run_plan": "attn_core.testing.kit",
    "KitPlan": "attn_core.testing.kit",
    "Check": "attn_core.testing.outcome",
    "Outcome": "attn_core.testing.outcome",
    "KitFailure": "attn_core.testing.outcome",
    "AttnCase": "attn_core.testing.harness",
    "run_case": "attn_core.testing.harness",
    "assert_case": "attn_core.testing.harness",
    "reference_attention": "attn_core.testing.reference",
    "tolerance": "attn_core.testing.reference",
    "relative_error": "attn_core.testing.reference",
    "run_ranks": "attn_core.testing.distributed",
    "RankFailure": "attn_core.testing.distributed",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'attn_core.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
