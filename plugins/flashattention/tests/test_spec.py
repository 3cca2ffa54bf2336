"""The registry entry: the probe's three reasons in order, the capability rule, what `attn-core list` shows
here, and where the declared phase priorities put prefill and decode next to attn-triton."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from importlib import metadata

import pytest

from attn_core.contract.capabilities import Requirements
from attn_core.contract.forward_mode import ForwardMode
from attn_core.discovery import registry as reg
from attn_flashattention import spec


def test_supported_capabilities():
    assert spec.supported_capability((9, 0)) is None
    assert spec.supported_capability((10, 0)) is None and spec.supported_capability((10, 3)) is None
    assert spec.supported_capability((8, 9)) == "needs compute capability 9.0 or 10.x, found 8.9"
    assert spec.supported_capability((12, 0)) == "needs compute capability 9.0 or 10.x, found 12.0"


def test_probe_reasons_in_order(monkeypatch):
    monkeypatch.setattr(metadata, "version", lambda name: (_ for _ in ()).throw(metadata.PackageNotFoundError(name)))
    assert spec.probe() == "not installed: pip install flash-attn-4"
    monkeypatch.setattr(metadata, "version", lambda name: "4.0.0b36")
    monkeypatch.setattr(spec, "needs_cuda", lambda: "needs CUDA (no GPU device on this machine)")
    assert spec.probe() == "needs CUDA (no GPU device on this machine)"
    monkeypatch.setattr(spec, "needs_cuda", lambda: None)
    monkeypatch.setattr(spec, "_device_capability", lambda: spec.supported_capability((8, 0)))
    assert spec.probe() == "needs compute capability 9.0 or 10.x, found 8.0"
    monkeypatch.setattr(spec, "_device_capability", lambda: None)
    assert spec.probe() is None
    assert spec.info() == "flash-attn-4 4.0.0b36"
    monkeypatch.setattr(metadata, "version", lambda name: "4.0.0b40")
    assert spec.info() == "flash-attn-4 4.0.0b40 (verified: 4.0.0b36)"


def test_attn_core_list_shows_fa4_and_why_not_here():
    """On this CPU machine (no flash-attn-4: it is a CUDA package) `attn-core list` names fa4 and the reason,
    in its table and in its JSON."""
    out = subprocess.run(
        [sys.executable, "-m", "attn_core.cli.main", "list"], capture_output=True, text=True, check=True
    ).stdout
    assert any(line.startswith("fa4 ") and "attn-flashattention" in line for line in out.splitlines()), out
    rows = json.loads(
        subprocess.run(
            [sys.executable, "-m", "attn_core.cli.main", "list", "--json"], capture_output=True, text=True
        ).stdout
    )
    row = next(r for r in rows if r["name"] == "fa4")
    assert row["distribution"] == "attn-flashattention" and row["unverified"] == spec.UNVERIFIED
    try:
        metadata.version("flash-attn-4")
    except metadata.PackageNotFoundError:
        assert (row["state"], row["reason"]) == ("unavailable", "not installed: pip install flash-attn-4")


def _hopper(modes=(ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED), cc=(9, 0)):
    return Requirements(device_type="cuda", compute_capability=cc, page_size=16, forward_modes=frozenset(modes))


def _registry_with(*specs) -> reg.Registry:
    """The given specs (probes replaced: as if on a GPU machine with everything installed) and torch_native."""
    r = reg.Registry(use_entry_points=False)
    for s in specs:
        r.register(dataclasses.replace(s, probe_fn=lambda: None))
    return r


def test_on_hopper_prefill_goes_to_fa4_and_decode_to_triton():
    triton_spec = pytest.importorskip("attn_triton.spec").SPEC
    r = _registry_with(spec.SPEC, triton_spec)
    assert r.select_backend(_hopper()) == "hybrid(prefill=fa4,decode=triton)"
    lines = r.explain_selection(_hopper()).describe()
    assert lines[0].startswith("prefill: fa4 (priority 40 on cuda, compute capability 9.0; docs/dev/perf-notebook.md")
    assert lines[1].startswith("decode: triton (priority 25 on cuda, compute capability 9.0, mha; docs/performance.md")
    assert r.select_backend(_hopper(modes=(ForwardMode.DECODE,))) == "triton"
    assert r.select_backend(_hopper(modes=(ForwardMode.EXTEND,))) == "fa4"
    assert r.select_backend(_hopper(cc=(10, 0))) == "triton"  # not measured on Blackwell


def test_on_hopper_with_flashinfer_too_decode_still_goes_to_triton():
    """attn-flashinfer (priority 20) installed beside them: decode stays on attn-triton (its measured MHA
    decode priority on 9.0 is 25), MLA decode goes to flashinfer_mla where attn-triton declares nothing."""
    triton_spec = pytest.importorskip("attn_triton.spec").SPEC
    fi = pytest.importorskip("attn_flashinfer.spec")
    specs = [spec.SPEC, triton_spec] + [v for v in vars(fi).values() if isinstance(v, type(spec.SPEC))]
    r = _registry_with(*specs)
    assert r.select_backend(_hopper()) == "hybrid(prefill=fa4,decode=triton)"
    assert r.select_backend(_hopper(cc=(8, 0))) == "flashinfer"  # measured on 9.0 only: priorities as declared


def test_fa4_alone_serves_both_phases():
    assert _registry_with(spec.SPEC).select_backend(_hopper()) == "fa4"


def test_explain_command_prints_the_selection():
    """`attn-core explain --device cuda --compute-capability 9.0` runs without a GPU and ends with the
    selection among the backends usable here (torch_native; attn-triton too under TRITON_INTERPRET=1)."""
    cmd = [
        sys.executable,
        "-m",
        "attn_core.cli.main",
        "explain",
        "--device",
        "cuda",
        "--compute-capability",
        "9.0",
        "--page-size",
        "16",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    assert "fa4" in out and "\nselected: " in out and "  decode: " in out
