"""The registry entries of `trtllm_mha` and `cutlass_mla`: import-light specs, the probes' reasons in order
(no CUDA; compute capability 10.x needed, 9.0 found; the vendor package missing), what `attn-core list` says
(never ran on hardware), and the kit's spec checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import attn_core.discovery.probes
import attn_trtllm_mla.blackwell_probes as bp
import attn_trtllm_mla.cutlass_spec as cutlass_spec
import attn_trtllm_mla.mha_spec as mha_spec
from attn_core.testing.lightness import spec_import_check, spec_matches_class_check
from attn_core.testing.target import resolve_target


def test_specs_import_neither_torch_nor_vendor_libraries():
    code = (
        "import sys, attn_trtllm_mla.mha_spec as a, attn_trtllm_mla.cutlass_spec as b\n"
        "print(a.SPEC.probe()); print(b.SPEC.probe())\n"
        "print([m for m in ('torch', 'flashinfer', 'sgl_kernel', 'attn_flashinfer') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    mha, cutlass, heavy = out.stdout.strip().splitlines()
    assert heavy == "[]" and mha == cutlass == "needs CUDA (no GPU device on this machine)"


@pytest.mark.parametrize(
    ("cc", "reason"),
    [
        ((9, 0), "needs compute capability 10.x, found 9.0"),
        ((12, 0), "needs compute capability 10.x, found 12.0"),
        ((10, 3), None),
    ],
)
def test_compute_capability_reason(monkeypatch, cc, reason):
    import torch

    monkeypatch.setattr(attn_core.discovery.probes, "needs_cuda", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cc)
    assert bp.needs_sm100() == reason
    if reason:
        assert mha_spec.SPEC.probe() == reason and cutlass_spec.SPEC.probe() == reason


def test_probe_order_and_install_hints(monkeypatch):
    assert mha_spec.probe((lambda: None, lambda: "second")) == "second"
    monkeypatch.setattr(bp.importlib.util, "find_spec", lambda name: None)
    assert bp.flashinfer_missing().startswith("not installed: pip install attn-trtllm-mla (flashinfer-python")
    assert bp.sgl_kernel_missing().startswith("not installed: pip install 'attn-trtllm-mla[cutlass]' (sgl-kernel")


@pytest.mark.parametrize("name", ["trtllm_mha", "cutlass_mla"])
def test_kit_spec_checks(name):
    target = resolve_target(name)
    assert "imports none of" in spec_import_check(target)()
    assert spec_matches_class_check(target)() == "spec and class agree"


def test_attn_core_list_says_they_never_ran_on_hardware():
    exe = os.path.join(os.path.dirname(sys.executable), "attn-core")
    rows = {
        r["name"]: r
        for r in json.loads(subprocess.run([exe, "list", "--json"], capture_output=True, text=True, timeout=120).stdout)
    }
    mha, cutlass = rows["trtllm_mha"], rows["cutlass_mla"]
    assert mha["distribution"] == cutlass["distribution"] == "attn-trtllm-mla"
    assert "never ran on hardware" in mha["unverified"] and "never ran on hardware" in cutlass["unverified"]
    assert mha["capabilities"] == "cuda; mha; bf16/fp16; pages 16,32,64; graphs uniform_batch; sinks,sliding_window"
    assert cutlass["capabilities"] == "cuda; mla; bf16/fp16; pages 128; graphs uniform_single_token_decode"
    text = subprocess.run(
        [exe, "list"], capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "400"}
    ).stdout
    line = next(ln for ln in text.splitlines() if ln.startswith("trtllm_mha "))
    assert "[unverified: TensorRT-LLM's MHA decode/context kernels (through FlashInfer) never ran on hardware" in line
