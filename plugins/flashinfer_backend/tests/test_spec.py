"""Spec, probe messages and registry listing of the FlashInfer backend (no GPU, no flashinfer needed)."""

import importlib.util
import subprocess
import sys

import pytest
import torch

import attn_flashinfer.spec as spec
from attn_core.contract.capabilities import CudaGraphLevel, Feature
from attn_core.contract.errors import BackendUnavailableError
from attn_core.discovery import probes, registry


def test_spec_module_imports_neither_torch_nor_flashinfer():
    code = (
        "import sys, attn_flashinfer, attn_flashinfer.spec as s\n"
        "assert s.SPEC.name == 'flashinfer' and s.SPEC.capabilities.devices == frozenset({'cuda'})\n"
        "bad = [m for m in ('torch', 'flashinfer') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_capabilities_name_what_the_backend_does():
    caps = spec.SPEC.capabilities
    assert spec.SPEC.backend_class == "attn_flashinfer.backend:FlashInferBackend"
    assert spec.SPEC.distribution == "attn-flashinfer"
    assert caps.cuda_graph == CudaGraphLevel.UNIFORM_BATCH
    assert {
        Feature.SLIDING_WINDOW,
        Feature.LOGIT_CAP,
        Feature.CUSTOM_MASK,
        Feature.CROSS_ATTENTION,
        Feature.LSE_OUTPUT,
    } <= caps.features
    assert Feature.SINKS not in caps.features
    assert caps.min_compute_capability == (8, 0)


def test_window_pool_and_chunked_local_are_declared_and_nothing_is_listed_unverified():
    """Everything declared has passed its GPU tests (docs/dev/gpu-runs.md, session of 2026-11-23)."""
    assert {Feature.SLIDING_WINDOW_POOL, Feature.CHUNKED_LOCAL_ATTENTION} <= spec.CAPABILITIES.features
    assert spec.SPEC.unverified is None


def _fake_find_spec(monkeypatch, flashinfer_present: bool):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "flashinfer":
            return importlib.util.spec_from_loader("flashinfer", loader=None) if flashinfer_present else None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_probe_without_flashinfer(monkeypatch):
    _fake_find_spec(monkeypatch, False)
    assert (
        spec.probe()
        == "flashinfer-python not installed (pip install 'flashinfer-python>=0.6.6,<0.8'; a CUDA build of torch first)"
    )


def test_probe_without_cuda(monkeypatch):
    _fake_find_spec(monkeypatch, True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert spec.probe().startswith("needs CUDA")


@pytest.mark.parametrize(
    ("cc", "reason"), [((7, 5), "needs compute capability >= 8.0, found 7.5"), ((8, 0), None), ((9, 0), None)]
)
def test_probe_compute_capability(monkeypatch, cc, reason):
    _fake_find_spec(monkeypatch, True)
    monkeypatch.setattr(probes, "gpu_device_present", lambda: True)  # a GPU node, so the probe asks torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cc)
    assert spec.probe() == reason


def test_registry_lists_the_backend_with_its_reason_here():
    entries = {e.name: e for e in registry.list_backends()}
    entry = entries["flashinfer"]
    assert entry.error is None and entry.distribution == "attn-flashinfer"
    assert entry.spec is spec.SPEC or entry.spec == spec.SPEC
    reason = spec.probe()
    if reason is None:
        pytest.skip("FlashInfer can run here: the unavailable path is not reachable")
    from attn_core.contract.context import BackendContext

    ctx = BackendContext(device="cpu", dtype=torch.bfloat16, num_q_heads=4, num_kv_heads=2, head_dim=128)
    with pytest.raises(BackendUnavailableError, match="flashinfer"):
        registry.create_backend("flashinfer", ctx)
