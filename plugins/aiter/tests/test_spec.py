"""The registry entry: an import-light spec that never imports aiter, the probe's reasons in order,
what `attn-core list` and `explain` say (never ran on hardware), and the kit's spec checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import attn_aiter.spec as spec

from attn_core.contract.capabilities import ARCH_MLA, Requirements
from attn_core.discovery.registry import default_registry
from attn_core.testing.lightness import spec_import_check, spec_matches_class_check
from attn_core.testing.target import resolve_target

NEEDS = "needs ROCm and an AMD GPU"


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_spec_and_probe_import_neither_torch_nor_aiter():
    code = (
        "import sys\n"
        "from attn_aiter.spec import SPEC\n"
        "print(SPEC.probe()); print([m for m in ('torch', 'aiter', 'attn_aiter.backend') if m in sys.modules])\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    reason, heavy = out.stdout.strip().splitlines()
    assert heavy == "[]" and reason == f"{NEEDS} (no AMD GPU device on this machine)"


def test_probe_order_and_install_hint(monkeypatch):
    assert spec.probe((lambda: None, lambda: "second")) == "second"
    monkeypatch.setattr(spec.importlib.util, "find_spec", lambda name: None)
    assert spec.aiter_missing() == "not installed: pip install 'attn-aiter[rocm]' (AMD's AITER, the amd-aiter package)"


def test_kit_spec_checks_on_the_entry_point():
    target = resolve_target("aiter")
    assert target.spec_source == "attn_aiter.spec:SPEC"
    assert "imports none of" in spec_import_check(target)()
    assert spec_matches_class_check(target)() == "spec and class agree"


def test_explain_gives_one_reason_for_a_deepseek_model():
    req = Requirements(
        device_type="cuda", q_dtype="bfloat16", kv_dtype="bfloat16", head_dim=576, page_size=16, arch=ARCH_MLA
    )
    report = next(r for r in default_registry().explain(req) if r.name == "aiter")
    assert not report.usable and list(report.reasons) == [f"{NEEDS} (no AMD GPU device on this machine)"]


def test_attn_core_list_says_it_never_ran_on_hardware():
    exe = os.path.join(os.path.dirname(sys.executable), "attn-core")
    out = subprocess.run(
        [exe, "list"], capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "400"}
    )
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("aiter "))
    assert "attn-aiter" in line and f"unavailable: {NEEDS}" in line
    assert (
        "[unverified: its AITER calls never ran on hardware: verified only against an emulation of AITER's documented"
        in line
    )
    rows = json.loads(subprocess.run([exe, "list", "--json"], capture_output=True, text=True, timeout=120).stdout)
    row = next(r for r in rows if r["name"] == "aiter")
    assert row["unverified"].startswith("its AITER calls never ran on hardware") and row["reason"].startswith(NEEDS)
    assert row["capabilities"] == "cuda; mha/mla; bf16/fp16; pages 1,16,32; graphs uniform_single_token_decode"
