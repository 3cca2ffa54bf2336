"""attn-core's conformance kit on cpu_amx, once per kernel path this CPU can run (forced with the
`isa` option): every declared mode, dtype, page size, head layout and feature against the float64
reference, K/V writes, bad inputs, refusals and spec lightness.

Every path gets the full CPU profile; hypothesis-drawn batches run on every path too.
"""

from __future__ import annotations

import pytest
from cpu_amx_helpers import RUNNABLE

from attn_core.testing import ConformanceSuite
from attn_cpu_amx import isa

for _path in RUNNABLE:
    _name = f"TestConformance_{_path}"
    globals()[_name] = type(
        _name, (ConformanceSuite,), {"backend": "cpu_amx", "options": {"isa": _path}, "__module__": __name__}
    )


@pytest.mark.parametrize("path", [p for p in isa.PATHS if p not in RUNNABLE] or [None])
def test_paths_this_cpu_cannot_run(path):
    """Listed so a CI log shows which paths the kit did not cover on this CPU."""
    if path is None:
        return
    pytest.skip(f"this CPU cannot run the {path} path (runnable: {', '.join(RUNNABLE)})")
