"""`CachedLaunch` logic with a stand-in kernel: first call compiles through the normal launcher, later
calls go to the compiled handle with a 3-D grid and the constexprs appended in signature order, and a
handle that rejects the call turns the shortcut off (logged once, queryable) without losing the launch;
the shortcut is gated on the verified Triton versions. No Triton needed."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

import attn_core.ops.triton_launch as launch
from attn_core.discovery.probes import triton_interpreter_enabled


class FakeCompiled:
    def __init__(self, log, fail=False):
        self.log, self.fail = log, fail

    def __getitem__(self, grid):
        def runner(*args):
            if self.fail:
                raise TypeError("launcher expects other arguments")
            self.log.append(("cached", grid, args))

        return runner


class FakeKernel:
    def __init__(self, fail=False):
        self.log, self.fail = [], fail

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, tuple(kwargs.items())))
            return FakeCompiled(self.log, self.fail)

        return run


class FakeTensor(SimpleNamespace):
    def data_ptr(self):
        return self.address


@pytest.fixture
def gpu_like(monkeypatch):
    monkeypatch.setattr(launch, "triton_interpreter_enabled", lambda: False)
    monkeypatch.setattr(launch, "_installed_triton_version", lambda: "3.6.0")  # a verified version
    monkeypatch.delenv(launch.ENV_SWITCH, raising=False)
    return SimpleNamespace(is_cuda=True, get_device=lambda: 0)


def test_second_call_uses_the_compiled_handle(gpu_like):
    k = FakeKernel()
    run = launch.CachedLaunch(k)
    run((4, 2), gpu_like, 7, A=1, B=True, num_warps=4)
    run((4, 2), gpu_like, 8, A=1, B=True, num_warps=4)
    assert k.log[0] == ("jit", (4, 2), (gpu_like, 7), (("A", 1), ("B", True), ("num_warps", 4)))
    assert k.log[1] == ("cached", (4, 2, 1), (gpu_like, 8, 1, True))
    run((4, 2), gpu_like, 9, A=2, B=True, num_warps=4)  # another constexpr set compiles again
    assert k.log[2][0] == "jit"
    run((4, 2), gpu_like, 2**40, A=1, B=True, num_warps=4)  # an int that needs 64 bits: another binary
    assert k.log[3][0] == "jit"
    other = FakeTensor(is_cuda=True, get_device=lambda: 0, dtype="int64", address=64)
    run((4, 2), other, 8, A=1, B=True, num_warps=4)  # another dtype of a tensor argument: another binary
    assert k.log[4][0] == "jit"
    run((4, 2), other, 8, A=1, B=True, num_warps=4)
    assert k.log[5][0] == "cached"


def test_the_compiled_handle_gets_tensor_addresses(gpu_like):
    k = FakeKernel()
    run = launch.CachedLaunch(k)
    a = FakeTensor(is_cuda=True, get_device=lambda: 0, dtype="int32", address=4096)
    b = FakeTensor(is_cuda=True, dtype="int64", address=8192)
    run((2,), a, 5, b, True, A=1, num_warps=4)
    run((2,), a, 6, b, True, A=1, num_warps=4)
    assert k.log[0] == ("jit", (2,), (a, 5, b, True), (("A", 1), ("num_warps", 4)))  # compiling sees the tensors
    assert k.log[1] == ("cached", (2, 1, 1), (4096, 6, 8192, True, 1))
    b.address = 12288  # another buffer of the same dtype: same binary, its address
    run((2,), a, 6, b, True, A=1, num_warps=4)
    assert k.log[2] == ("cached", (2, 1, 1), (4096, 6, 12288, True, 1))
    cpu = FakeTensor(is_cuda=False, dtype="int64", address=16)  # a CPU tensor: the normal launcher refuses it
    run((2,), a, 6, cpu, True, A=1, num_warps=4)
    assert k.log[3][0] == "jit" and k.log[3][2][2] is cpu and run.enabled
    run.pointers_as_ints = False  # the tensors themselves, as Triton's own launch passes them
    run((2,), a, 6, b, True, A=1, num_warps=4)
    assert k.log[4] == ("cached", (2, 1, 1), (a, 6, b, True, 1))


def test_rejected_handle_falls_back_for_good_and_says_so(gpu_like, caplog):
    k = FakeKernel(fail=True)
    run = launch.CachedLaunch(k)
    with caplog.at_level("WARNING", logger=launch.__name__):
        run((3,), gpu_like, A=1, num_warps=4)
        run((3,), gpu_like, A=1, num_warps=4)
        run((3,), gpu_like, A=1, num_warps=4)
    assert [e[0] for e in k.log] == ["jit", "jit", "jit"] and not run.enabled
    assert run.off_reason == "the compiled handle rejected a call (TypeError: launcher expects other arguments)"
    said = [r.getMessage() for r in caplog.records if "is off" in r.getMessage()]
    assert len(said) == 1 and run.off_reason in said[0]


class BrokenCompiled:
    def __getitem__(self, grid):
        def runner(*args):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        return runner


def test_a_real_launch_error_propagates(gpu_like):
    k = FakeKernel()
    run = launch.CachedLaunch(k)
    run((1,), gpu_like, A=1)
    key = next(iter(run.compiled))
    run.compiled[key] = (BrokenCompiled(), run.compiled[key][1])
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run((1,), gpu_like, A=1)
    assert run.enabled  # not a launcher-ABI problem: the shortcut stays on


@pytest.mark.parametrize(
    "version, switch, off",
    [
        ("3.6.0", "1", None),
        ("3.6.1+git0abc", "1", None),
        ("3.9.0", "1", "Triton 3.9.0 is not among"),
        ("3.5.1", "1", "3.6"),
        ("3.9.0", "force", None),
        ("3.6.0", "0", "ATTN_TRITON_CACHED_LAUNCH=0"),
        (None, "1", "not installed"),
    ],
)
def test_version_gate(version, switch, off):
    reason = launch.version_gate(version, switch)
    assert (reason is None) if off is None else (off in reason)


def test_unverified_triton_uses_the_normal_launcher_and_says_so_once(gpu_like, monkeypatch, caplog):
    monkeypatch.setattr(launch, "_installed_triton_version", lambda: "3.9.0")
    launch._logged.clear()
    k = FakeKernel()
    runs = [launch.CachedLaunch(k), launch.CachedLaunch(k)]
    with caplog.at_level("WARNING", logger=launch.__name__):
        for run in runs:
            run((1,), gpu_like, A=1)
            run((1,), gpu_like, A=1)
    assert [e[0] for e in k.log] == ["jit"] * 4
    assert all("Triton 3.9.0 is not among the versions" in run.off_reason for run in runs)
    assert len([r for r in caplog.records if "is off" in r.getMessage()]) == 1
    monkeypatch.setenv(launch.ENV_SWITCH, "force")
    forced = launch.CachedLaunch(k)
    forced((1,), gpu_like, A=1)
    forced((1,), gpu_like, A=1)
    assert k.log[-1][0] == "cached" and forced.enabled


def test_status_line(monkeypatch):
    monkeypatch.setattr(launch, "_installed_triton_version", lambda: "3.6.0")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert launch.cached_launch_status().startswith("off: TRITON_INTERPRET=1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv(launch.ENV_SWITCH, raising=False)
    assert launch.cached_launch_status() == "on (Triton 3.6.0)"
    monkeypatch.setenv(launch.ENV_SWITCH, "0")
    assert launch.cached_launch_status() == "off: ATTN_TRITON_CACHED_LAUNCH=0"


def test_cpu_tensors_and_switch_use_the_normal_launcher(gpu_like, monkeypatch):
    k = FakeKernel()
    run = launch.CachedLaunch(k)
    cpu = SimpleNamespace(is_cuda=False)
    run((1,), cpu, A=1)
    run((1,), cpu, A=1)
    monkeypatch.setenv("ATTN_TRITON_CACHED_LAUNCH", "0")
    off = launch.CachedLaunch(k)
    off((1,), gpu_like, A=1)
    off((1,), gpu_like, A=1)
    assert [e[0] for e in k.log] == ["jit"] * 4


def test_interpreter_runs_use_the_normal_launcher(gpu_like, monkeypatch):
    monkeypatch.setattr(launch, "triton_interpreter_enabled", lambda: True)
    k = FakeKernel()
    run = launch.CachedLaunch(k)
    run((1,), gpu_like, A=1)
    run((1,), gpu_like, A=1)
    assert [e[0] for e in k.log] == ["jit"] * 2 and not run.compiled


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), (" ON ", True), ("0", False), ("", False)])
def test_interpreter_flag(monkeypatch, value, on):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_interpreter_enabled() is on


def test_launcher_module_imports_no_triton_or_torch():
    code = "import sys, attn_core.ops.triton_launch; assert not {'triton', 'torch'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


class DirectCompiled(FakeCompiled):
    """A compiled kernel with loaded handles, as Triton's `CompiledKernel` has after its first launch."""

    function, packed_metadata = "fn-handle", "packed"

    def run(self, *args):
        self.log.append(("direct", args))


