"""The registry entries: import-light specs, probe reasons (the same from the registry, `attn-core list` and
construction), entry points, declared capabilities, and a priority that keeps both out of `select_backend`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import attn_core as ac
from attn_core.contract.errors import BackendUnavailableError

NAMES = ("double_sparsity", "dual_chunk")


def test_spec_import_is_light():
    code = (
        "import sys; import attn_sparse.spec as s; "
        "bad = sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules); "
        "assert not bad, bad; print(s.DOUBLE_SPARSITY.name, s.DUAL_CHUNK.name)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == list(NAMES), out.stderr


def test_entry_points_resolve_to_the_specs():
    from attn_core.discovery.registry import Registry

    entries = Registry().entries()
    assert entries["double_sparsity"].spec.backend_class == "attn_sparse.double_sparsity.backend:DoubleSparsityBackend"
    assert entries["dual_chunk"].spec.backend_class == "attn_sparse.dual_chunk.backend:DualChunkBackend"
    assert {entries[n].spec.distribution for n in NAMES} == {"attn-sparse"}


def test_probe_reasons(monkeypatch):
    import attn_sparse.spec as spec

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert spec.probe() is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(spec, "gpu_device_present", lambda: False)
    reason = spec.probe()
    assert reason.startswith("needs a CUDA GPU (none on this machine)") and "TRITON_INTERPRET=1" in reason
    monkeypatch.setattr(spec, "gpu_device_present", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert spec.probe().startswith("needs a CUDA GPU (torch ")
    monkeypatch.setattr(
        spec, "module_missing", lambda m, hint: f"{m} not installed ({hint})" if m == "triton" else None
    )
    assert spec.probe() == "triton not installed (pip install attn-sparse)"


@pytest.fixture
def fresh_registry():
    """The default registry caches each backend's probe per process: forget it before and after."""
    from attn_core.discovery.registry import refresh

    refresh()
    yield
    refresh()


def test_every_command_gives_the_same_reason(monkeypatch, capsys, fresh_registry):
    """Without the interpreter or a GPU: the registry's probe, `attn-core list` and construction agree."""
    import attn_sparse.spec as spec
    from attn_core.cli.main import main
    from attn_core.discovery.registry import Registry

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(spec, "gpu_device_present", lambda: False)
    reason = spec.probe()
    for name in NAMES:
        assert Registry().entries()[name].probe() == reason
    main(["list", "--json"])
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert all(rows[name]["state"] == "unavailable" and rows[name]["reason"] == reason for name in NAMES)
    ctx = ac.BackendContext("cpu", torch.float32, 4, 2, 32)
    from attn_sparse.dual_chunk.backend import DualChunkBackend

    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        DualChunkBackend(ctx, chunk_size=64)


def test_declared_capabilities_and_priority(monkeypatch):
    from attn_sparse.double_sparsity.backend import DoubleSparsityBackend
    from attn_sparse.dual_chunk.backend import DualChunkBackend
    from attn_sparse.spec import CAPABILITIES, DOUBLE_SPARSITY, DUAL_CHUNK

    assert DOUBLE_SPARSITY.load() is DoubleSparsityBackend and DUAL_CHUNK.load() is DualChunkBackend
    assert DoubleSparsityBackend.capabilities is CAPABILITIES is DualChunkBackend.capabilities
    assert CAPABILITIES.cuda_graph == ac.CudaGraphLevel.UNIFORM_SINGLE_TOKEN_DECODE
    assert CAPABILITIES.forward_modes == {
        ac.ForwardMode.EXTEND,
        ac.ForwardMode.DECODE,
        ac.ForwardMode.MIXED,
        ac.ForwardMode.IDLE,
    }
    assert DOUBLE_SPARSITY.priority < 0 and DUAL_CHUNK.priority < 0
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ctx = ac.BackendContext("cpu", torch.float16, 4, 2, 64)
    assert ac.select_backend(ctx) not in NAMES  # they change what attention computes: chosen by name only
