"""Registry: discovery, typed errors, selection, hooks; discovery imports no torch."""

import subprocess
import sys
import textwrap
from importlib import metadata

import pytest

import attn_core
from attn_core import registry as reg
from attn_core.backends.torch_native.spec import SPEC as TORCH_NATIVE
from attn_core.capabilities import Capabilities, Feature, Requirements
from attn_core.errors import (
    ApiVersionMismatchError,
    BackendLoadError,
    BackendNotInstalledError,
    BackendUnavailableError,
    DuplicateBackendError,
    IncompatibleBackendError,
    NoBackendError,
    UnknownBackendError,
)
from attn_core.hookspecs import hookimpl
from attn_core.spec import BackendSpec

CPU_REQ = Requirements(device_type="cpu", q_dtype="float32", kv_dtype="float32", head_dim=64)


def _spec(name, **kw):
    base = dict(
        name=name,
        summary="test",
        capabilities=Capabilities(devices=frozenset({"cpu"}), q_dtypes=frozenset({"float32"}), kv_dtypes=frozenset({"float32"})),
        distribution="attn-test",
        backend_class="attn_core.backends.torch_native.backend:TorchNativeBackend",
    )
    base.update(kw)
    return BackendSpec(**base)


@pytest.fixture
def fake_plugins(tmp_path, monkeypatch):
    """Write spec modules into tmp_path and expose them as entry points of the backends group."""
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = []

    def add(name, module_source, attr="SPEC"):
        mod = f"fake_spec_{name}_{len(eps)}"
        (tmp_path / f"{mod}.py").write_text(textwrap.dedent(module_source))
        eps.append(metadata.EntryPoint(name=name, value=f"{mod}:{attr}", group=reg.ENTRY_POINT_GROUP))

    real = metadata.entry_points

    def entry_points(**kw):
        if kw.get("group") == reg.ENTRY_POINT_GROUP:
            return [e for e in real(**kw) if e.name == "torch_native"] + eps
        return real(**kw)

    monkeypatch.setattr(reg.metadata, "entry_points", entry_points)
    return add


SPEC_SRC = """
from attn_core.capabilities import Capabilities
from attn_core.spec import BackendSpec
SPEC = BackendSpec(name={name!r}, summary="x", distribution="attn-x", api_version={api!r},
    capabilities=Capabilities(devices=frozenset({{"cpu"}}), q_dtypes=frozenset({{"float32"}}), kv_dtypes=frozenset({{"float32"}})),
    backend_class="attn_core.backends.torch_native.backend:TorchNativeBackend")
"""


def test_broken_duplicate_and_api_mismatch_plugins_do_not_hide_others(fake_plugins):
    fake_plugins("broken", "raise RuntimeError('boom at import')")
    fake_plugins("notspec", "SPEC = 42")
    fake_plugins("dup", SPEC_SRC.format(name="dup", api="1.0"))
    fake_plugins("dup", SPEC_SRC.format(name="dup", api="1.2"))
    fake_plugins("future", SPEC_SRC.format(name="future", api="2.0"))
    fake_plugins("torch_native", SPEC_SRC.format(name="torch_native", api="1.0"))
    fake_plugins("good", SPEC_SRC.format(name="good", api="1.3"))
    r = reg.Registry()
    entries = r.entries()
    assert isinstance(entries["broken"].error, BackendLoadError) and "boom at import" in str(entries["broken"].error)
    assert isinstance(entries["notspec"].error, BackendLoadError)
    assert isinstance(entries["dup"].error, DuplicateBackendError)
    assert isinstance(entries["future"].error, ApiVersionMismatchError)
    for name, err in [("broken", BackendLoadError), ("dup", DuplicateBackendError), ("future", ApiVersionMismatchError)]:
        with pytest.raises(err):
            r.resolve(name)
    # the embedded backend keeps its name against an impostor; the impostor is listed as failed
    assert entries["torch_native"].ok and entries["torch_native"].distribution == "attn-core"
    assert any(isinstance(e.error, DuplicateBackendError) for n, e in entries.items() if n.startswith("torch_native@"))
    assert r.resolve("good").ok
    assert r.select_backend(CPU_REQ, prefer=["broken", "good"]) == "good"
    assert list(entries) == sorted(entries)  # deterministic order


