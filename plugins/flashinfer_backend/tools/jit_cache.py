"""Build, export and install the FlashInfer JIT kernels attn-flashinfer uses (a GPU-machine helper).

FlashInfer compiles each kernel variant on first use (one FA2 build per dtype, head dim, sliding window
on/off and logit cap on/off; the decode, paged and ragged wrappers share it) plus small modules for the
LSE merge and mask packing. `build` compiles the variants in parallel processes by running tiny cases of
every path through the backend (which also smoke-tests them); `export DIR` copies the built libraries to
DIR/<module>/<module>.so; `install DIR` copies them into flashinfer's ahead-of-time folder
(flashinfer/data/aot), where FlashInfer loads them without compiling.

    python tools/jit_cache.py build && python tools/jit_cache.py export .fi-cache/aot
    python tools/jit_cache.py install .fi-cache/aot
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

#: one FA2 build each (dtype x head dim x sliding window on/off x logit cap on/off): every combination
#: the GPU tests run (bf16 / head_dim 128 with each layer setting; fp16, head dims 64 and 256 plain, and
#: head_dim 256 with window and cap)
VARIANTS = {
    "plain": {},
    "window": {"sliding_window": 64},
    "logit_cap": {"logit_cap": 20.0},
    "window_logit_cap": {"sliding_window": 64, "logit_cap": 20.0},
    "fp16": {"dtype": "float16"},
    "head_dim_64": {"head_dim": 64},
    "head_dim_256": {"head_dim": 256},
    "head_dim_256_window_logit_cap": {"head_dim": 256, "sliding_window": 64, "logit_cap": 20.0},
}

_CHILD = """
import sys, json
from attn_core.testing.harness import AttnCase, run_case
from attn_flashinfer.backend import FlashInferBackend
kw = json.loads(sys.argv[1])
common = {**dict(num_q_heads=8, num_kv_heads=2, head_dim=128, dtype="bfloat16", device="cuda", page_size=16), **kw}
cases = [
    AttnCase("MIXED", [(40, 1), (0, 9), (23, 5)], return_lse=True, **common),  # ragged + paged + LSE merge
    AttnCase("TARGET_VERIFY", [(30, 4), (7, 4)], **common),  # paged with a tree mask (mask packing)
    AttnCase("DECODE", [(50, 1), (3, 1)], **common),  # decode, tensor-core path
]
for case in cases:
    res = run_case(FlashInferBackend, case)
    print(("ok  " if res.ok else "FAIL") + " " + res.message().replace(chr(10), " | "), flush=True)
    if not res.ok:
        sys.exit(1)
"""


def build() -> int:
    import json

    jobs = max(2, 2 * (os.cpu_count() or 8) // len(VARIANTS))  # oversubscribe: variants finish unevenly
    env = dict(os.environ, MAX_JOBS=str(jobs))
    t0 = time.perf_counter()
    procs = {
        name: subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(kw)], env=env) for name, kw in VARIANTS.items()
    }
    failed = [name for name, p in procs.items() if p.wait() != 0]
    print(
        f"built {len(VARIANTS)} variants in {time.perf_counter() - t0:.0f} s ({jobs} compile jobs each); "
        f"failed: {failed or 'none'}"
    )
    return 1 if failed else 0


def _jit_dir() -> Path:
    from flashinfer.jit import env as jit_env

    return Path(jit_env.FLASHINFER_JIT_DIR)


def _aot_dir() -> Path:
    from flashinfer.jit import env as jit_env

    return Path(jit_env.FLASHINFER_AOT_DIR)


def export(dest: Path) -> int:
    libs = sorted(_jit_dir().glob("*/*.so"))
    for lib in libs:
        (dest / lib.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib, dest / lib.parent.name / lib.name)
    print(f"exported {len(libs)} modules to {dest}: {[lib.parent.name for lib in libs]}")
    return 0


def install(src: Path) -> int:
    libs = sorted(src.glob("*/*.so"))
    aot = _aot_dir()
    for lib in libs:
        (aot / lib.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib, aot / lib.parent.name / lib.name)
    print(f"installed {len(libs)} prebuilt modules into {aot}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build")
    sub.add_parser("export").add_argument("dir", type=Path)
    sub.add_parser("install").add_argument("dir", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "build":
        return build()
    return export(args.dir) if args.cmd == "export" else install(args.dir)


if __name__ == "__main__":
    sys.exit(main())