def test_launcher_called_directly_on_the_device_stream(gpu_like):
    k = FakeKernel()
    run = launch.CachedLaunch(k)
    a = FakeTensor(is_cuda=True, get_device=lambda: 1, dtype="int32", address=4096)
    run((2,), a, 5, A=7, num_warps=4)  # compiles (and gates)
    streams = []
    run._stream_of = lambda device: streams.append(device) or 99
    exit_hook = SimpleNamespace(calls=["a hook"])  # a chain holding a hook, as triton.knobs keeps them
    run._runtime = SimpleNamespace(launch_enter_hook=SimpleNamespace(calls=[]), launch_exit_hook=exit_hook)
    key = next(iter(run.compiled))
    run.compiled[key] = (DirectCompiled(k.log), run.compiled[key][1])
    run((2, 3), a, 6, A=7, num_warps=4)
    assert k.log[-1] == ("direct", (2, 3, 1, 99, "fn-handle", "packed", None, None, exit_hook, 4096, 6, 7))
    assert streams == [1]  # the current stream of the first tensor's device
    run._runtime.launch_exit_hook = SimpleNamespace(calls=[])  # an empty chain: the launcher gets None
    run((2, 3), a, 6, A=7, num_warps=4)
    assert k.log[-1][1][8] is None
    run._runtime.launch_enter_hook = SimpleNamespace(calls=["profiler"])  # wants Triton's launch metadata: its handle
    run((2, 3), a, 6, A=7, num_warps=4)
    assert k.log[-1] == ("cached", (2, 3, 1), (4096, 6, 7))
    run._stream_of = None  # no stream query (Triton's driver not importable): the handle too
    run._runtime.launch_enter_hook = None  # (None: no hook, as older Tritons keep it)
    run((2, 3), a, 6, A=7, num_warps=4)
    assert k.log[-1][0] == "cached"


