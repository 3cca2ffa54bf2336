"""Where attn-cpu-amx's declared phase priorities put each phase (issue 39): decode always on cpu_amx; prefill
on cpu_amx where its AVX-512 or AMX path runs, on torch_native where only the portable path does (slower
than torch_native there: docs/dev/perf-notebook.md)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from attn_core.backends.torch_native.spec import SPEC as TORCH_NATIVE
from attn_core.contract.capabilities import Requirements
from attn_core.discovery import registry as reg
from attn_cpu_amx import isa, spec


def _select(flags, dtype="bfloat16") -> str:
    r = reg.Registry(use_entry_points=False)
    r.register(dataclasses.replace(spec.SPEC, probe_fn=lambda: None))
    r.register(TORCH_NATIVE)
    return r.select_backend(Requirements(device_type="cpu", cpu_flags=frozenset(flags), q_dtype=dtype, kv_dtype=dtype))


def test_avx2_cpu_prefills_on_torch_native_and_decodes_on_cpu_amx():
    assert _select({"avx", "avx2", "fma"}) == "hybrid(prefill=torch_native,decode=cpu_amx)"
    assert _select({"avx", "avx2", "fma"}, "float32") == "cpu_amx"  # measured faster than torch_native in float32


def test_avx512_and_amx_cpus_run_cpu_amx_alone():
    assert _select(isa.AVX512_FLAGS) == "cpu_amx"
    assert _select(isa.AMX_FLAGS) == "cpu_amx"


def test_forcing_the_portable_path_drops_the_avx512_declaration():
    code = "from attn_cpu_amx import spec; print(len(spec.PHASE_PRIORITIES))"
    env = {"ATTN_CPU_AMX_ISA": "portable", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "1"
    assert len(spec.PHASE_PRIORITIES) == (1 if isa.requested_path() == "portable" else 2)
