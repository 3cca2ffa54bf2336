"""The registry entry: import-light spec, names and aliases, path choice from CPU flags, `attn-core list`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from attn_core.discovery.registry import create_backend, get_backend_class
from attn_core.testing.harness import AttnCase, make_env
from attn_cpu_amx import isa
from attn_cpu_amx.backend import CpuAmxBackend
from attn_cpu_amx.spec import SPEC


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=120
    )


def test_spec_probe_and_info_import_no_torch():
    code = (
        "import sys\n"
        "from attn_cpu_amx.spec import SPEC\n"
        "reason, info = SPEC.probe(), SPEC.info()\n"
        "heavy = [m for m in ('torch', 'triton', 'attn_cpu_amx.backend') if m in sys.modules]\n"
        "print(repr(reason)); print(info); print(heavy)\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    reason, info, heavy = out.stdout.strip().splitlines()
    assert heavy == "[]"
    assert reason == "None"
    assert "isa " in info and "path " in info


def test_names_resolve_to_the_backend():
    assert get_backend_class("cpu_amx") is CpuAmxBackend
    assert get_backend_class("intel_amx") is CpuAmxBackend
    env = make_env(AttnCase("DECODE", [(3, 1)]))
    assert isinstance(create_backend("intel_amx", env.ctx), CpuAmxBackend)
    assert SPEC.distribution == "attn-cpu-amx"


AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"})
AMX = AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}


@pytest.mark.parametrize(
    "flags,granted,paths",
    [
        (frozenset({"sse4_2", "avx2"}), True, ("portable",)),
        (AVX512, True, ("avx512", "portable")),
        (AMX, True, ("amx", "avx512", "portable")),
        (AMX, False, ("avx512", "portable")),  # the OS refused tile state
        (AMX - {"avx512_bf16"}, True, ("avx512", "portable")),
    ],
)
def test_runnable_paths_from_flags(flags, granted, paths):
    assert isa.runnable_paths(flags, granted) == paths


def test_choose_path():
    assert isa.choose_path("auto", ("avx512", "portable")) == ("avx512", None)
    assert isa.choose_path("portable", ("avx512", "portable")) == ("portable", None)
    path, reason = isa.choose_path("amx", ("avx512", "portable"))
    assert path is None and "amx" in reason
    path, reason = isa.choose_path("fast", ("portable",))
    assert path is None and "not one of" in reason


@pytest.mark.parametrize(
    "args,kernels",
    [
        (("amx", "bfloat16", "bfloat16", 128, 128), "amx"),
        (("amx", "float32", "float32", 128, 128), "avx512"),
        (("amx", "bfloat16", "float32", 128, 128), "avx512"),
        (("amx", "bfloat16", "bfloat16", 80, 80), "avx512"),
        (("avx512", "bfloat16", "bfloat16", 128, 128), "avx512"),
        (("portable", "bfloat16", "bfloat16", 128, 128), "portable"),
    ],
)
def test_kernel_path(args, kernels):
    assert isa.kernel_path(*args) == kernels


def test_env_var_forces_the_path():
    env = make_env(AttnCase("DECODE", [(3, 1)]))
    os.environ[isa.ENV_VAR] = "portable"
    try:
        assert CpuAmxBackend(env.ctx).path == "portable"
    finally:
        del os.environ[isa.ENV_VAR]
    assert CpuAmxBackend(env.ctx).path == isa.runnable_paths()[0]


def test_attn_core_list_shows_isa_and_path():
    out = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "attn-core"), "list"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("cpu_amx"))
    assert "available (" in line and "isa " in line and f"path {isa.runnable_paths()[0]}" in line
