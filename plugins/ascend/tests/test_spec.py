"""The registry entry: an import-light spec that never imports torch_npu, the probe's reason, what
`attn-core list` says, and the kit's spec checks on the entry-point target."""

from __future__ import annotations

import os
import subprocess
import sys

from attn_core.contract.capabilities import ARCH_MLA, Requirements
from attn_core.discovery.registry import default_registry
from attn_core.testing.lightness import spec_import_check, spec_matches_class_check
from attn_core.testing.target import resolve_target

NEEDS = "needs torch_npu and an Ascend NPU (pip install attn-ascend[npu])"
UNVERIFIED = "not on NPU hardware"


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_spec_and_probe_import_neither_torch_nor_torch_npu():
    code = (
        "import sys\n"
        "from attn_ascend.spec import SPEC\n"
        "reason = SPEC.probe()\n"
        "print(reason); print([m for m in ('torch', 'torch_npu', 'attn_ascend.backend') if m in sys.modules])\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    reason, heavy = out.stdout.strip().splitlines()
    assert heavy == "[]"  # torch_npu is not installed here, so the probe stops at find_spec
    assert reason.startswith(NEEDS) and UNVERIFIED in reason


def test_kit_spec_checks_on_the_entry_point():
    target = resolve_target("ascend")
    assert target.spec_source == "attn_ascend.spec:SPEC"
    assert "imports none of" in spec_import_check(target)()
    assert spec_matches_class_check(target)() == "spec and class agree"


def test_explain_gives_the_reason_for_an_npu_model():
    req = Requirements(
        device_type="npu", q_dtype="bfloat16", kv_dtype="bfloat16", head_dim=576, page_size=128, arch=ARCH_MLA
    )
    report = next(r for r in default_registry().explain(req) if r.name == "ascend")
    assert not report.usable
    assert report.reasons[0].startswith(NEEDS)
    assert len(report.reasons) == 1, (
        report.reasons
    )  # nothing else about an MLA 512+64 bf16 model on page 128 is refused


def test_attn_core_list_says_why_and_how_far_it_is_verified():
    exe = os.path.join(os.path.dirname(sys.executable), "attn-core")
    out = subprocess.run([exe, "list"], capture_output=True, text=True, timeout=120)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("ascend"))
    assert "attn-ascend" in line and f"unavailable: {NEEDS}" in line
    assert "emulation of the documented torch_npu operators" in line and UNVERIFIED in line
    assert "npu; mha/mla; bf16/fp16; pages 16,32,64,128; graphs uniform_batch" in line
