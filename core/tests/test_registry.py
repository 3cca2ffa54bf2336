"""Registry: discovery, typed errors, selection, hooks; discovery imports no torch."""

import itertools
import subprocess
import sys
import textwrap
import threading
import time
from importlib import metadata

import pytest

import attn_core
from attn_core.backends.torch_native.spec import SPEC as TORCH_NATIVE
from attn_core.contract.capabilities import Capabilities, Feature, Requirements
from attn_core.contract.errors import (
    ApiVersionMismatchError,
    BackendLoadError,
    BackendNotInstalledError,
    BackendUnavailableError,
    DuplicateBackendError,
    HookPluginError,
    IncompatibleBackendError,
    InvalidArgumentError,
    InvalidSpecError,
    NoBackendError,
    UnknownBackendError,
)
from attn_core.contract.hookspecs import hookimpl
from attn_core.contract.spec import BackendSpec
from attn_core.discovery import registry as reg
from attn_core.discovery.selection import parse_hybrid_name

_MODULE_IDS = itertools.count()
CPU_REQ = Requirements(device_type="cpu", q_dtype="float32", kv_dtype="float32", head_dim=64)


def _spec(name, **kw):
    base = dict(
        name=name,
        summary="test",
        capabilities=Capabilities(
            devices=frozenset({"cpu"}), q_dtypes=frozenset({"float32"}), kv_dtypes=frozenset({"float32"})
        ),
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
        mod = f"fake_spec_{name}_{next(_MODULE_IDS)}"  # unique per test: sys.modules caches modules
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
from attn_core.contract.capabilities import Capabilities
from attn_core.contract.spec import BackendSpec
SPEC = BackendSpec(name={name!r}, summary="x", distribution="attn-x", api_version={api!r},
    capabilities=Capabilities(devices=frozenset({{"cpu"}}), q_dtypes=frozenset({{"float32"}}),
                              kv_dtypes=frozenset({{"float32"}})),
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
    assert isinstance(entries["notspec"].error, InvalidSpecError) and "expected a BackendSpec, found int" in str(
        entries["notspec"].error
    )
    assert isinstance(entries["dup"].error, DuplicateBackendError)
    assert isinstance(entries["future"].error, ApiVersionMismatchError)
    for name, err in [
        ("broken", BackendLoadError),
        ("dup", DuplicateBackendError),
        ("future", ApiVersionMismatchError),
    ]:
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
    assert e.value.source_command == "pip install ./plugins/flashinfer_backend"
    assert "pip install ./plugins/flashinfer_backend" in str(e.value)
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
    assert not report["fp32_only"].usable and report["triton"].reasons == (
        "not installed (pip install attn-triton "
        "(from a clone of the attn repository: pip install ./plugins/triton_backend))",
    )


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
            return Requirements(
                device_type="cpu", q_dtype="float32", kv_dtype="float32", head_dim=requirements.head_dim
            )

        @hookimpl
        def attn_core_backend_selected(self, name, requirements):
            seen.append((name, requirements.q_dtype))

    r.plugin_manager.register(Plugin())
    assert r.resolve("from_hook").ok
    # the adjusting hook turns a bf16 request into an fp32 one the backend serves
    r.check("from_hook", Requirements(device_type="cpu", q_dtype="bfloat16", kv_dtype="bfloat16"))
    import torch

    from attn_core.contract.context import BackendContext

    ctx = BackendContext(device="cpu", dtype=torch.float32, num_q_heads=2, num_kv_heads=1, head_dim=8)
    r.create_backend("from_hook", ctx)
    assert seen == [("from_hook", "float32")]


def test_create_backend_by_name_from_installed_entry_point():
    import torch

    ctx = attn_core.BackendContext(device="cpu", dtype=torch.bfloat16, num_q_heads=4, num_kv_heads=2, head_dim=16)
    backend = attn_core.create_backend("torch_native", ctx)
    assert type(backend).__name__ == "TorchNativeBackend"
    selected = attn_core.select_backend(ctx, prefer=["flashinfer"])  # one backend, or hybrid(prefill=A,decode=B)
    assert set(parse_hybrid_name(selected) or (selected,)) <= {e.name for e in attn_core.list_backends()}
    with pytest.raises(attn_core.InvalidArgumentError, match="options"):
        attn_core.create_backend("torch_native", ctx, not_an_option=1)


def test_discovery_imports_no_torch():
    """Listing and resolving names never import torch (probing availability may: GPU probes need it)."""
    code = textwrap.dedent(
        """
        import sys
        import attn_core
        from attn_core.discovery.registry import default_registry
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
    from attn_core.cli.main import main

    assert main(["list"]) == 0
    text = capsys.readouterr().out
    assert "torch_native" in text and "attn-core" in text
    assert "graphs uniform_batch" in text
    assert main([]) == 2  # no command: help, non-zero


# ---- hardening: one broken plugin never breaks the others (issue 11 point 5) ----------------------

BAD_SPEC_SRC = """
from attn_core.contract.capabilities import Capabilities
from attn_core.contract.spec import BackendSpec
CAPS = Capabilities(devices=frozenset({{"cpu"}}), q_dtypes=frozenset({{"float32"}}), kv_dtypes=frozenset({{"float32"}}))
BASE = dict(name={name!r}, summary="x", distribution="attn-x", capabilities=CAPS,
    backend_class="attn_core.backends.torch_native.backend:TorchNativeBackend")
SPEC = BackendSpec(**{{**BASE, **dict({field})}})
"""


def _ctx():
    import torch

    return attn_core.BackendContext(device="cpu", dtype=torch.float32, num_q_heads=2, num_kv_heads=1, head_dim=8)


def _assert_torch_native_still_works(r):
    """Listing, explain, select and create of the embedded backend all work next to the broken plugin."""
    names = [e.name for e in r.list_backends()]
    assert "torch_native" in names
    rows = {row.name: row for row in r.explain(CPU_REQ)}
    assert rows["torch_native"].usable, rows["torch_native"]
    assert r.select_backend(CPU_REQ, prefer=["torch_native"]) == "torch_native"
    assert type(r.create_backend("torch_native", _ctx())).__name__ == "TorchNativeBackend"
    return rows


@pytest.mark.parametrize(
    "field, problem",
    [
        ("api_version=None", "api_version: expected a version string"),
        ("aliases=None", "aliases: expected a tuple of backend names, found None"),
        ("aliases='fast'", "aliases: expected a tuple of backend names, found 'fast'"),
        ("capabilities=None", "capabilities: expected a Capabilities, found None"),
        ("priority='high'", "priority: expected an int"),
        ("probe_fn=42", "probe_fn: expected None or a callable"),
        ("unverified=True", "unverified: expected None or a str"),
        ("summary=None, distribution=None", "distribution: expected a name"),
        (
            "capabilities=Capabilities(devices=None, q_dtypes=frozenset(), kv_dtypes=frozenset())",
            "capabilities.devices: expected a frozenset of str",
        ),
        (
            "capabilities=Capabilities(devices=frozenset({'cpu'}), q_dtypes=frozenset(), kv_dtypes=frozenset(), "
            "page_sizes=[1])",
            "capabilities.page_sizes: expected a frozenset of int or None",
        ),
    ],
)
def test_a_spec_with_a_bad_field_is_listed_failed_and_breaks_nothing(fake_plugins, field, problem):
    fake_plugins("bad", BAD_SPEC_SRC.format(name="bad", field=field))
    r = reg.Registry()
    bad = r.entries()["bad"]
    assert isinstance(bad.error, InvalidSpecError) and problem in str(bad.error), bad.error
    with pytest.raises(InvalidSpecError):
        r.resolve("bad")
    rows = _assert_torch_native_still_works(r)
    assert not rows["bad"].usable and problem in rows["bad"].reasons[0]


def test_bad_specs_from_hooks_and_register_are_listed_failed():
    r = reg.Registry(use_entry_points=False)
    r.register(TORCH_NATIVE)
    r.register(_spec("reg_bad", aliases=None))
    r.register(None)

    class Plugin:
        @hookimpl
        def attn_core_register_backends(self):
            return [_spec("hook_bad", api_version=None), object()]

    r.plugin_manager.register(Plugin(), name="specs_plugin")
    entries = r.entries()
    assert isinstance(entries["reg_bad"].error, InvalidSpecError)
    assert isinstance(entries["hook_bad"].error, InvalidSpecError) and "api_version" in str(entries["hook_bad"].error)
    odd = sorted((str(e.error) for n, e in entries.items() if n.startswith("?")), key=len)
    assert len(odd) == 2 and "expected a BackendSpec, found NoneType" in odd[0] and "found object" in odd[1]
    _assert_torch_native_still_works(r)


def test_an_alias_never_shadows_a_backend_name(fake_plugins):
    alias_src = BAD_SPEC_SRC.replace("{field}", "aliases={aliases!r}")
    fake_plugins("evil", alias_src.format(name="evil", aliases=("torch_native", "triton", "quick")))
    fake_plugins("other", alias_src.format(name="other", aliases=("quick", "evil", "other_fast")))
    r = reg.Registry()
    # the embedded backend keeps its name: no plugin alias takes torch_native over
    assert r.resolve("torch_native").distribution == "attn-core"
    assert r.resolve("evil").name == "evil"  # "other" cannot take "evil" as an alias either
    with pytest.raises(BackendNotInstalledError):  # "triton" is reserved for attn-triton
        r.resolve("triton")
    with pytest.raises(DuplicateBackendError, match="quick"):  # claimed by two: refused for both
        r.resolve("quick")
    assert r.resolve("other_fast").name == "other"
    assert r.aliases() == {"other_fast": "other"}
    notes = " | ".join(r.entries()["evil"].notes)
    assert "'torch_native' refused" in notes and "'triton' refused: it is reserved for attn-triton" in notes
    assert "'quick' refused: also claimed by other" in notes
    _assert_torch_native_still_works(r)


def _blocking_probe(release: threading.Event):
    def probe():
        release.wait(20)  # bounded, so that a registry without time limits fails the test instead of hanging
        return None

    return probe


def test_a_hanging_probe_does_not_hang_list_explain_or_select():
    release = threading.Event()
    try:
        r = reg.Registry(use_entry_points=False, probe_timeout=0.3)
        r.register(TORCH_NATIVE)
        r.register(_spec("hangs", priority=100, probe_fn=_blocking_probe(release)))
        r.register(_spec("hangs_too", priority=100, probe_fn=_blocking_probe(release)))
        start = time.monotonic()
        rows = {row.name: row for row in r.explain(CPU_REQ)}
        assert time.monotonic() - start < 0.3 * 2 + 0.5  # the probes wait together: one limit, not two
        assert rows["hangs"].reasons == ("probe timed out after 0.3 s",)
        assert rows["hangs_too"].reasons == ("probe timed out after 0.3 s",)
        start = time.monotonic()
        assert r.select_backend(CPU_REQ) == "torch_native"
        with pytest.raises(BackendUnavailableError, match="probe timed out after 0.3 s"):
            r.check("hangs", CPU_REQ)
        assert time.monotonic() - start < 0.5  # a timed-out probe is not waited for again
        _assert_torch_native_still_works(r)
        release.set()  # the probe finishes late: its real answer is used from then on
        deadline = time.monotonic() + 5
        while r.resolve("hangs").probe() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.resolve("hangs").probe() is None and r.select_backend(CPU_REQ) in {"hangs", "hangs_too"}
    finally:
        release.set()


def test_probe_timeout_from_the_environment(monkeypatch):
    release = threading.Event()
    try:
        monkeypatch.setenv("ATTN_CORE_PROBE_TIMEOUT", "0.2")
        r = reg.Registry(use_entry_points=False)
        r.register(_spec("hangs", probe_fn=_blocking_probe(release)))
        assert r.resolve("hangs").probe() == "probe timed out after 0.2 s"
    finally:
        release.set()
    from attn_core.testing.target import resolve_target

    release2 = threading.Event()
    try:  # the conformance kit probes the same way
        target = resolve_target(_spec("hangs", probe_fn=_blocking_probe(release2)))
        assert target.probe() == "probe timed out after 0.2 s"
        assert resolve_target(_spec("exits", probe_fn=_exits)).probe() == "probe failed: SystemExit: 3"
    finally:
        release2.set()
    for bad in ("nan", "-1", "0", "soon"):
        monkeypatch.setenv("ATTN_CORE_PROBE_TIMEOUT", bad)
        r = reg.Registry(use_entry_points=False)
        r.register(_spec("fine"))
        with pytest.raises(InvalidArgumentError, match="ATTN_CORE_PROBE_TIMEOUT"):
            r.resolve("fine").probe()
    with pytest.raises(InvalidArgumentError, match="probe_timeout"):
        reg.Registry(probe_timeout=float("inf"))


def _exits():
    sys.exit(3)


def _interrupts():
    raise KeyboardInterrupt("raised by the probe itself")


def test_a_probe_calling_sys_exit_or_raising_is_contained(fake_plugins):
    fake_plugins("exits_at_import", "import sys\nsys.exit(4)")
    r = reg.Registry()
    r.register(_spec("exits", probe_fn=_exits))
    r.register(_spec("interrupts", probe_fn=_interrupts))
    r.register(_spec("raises", probe_fn=lambda: 1 / 0))
    r.register(_spec("says_false", probe_fn=lambda: False))
    rows = _assert_torch_native_still_works(r)
    assert rows["exits"].reasons == ("probe failed: SystemExit: 3",)
    assert rows["interrupts"].reasons == ("probe failed: KeyboardInterrupt: raised by the probe itself",)
    assert rows["raises"].reasons == ("probe failed: ZeroDivisionError: division by zero",)
    assert rows["says_false"].reasons == ("probe returned False (expected None or a reason string)",)
    assert "SystemExit: 4" in rows["exits_at_import"].reasons[0]
    with pytest.raises(BackendUnavailableError, match="SystemExit"):
        r.create_backend("exits", _ctx())


def test_a_raising_adjust_requirements_hook_is_reported_not_fatal():
    r = reg.Registry(use_entry_points=False)
    r.register(TORCH_NATIVE)
    r.register(_spec("fp32_only"))
    calls = []

    class Adjusts:
        @hookimpl
        def attn_core_adjust_requirements(self, requirements):
            calls.append("adjusts")
            return Requirements(
                device_type="cpu", q_dtype="float32", kv_dtype="float32", head_dim=requirements.head_dim
            )

    class Raises:
        @hookimpl
        def attn_core_adjust_requirements(self, requirements):
            calls.append("raises")
            raise RuntimeError("adjust hook bug")

        @hookimpl
        def attn_core_backend_selected(self, name, requirements):
            raise AssertionError("never called once the plugin failed")

    class Observes:
        @hookimpl
        def attn_core_backend_selected(self, name, requirements):
            raise SystemExit("observer bug")

    r.plugin_manager.register(Adjusts(), name="adjusts")
    r.plugin_manager.register(Raises(), name="raises")  # called first (pluggy calls the last registered first)
    r.plugin_manager.register(Observes(), name="observes")
    # the good hook's adjustment still applies: a bf16 request is served by the fp32-only backend
    r.check("fp32_only", Requirements(device_type="cpu", q_dtype="bfloat16", kv_dtype="bfloat16"))
    assert calls == ["raises", "adjusts"]
    rows = _assert_torch_native_still_works(r)
    assert not rows["hook:raises"].usable and "adjust hook bug" in rows["hook:raises"].reasons[0]
    assert "observer bug" in str(r.entries()["hook:observes"].error)  # raised in create_backend, contained
    assert isinstance(r.entries()["hook:raises"].error, HookPluginError)
    assert calls.count("raises") == 1  # a failed plugin's hooks are no longer called


@pytest.fixture
def fake_hook_distribution(tmp_path, monkeypatch):
    """A distribution (dist-info on sys.path) whose entry points are pluggy hook plugins: seen by
    importlib.metadata (so by pluggy and by the registry) like an installed one."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(plugins: dict[str, str]):
        info = tmp_path / "attn_fake_hooks-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: attn-fake-hooks\nVersion: 1.0\n")
        lines = ["[attn_core]"]
        for name, src in plugins.items():
            mod = f"fake_hook_{name}_{next(_MODULE_IDS)}"
            (tmp_path / f"{mod}.py").write_text(textwrap.dedent(src))
            lines.append(f"{name} = {mod}")
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")

    return make


def test_a_hook_plugin_that_fails_to_import_does_not_drop_the_others(fake_hook_distribution):
    fake_hook_distribution(
        {
            "a_broken": "raise ImportError('needs libvendor.so')",
            "b_good": """
                from attn_core.contract.capabilities import Capabilities
                from attn_core.contract.hookspecs import hookimpl
                from attn_core.contract.spec import BackendSpec

                @hookimpl
                def attn_core_register_backends():
                    caps = Capabilities(
                        devices=frozenset({"cpu"}), q_dtypes=frozenset({"float32"}), kv_dtypes=frozenset({"float32"})
                    )
                    return [BackendSpec(name="from_good_hook", summary="x", distribution="attn-fake-hooks",
                        capabilities=caps, backend_class="attn_core.backends.torch_native.backend:TorchNativeBackend")]
                """,
            "c_raises": """
                from attn_core.contract.hookspecs import hookimpl

                @hookimpl
                def attn_core_register_backends():
                    raise RuntimeError("register hook bug")
                """,
        }
    )
    r = reg.Registry()
    entries = r.entries()
    assert entries["from_good_hook"].ok and r.resolve("from_good_hook").spec.distribution == "attn-fake-hooks"
    broken = entries["hook:a_broken"]
    assert isinstance(broken.error, HookPluginError) and "needs libvendor.so" in str(broken.error)
    assert broken.distribution == "attn-fake-hooks"
    assert "register hook bug" in str(entries["hook:c_raises"].error)
    _assert_torch_native_still_works(r)


def test_cli_list_shows_failed_specs_and_hook_plugins(fake_plugins, fake_hook_distribution, monkeypatch, capsys):
    from attn_core.cli.main import main

    fake_plugins("bad", BAD_SPEC_SRC.format(name="bad", field="aliases=None"))
    fake_hook_distribution({"a_broken": "raise ImportError('needs libvendor.so')"})
    monkeypatch.setattr(reg, "_default", reg.Registry())
    assert main(["list"]) == 0
    text = capsys.readouterr().out
    assert "failed: attention backend 'bad'" in text and "aliases: expected a tuple" in text
    assert "hook:a_broken" in text and "needs libvendor.so" in text
