"""The registry entry: an import-light spec that never imports wave_lang, the probe's reasons, what
`attn-core list` and `explain` say (never ran on hardware), and the kit's spec checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import attn_wave.spec as spec

from attn_core.contract.capabilities import Requirements
from attn_core.discovery.registry import default_registry
from attn_core.testing.lightness import spec_import_check, spec_matches_class_check
from attn_core.testing.target import resolve_target

NEEDS = "needs ROCm and an AMD GPU"


def test_spec_and_probe_import_neither_torch_nor_wave_lang():
    code = (
        "import sys\n"
        "from attn_wave.spec import SPEC\n"
        "print(SPEC.probe()); print([m for m in ('torch', 'wave_lang', 'attn_wave.backend') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    reason, heavy = out.stdout.strip().splitlines()
    assert heavy == "[]" and reason == f"{NEEDS} (no AMD GPU device on this machine)"


def test_probe_order_and_install_hint(monkeypatch):
    assert spec.probe((lambda: None, lambda: "second")) == "second"
    monkeypatch.setattr(spec.importlib.util, "find_spec", lambda name: None)
    assert spec.wave_missing() == "not installed: pip install 'attn-wave[rocm]' (Wave, the wave-lang package)"


def test_kit_spec_checks_on_the_entry_point():
    target = resolve_target("wave")
    assert target.spec_source == "attn_wave.spec:SPEC"
    assert "imports none of" in spec_import_check(target)()
    assert spec_matches_class_check(target)() == "spec and class agree"


def test_explain_gives_one_reason():
    req = Requirements(device_type="cuda", q_dtype="float16", kv_dtype="float16", head_dim=128, page_size=16)
    report = next(r for r in default_registry().explain(req) if r.name == "wave")
    assert not report.usable and list(report.reasons) == [f"{NEEDS} (no AMD GPU device on this machine)"]


def test_attn_core_list_says_it_never_ran_on_hardware():
    exe = os.path.join(os.path.dirname(sys.executable), "attn-core")
    out = subprocess.run(
        [exe, "list"], capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "400"}
    )
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("wave "))
    assert (
        "attn-wave" in line
        and f"unavailable: {NEEDS}" in line
        and "[unverified: its Wave kernels never ran on hardware" in line
    )
    rows = json.loads(subprocess.run([exe, "list", "--json"], capture_output=True, text=True, timeout=120).stdout)
    row = next(r for r in rows if r["name"] == "wave")
    assert row["capabilities"] == "cuda; mha; bf16/fp16; pages any; graphs never; custom_mask"