def test_other_keyword_names_with_equal_values_get_their_own_binary(gpu_like):
    k = FakeKernel()
    run = launch.CachedLaunch(k)
    run((1,), gpu_like, A=1, B=2, num_warps=4)
    run((1,), gpu_like, A=1, B=2, num_warps=4)
    run((1,), gpu_like, A=1, C=2, num_warps=4)  # same values under other names: not the first binary
    run((1,), gpu_like, A=1, C=2, num_warps=4)
    assert [e[0] for e in k.log] == ["jit", "cached", "jit", "cached"]


def test_repeated_tensor_arguments_share_one_lookup():
    t = FakeTensor(is_cuda=True, dtype="int32", address=4096)
    u = FakeTensor(is_cuda=True, dtype="int64", address=8192)
    types, ptrs = launch._types_and_pointers((t, 3, t, t, u, t), FakeTensor)
    assert types == ("int32", "i32", "int32", "int32", "int64", "int32") and ptrs == (4096, 3, 4096, 4096, 8192, 4096)
    cpu = FakeTensor(is_cuda=False, dtype="int32", address=16)
    assert launch._types_and_pointers((t, cpu), FakeTensor)[1] is None


def test_bound_launch_goes_direct_after_the_parents_entry(gpu_like):
    """`bind`: the first call compiles through the parent, the second launches from the parent's cache (and
    keeps its entry), later calls go straight to the launcher with the bound grid (3-D) and constexprs; a
    new argument type compiles again through the parent; the parent turned off sends every call its way."""
    k = FakeKernel()
    run = launch.CachedLaunch(k)
    bound = run.bind((4, 2), A=3, B=False, num_warps=4)
    a = FakeTensor(is_cuda=True, get_device=lambda: 0, dtype="int32", address=4096)
    bound(a, 5)
    assert k.log[-1] == ("jit", (4, 2), (a, 5), (("A", 3), ("B", False), ("num_warps", 4)))
    run._runtime, run._stream_of = SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None), lambda device: 99
    key = next(iter(run.compiled))
    run.compiled[key] = (DirectCompiled(k.log), run.compiled[key][1])
    bound(a, 6)  # from the parent's cache
    assert (
        k.log[-1] == ("direct", (4, 2, 1, 99, "fn-handle", "packed", None, None, None, 4096, 6, 3, False))
        and bound._entries
    )
    a.address = 8192
    bound(a, 7)  # the bound path: the same launch, the new address
    assert k.log[-1] == ("direct", (4, 2, 1, 99, "fn-handle", "packed", None, None, None, 8192, 7, 3, False))
    n = len(k.log)
    bound(a, 2**40)  # an int needing 64 bits: another binary, compiled by the parent
    assert len(k.log) == n + 1 and k.log[-1][0] == "jit"
    cpu = FakeTensor(is_cuda=False, get_device=lambda: -1, dtype="int32", address=16)
    bound(cpu, 7)  # off the GPU: the normal launcher
    assert k.log[-1] == ("jit", (4, 2), (cpu, 7), (("A", 3), ("B", False), ("num_warps", 4)))
    run._turn_off("a test")
    bound(a, 7)
    assert k.log[-1][0] == "jit" and not run.compiled


def test_bound_launch_rejected_by_the_handle_falls_back(gpu_like):
    k = FakeKernel()
    run = launch.CachedLaunch(k)
    bound = run.bind((1,), A=1)
    a = FakeTensor(is_cuda=True, get_device=lambda: 0, dtype="int32", address=4096)
    bound(a)
    bound(a)
    key = next(iter(run.compiled))
    bound._entries[(0, ("int32",))] = (FakeCompiled(k.log, fail=True), run.compiled[key][1])
    run._stream_of = None  # the compiled handle is called (and rejects the call)
    bound(a)
    assert k.log[-1] == ("jit", (1,), (a,), (("A", 1),)) and not run.enabled