def test_not_installed_unknown_and_suggestion():
    r = reg.Registry(use_entry_points=False)
    r.register(TORCH_NATIVE)
    with pytest.raises(BackendNotInstalledError, match="pip install attn-flashinfer") as e:
        r.resolve("flashinfer")
    assert e.value.pip_command == "pip install attn-flashinfer"
    with pytest.raises(UnknownBackendError, match="did you mean 'torch_native'") as e:
        r.resolve("torch_natve")
    assert "triton" in e.value.known
    with pytest.raises(UnknownBackendError) as e:
        r.resolve("zzz")
    assert e.value.suggestion is None


def test_unavailable_incompatible_and_no_backend():
    r = reg.Registry(use_entry_points=False)
    r.register(_spec("gpu_only", probe_fn=lambda: "needs CUDA (no CUDA device visible to torch)"))
    r.register(_spec("fp32_only", priority=5))
    with pytest.raises(BackendUnavailableError, match="needs CUDA"):
        r.check("gpu_only", CPU_REQ)
    bf16 = Requirements(device_type="cpu", q_dtype="bfloat16", kv_dtype="bfloat16", features=frozenset({Feature.SINKS}))
    with pytest.raises(IncompatibleBackendError) as e:
        r.check("fp32_only", bf16)
    assert len(e.value.reasons) == 3  # q dtype, kv dtype and the sinks feature, every one named
    assert r.select_backend(CPU_REQ) == "fp32_only"
    with pytest.raises(NoBackendError, match="gpu_only: needs CUDA"):
        r.select_backend(bf16)
    report = {row.name: row for row in r.explain(bf16)}
    assert not report["fp32_only"].usable and report["triton"].reasons == ("not installed (pip install attn-triton)",)


def test_priority_and_aliases():
    r = reg.Registry(use_entry_points=False)
    r.register(_spec("low", priority=1))
    r.register(_spec("high", priority=9, aliases=("hi",)))
    assert r.select_backend(CPU_REQ) == "high"
    assert r.select_backend(CPU_REQ, prefer=["low"]) == "low"
    assert r.resolve("hi").name == "high"


def test_pluggy_hooks_adjust_and_observe():
    r = reg.Registry(use_entry_points=False)
    seen = []

    class Plugin:
        @hookimpl
        def attn_core_register_backends(self):
            return [_spec("from_hook")]

        @hookimpl
        def attn_core_adjust_requirements(self, requirements):
            return Requirements(device_type="cpu", q_dtype="float32", kv_dtype="float32", head_dim=requirements.head_dim)

        @hookimpl
        def attn_core_backend_selected(self, name, requirements):
            seen.append((name, requirements.q_dtype))

    r.plugin_manager.register(Plugin())
    assert r.resolve("from_hook").ok
    # the adjusting hook turns a bf16 request into an fp32 one the backend serves
    r.check("from_hook", Requirements(device_type="cpu", q_dtype="bfloat16", kv_dtype="bfloat16"))
    import torch

    from attn_core.context import BackendContext

    ctx = BackendContext(device="cpu", dtype=torch.float32, num_q_heads=2, num_kv_heads=1, head_dim=8)
    r.create_backend("from_hook", ctx)
    assert seen == [("from_hook", "float32")]


def test_create_backend_by_name_from_installed_entry_point():
    import torch

    ctx = attn_core.BackendContext(device="cpu", dtype=torch.bfloat16, num_q_heads=4, num_kv_heads=2, head_dim=16)
    backend = attn_core.create_backend("torch_native", ctx)
    assert type(backend).__name__ == "TorchNativeBackend"
    assert attn_core.select_backend(ctx, prefer=["flashinfer"]) in {e.name for e in attn_core.list_backends()}
    with pytest.raises(attn_core.InvalidArgumentError, match="options"):
        attn_core.create_backend("torch_native", ctx, not_an_option=1)


def test_discovery_imports_no_torch():
    """Listing and resolving names never import torch (probing availability may: GPU probes need it)."""
    code = textwrap.dedent(
        """
        import sys
        import attn_core
        from attn_core.registry import default_registry
        names = [e.name for e in attn_core.list_backends()]
        assert "torch_native" in names, names
        default_registry().resolve("torch_native")
        assert "torch" not in sys.modules, "discovery imported torch"
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_cli_list(capsys):
    from attn_core.cli import main

    assert main(["list"]) == 0
    text = capsys.readouterr().out
    assert "torch_native" in text and "attn-core" in text
    assert "graphs uniform_batch" in text
    assert main([]) == 2  # no command: help, non-zero
