"""Peak extra memory of a step (metadata + one layer's forward) does not grow with the cached context.

Bound (docs/dev/perf-notebook.md): per call at most threads x scratch (fixed by head dims; under 1 MiB per thread at
head_dim 128) + max_splits x tokens x q heads x (Dv + 1) x 4 bytes of split partials + the output; none
of it depends on how many tokens are cached. Measured as the process's peak resident memory during the
step (glibc told to mmap every block >= 64 KiB, so freed memory leaves the RSS; the high-water mark
reset through /proc/self/clear_refs), in a subprocess. torch_native, which gathers every request's
keys, is measured the same way to show the instrument sees growth.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc/self/clear_refs")

PROBE = r"""
import ctypes, dataclasses, json, sys
ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
import torch
import attn_core.contract.backend
from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.testing.harness import AttnCase, layer_inputs, make_env, make_layer
from attn_cpu_amx.backend import CpuAmxBackend

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

def extra(name, mode, requests):
    case = AttnCase(mode, requests, num_q_heads=8, num_kv_heads=2, head_dim=128, num_layers=1, dtype="bfloat16")
    env = make_env(case)
    ctx = env.ctx
    # the backend's own memory: core's batch validation, which on the CPU gathers the batch's table rows
    # (every "full" check runs there), is left out
    attn_core.contract.backend.check_forward_batch = lambda *args, **kwargs: None
    backend = CpuAmxBackend(ctx) if name == "cpu_amx" else TorchNativeBackend(ctx)
    env.batch.attn_backend = backend
    layer = make_layer(case, 0)
    q = layer_inputs(env, 0, torch.Generator().manual_seed(0))["q"]
    def step():
        backend.init_forward_metadata(env.batch)
        backend.forward(q, None, None, layer, env.batch, save_kv_cache=False)
    step()
    best = None
    for _ in range(3):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        rss0 = status("VmRSS:")
        step()
        e = status("VmHWM:") - rss0
        best = e if best is None else min(best, e)
    return best

name, mode, lens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
out = {}
for n in lens:
    reqs = [(n, 1)] * 4 if mode == "DECODE" else [(n, 64)] * 2
    out[n] = extra(name, mode, reqs)
print(json.dumps(out))
"""

MIB = 1 << 20


def measure(name: str, mode: str, lens: list[int]) -> dict[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, name, mode, json.dumps(lens)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.parametrize("mode", ["DECODE", "EXTEND"])
def test_peak_extra_memory_independent_of_context(mode):
    import torch

    lens = [256, 4096, 32768]
    amx = measure("cpu_amx", mode, lens)
    threads = torch.get_num_threads()
    bound = threads * MIB + 16 * 128 * 8 * 129 * 4 + 128 * 8 * 128 * 2  # scratch + partials (T <= 128) + output
    assert max(amx.values()) <= bound, amx  # the stated bound holds at every context length
    # 8x more cached tokens, no growth beyond page noise (the split count, capped by max_splits, may
    # differ between short contexts; it does not grow with the context)
    assert amx[32768] <= amx[4096] + 256 * 1024, amx


def test_instrument_sees_a_gather():
    native = measure("torch_native", "DECODE", [256, 32768])
    assert native[32768] >= native[256] + 16 * MIB, native
