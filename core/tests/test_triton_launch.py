"""`CachedLaunch` logic with a stand-in kernel: first call compiles through the normal launcher, later
calls go to the compiled handle with a 3-D grid and the constexprs appended in signature order, and a
handle that rejects the call turns the shortcut off without losing the launch. No Triton needed."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

import attn_core.ops.triton_launch as launch
from attn_core.probes import triton_interpreter_enabled


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


@pytest.fixture
def gpu_like(monkeypatch):
    monkeypatch.setattr(launch, "triton_interpreter_enabled", lambda: False)
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
    other = SimpleNamespace(is_cuda=True, get_device=lambda: 0, dtype="int64")
    run((4, 2), other, 8, A=1, B=True, num_warps=4)  # another dtype of a tensor argument: another binary
    assert k.log[4][0] == "jit"
    run((4, 2), other, 8, A=1, B=True, num_warps=4)
    assert k.log[5][0] == "cached"


def test_rejected_handle_falls_back_for_good(gpu_like):
    k = FakeKernel(fail=True)
    run = launch.CachedLaunch(k)
    run((3,), gpu_like, A=1, num_warps=4)
    run((3,), gpu_like, A=1, num_warps=4)
    run((3,), gpu_like, A=1, num_warps=4)
    assert [e[0] for e in k.log] == ["jit", "jit", "jit"] and not run.enabled


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
