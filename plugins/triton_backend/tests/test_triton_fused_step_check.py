"""attn-triton runs the step check in its main index launch (`step_check_in_index_launch`,
`AttentionBackend.take_step_check`, `attn_core.ops.kv_indices_triton.launch_checked_indices`): under the
accelerator device path on CPU tensors (the interpreter), the kit's hostile cases at the default validation
still give a typed error at once or `DeviceFaultError` at the next step with nothing written outside the
batch's slots, and the fused launch is what ran the checks."""

from __future__ import annotations

import os

import pytest

from attn_core.ops import kv_indices_triton as checked_indices_triton
from attn_core.testing.device_path import accelerator_checks
from attn_core.testing.kit import make_plan, run_plan

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels run on CPU tensors under TRITON_INTERPRET=1"
)

CASES = [
    f"hostile-basic-{n}"
    for n in (
        "row_negative",
        "row_duplicate",
        "slot_foreign",
        "slot_minus_one",
        "seq_lens_device_differs",
        "extend_device_differs",
        "extend_start_loc_differs",
    )
]


def test_hostile_cases_with_the_step_check_in_the_index_launch(monkeypatch):
    fused = []
    real = checked_indices_triton.launch_checked_indices

    def counted(*args):
        fused.append(1)
        real(*args)

    monkeypatch.setattr(checked_indices_triton, "launch_checked_indices", counted)
    with accelerator_checks("triton"):
        outcomes = {o.check_id: o for o in run_plan(make_plan("triton", device="cpu", quick=True), CASES)}
    assert outcomes, "no hostile case selected"
    failed = {cid: o.message for cid, o in outcomes.items() if o.status != "passed"}
    assert not failed, failed
    assert fused, "the step check never ran in the index launch"
