"""The kit's hostile batches at the default validation ("basic") on the accelerator's path, the fa4 backend over
the float64 emulation of FA4 (`attn_core.testing.device_path.accelerator_checks("triton")`: host checks only,
the Triton step check on the device tensors, faults raised one step late).

Found on an H200 (2026-11-29, FA4's first run): the key lists indexed `req_to_token` with the device request
rows as given, so a row past the table was a device-side assert (the CUDA context dead) instead of the step
check's DeviceFaultError. On CPU tensors the same indexing is an IndexError, which this catches."""

from __future__ import annotations

import importlib.util

import pytest

from attn_core.testing.device_path import accelerator_checks
from attn_core.testing.kit import make_plan, run_plan
from attn_flashattention.testing import emulated_backend_class

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (the interpreter)")

SELECT = ("hostile-basic-row_", "hostile-basic-extend_row", "hostile-basic-slot_", "hostile-graph_run_row")


def test_hostile_rows_on_the_accelerator_path():
    with accelerator_checks("triton"):
        plan = make_plan(emulated_backend_class(), device="cpu", quick=True)
        outcomes = run_plan(plan, SELECT)
    assert len(outcomes) >= 5, [o.check_id for o in outcomes]
    failed = {o.check_id: o.message for o in outcomes if o.status == "failed"}
    assert not failed, failed
