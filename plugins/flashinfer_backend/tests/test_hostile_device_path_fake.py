"""The kit's hostile batches at the default validation ("basic") on the accelerator's path, attn-flashinfer over
the CPU stand-in of FlashInfer (`attn_core.testing.device_path.accelerator_checks("triton")`: host checks only,
the Triton step check and the Triton index kernel on the device tensors, in one launch once the step has a key
list, faults raised one step late).

Found on an H200 (2026-11-29): FlashInfer plans from the host's page offsets, and the index kernel gave a
request whose device row was refused no page ids at all, so FlashInfer read the ids the reused buffer held
there (an illegal memory access on `hostile-basic-extend_row_negative`). The index kernel now keeps the host
layout for such readers (`keep_layout`: dummy ids 0 in the refused request's places, the tail written too):
here the stand-in reads the ids as FlashInfer does, and a stale or garbage id is an IndexError or a wrong
answer for the good requests."""

from __future__ import annotations

import importlib.util

import pytest

from attn_core.testing.device_path import accelerator_checks
from attn_core.testing.kit import make_plan, run_plan

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="the real flashinfer is installed"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (the interpreter)"),
]

SELECT = ("hostile-basic-row_", "hostile-basic-extend_row", "hostile-basic-slot_", "hostile-basic-seq_lens_device")


def test_hostile_rows_on_the_accelerator_path(factory, monkeypatch):
    from attn_core.ops import kv_indices_triton as checked_indices_triton

    fused = []
    real = checked_indices_triton.launch_checked_indices

    def counted(*args):
        fused.append(1)
        real(*args)

    monkeypatch.setattr(checked_indices_triton, "launch_checked_indices", counted)
    with accelerator_checks("triton"):
        plan = make_plan(factory, device="cpu", quick=True)
        outcomes = run_plan(plan, SELECT)
    assert len(outcomes) >= 5, [o.check_id for o in outcomes]
    failed = {o.check_id: o.message for o in outcomes if o.status == "failed"}
    assert not failed, failed
    assert fused, "the step check never ran in the step's index launch (`step_check_in_index_launch`)"
