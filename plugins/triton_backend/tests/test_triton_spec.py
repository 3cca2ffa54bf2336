"""The registry entry: import-light spec, probe messages, entry point, declared capabilities."""

from __future__ import annotations

import subprocess
import sys

from attn_core.contract.capabilities import Feature
from attn_core.contract.forward_mode import ForwardMode


def test_spec_import_is_light():
    code = (
        "import sys; import attn_triton.spec as s; "
        "bad = sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules); "
        "assert not bad, bad; assert s.SPEC.name == 'triton'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_entry_point_resolves_to_the_spec():
    from attn_core.discovery.registry import Registry

    entry = Registry().entries()["triton"]
    assert entry.spec.distribution == "attn-triton"
    assert entry.spec.backend_class == "attn_triton.backend:TritonAttnBackend"


def test_probe_without_triton(monkeypatch):
    import attn_triton.spec as spec

    monkeypatch.setattr(
        spec, "module_missing", lambda m, hint: f"{m} not installed ({hint})" if m == "triton" else None
    )
    assert spec.probe() == "triton not installed (pip install triton)"


def test_probe_without_gpu(monkeypatch):
    import torch

    import attn_triton.spec as spec

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(spec, "gpu_device_present", lambda: True)  # a GPU node, but torch sees no GPU
    reason = spec.probe()
    assert reason.startswith("needs a CUDA or ROCm GPU (torch ")
    assert "TRITON_INTERPRET=1" in reason
    monkeypatch.setattr(spec, "gpu_device_present", lambda: False)  # no GPU node: said without asking torch
    reason = spec.probe()
    assert reason.startswith("needs a CUDA or ROCm GPU (none on this machine)") and "TRITON_INTERPRET=1" in reason


def test_info_names_the_cached_launch_state(monkeypatch):
    import attn_triton.spec as spec

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert spec.info().startswith("cached index launch off: TRITON_INTERPRET=1")


def test_probe_with_interpreter(monkeypatch):
    import torch

    import attn_triton.spec as spec

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert spec.probe() is None


def test_declared_capabilities():
    from attn_triton.backend import TritonAttnBackend
    from attn_triton.spec import CAPABILITIES, SPEC

    assert SPEC.load() is TritonAttnBackend
    assert TritonAttnBackend.capabilities is CAPABILITIES
    assert CAPABILITIES.devices == {"cuda", "cpu"}
    assert {Feature.DETERMINISTIC, Feature.CUSTOM_MASK, Feature.LSE_OUTPUT} <= CAPABILITIES.features
    assert ForwardMode.SPLIT_PREFILL not in CAPABILITIES.forward_modes
    assert {64, 128, 256} <= CAPABILITIES.head_dims and 576 in CAPABILITIES.mla_head_dims
