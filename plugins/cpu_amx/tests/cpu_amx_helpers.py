"""Shared bits of the attn-cpu-amx tests: which kernel paths this CPU runs, backend factories."""

from __future__ import annotations

import pytest

from attn_cpu_amx import isa
from attn_cpu_amx.backend import CpuAmxBackend

RUNNABLE = isa.runnable_paths()

#: every path, skipped where this CPU cannot run it (CI may lack AMX or AVX-512; portable always runs)
ALL_PATHS = [
    pytest.param(p, marks=pytest.mark.skipif(p not in RUNNABLE, reason=f"this CPU cannot run the {p} path"))
    for p in isa.PATHS
]


def factory(path: str, **options):
    """A harness backend factory for one forced path (plus constructor options)."""
    return lambda ctx: CpuAmxBackend(ctx, isa=path, **options)
