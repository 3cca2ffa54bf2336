"""Host time per decode step, this tree against an older one, in ONE process (issue 36's "host time per step
unchanged within 5 %"): separate processes of one tree differ by more than 5 % (docs/dev/gpu-runs.md,
2026-11-29), so `forward_host_cost.py --baseline-src`'s alternating processes cannot decide it.

The older tree's packages (`--baseline-src`, `:`-separated `src` directories holding `attn_core` and the
plugin, e.g. `git archive 55d7535 core/src plugins/triton_backend/src | tar -x -C /tmp/base`) are copied under
other names (`base_attn_core`, `base_attn_triton`: every whole-word mention of a package name in their
sources rewritten), so both trees import side by side; each builds its own pool, batch and backend from its own
public API (the backend class from its spec's `backend_class`, no entry points), and the two steps are timed
in turn, sample by sample (`attn_core.bench.timing.interleave`, rotating), so drift, clock and process state
hit both alike.

A step as `forward_host_cost.py --steps` times it (`attn_core.bench.steps.decode_steps`, given each tree's
module): `init_forward_metadata(batch)` then `layer(q, k, v, batch)` for `--layers` layers (GQA 32 q / 8 kv
heads, head_dim 128, bf16, page 16, `--context` tokens a request), at batch 1 and 256, eager and (on cuda)
through `CudaGraphRunner.run`; host µs of one step, the device drained
before each sample outside the timed span (`host_times_us`). Printed per row: the median of each tree, the
ratio this / base and a bootstrap 95 % interval of that ratio (resampling each tree's samples, fixed seed):
"within 5 %" when the interval's top is at most 1.05.

  python benchmarks/step_host_ab.py --baseline-src /tmp/base/core/src:/tmp/base/plugins/triton_backend/src \\
      --device cuda [--backend triton] [--samples 400] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
from types import ModuleType

import torch

import attn_core
from attn_core.bench.steps import decode_steps
from attn_core.bench.timing import host_times_us, interleave

PACKAGES = ("attn_core", "attn_triton")
PREFIX = "base_"
BATCHES = (1, 256)


def load_renamed(src_dirs: list[str], into: str) -> dict[str, ModuleType]:
    """The packages of PACKAGES found under `src_dirs`, copied into `into` as PREFIX + name with every whole-word
    mention of a package name in their .py files rewritten, and imported: {original name: renamed module}."""
    pattern = re.compile(r"\b(" + "|".join(PACKAGES) + r")\b")
    found = {}
    for src in src_dirs:
        for name in PACKAGES:
            if os.path.isdir(os.path.join(src, name)) and name not in found:
                dst = os.path.join(into, PREFIX + name)
                shutil.copytree(os.path.join(src, name), dst, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
                found[name] = dst
    for dst in found.values():
        for root, _, files in os.walk(dst):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    with open(path) as fh:
                        text = fh.read()
                    with open(path, "w") as fh:
                        fh.write(pattern.sub(PREFIX + r"\1", text))
    sys.path.insert(0, into)
    return {name: importlib.import_module(PREFIX + name) for name in found}


def backend_class(ac: ModuleType, plugin: ModuleType | None, name: str) -> type:
    """The backend class `name` of one tree, from its spec's `backend_class` ("module:Class") resolved inside
    that tree (no registry: the installed entry points name this tree's modules): torch_native from its core,
    a plugin's from the plugin's spec."""
    if name == "torch_native":
        spec_module = ac.__name__ + ".backends.torch_native.spec"
    elif plugin is not None:
        spec_module = plugin.__name__ + ".spec"
    else:
        raise SystemExit(f"{name}: the tree holds no plugin package")
    module, cls = importlib.import_module(spec_module).SPEC.backend_class.split(":")
    return getattr(importlib.import_module(module), cls)


def ratio_interval(base: list[float], this: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap 95 % interval of median(this) / median(base), each resampled with replacement. Example: two
    lists of identical values give (1.0, 1.0)."""
    rng = random.Random(seed)
    ratios = sorted(
        statistics.median(rng.choices(this, k=len(this))) / statistics.median(rng.choices(base, k=len(base)))
        for _ in range(draws)
    )
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-src", required=True, help="`:`-separated src dirs of the older tree")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default=None, help="triton on cuda, torch_native on the CPU by default")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--samples", type=int, default=400, help="timed steps per tree and path (in turns)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    name = args.backend or ("triton" if dev.type == "cuda" else "torch_native")
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="attn-ab-")
    try:
        base = load_renamed(args.baseline_src.split(":"), tmp)
        this = {"attn_core": attn_core}
        if name != "torch_native":
            this["attn_triton"] = importlib.import_module("attn_triton")
        trees = {"base": base, "this": this}
        rows = []
        where = f"{name} on {args.device}, {args.layers} layers, context {args.context}"
        print(f"{where}; host µs per step, {args.samples} samples")
        print(f"{'row':16} {'base':>9} {'this':>9} {'this/base':>10} {'95 % interval':>16}  verdict")
        for bs in map(int, args.batches.split(",")):
            steps = {}
            for label, mods in trees.items():
                cls = backend_class(mods["attn_core"], mods.get("attn_triton"), name)
                steps[label] = decode_steps(mods["attn_core"], cls, bs, args.layers, args.context, dev)
            for path in steps["this"]:
                fns = {label: steps[label][path] for label in trees}
                for fn in fns.values():  # warm-up: compile, capture, allocate
                    fn()
                    fn()
                measures = {label: (lambda f=fn: host_times_us(f, 1, dev)) for label, fn in fns.items()}
                samples = interleave(measures, args.samples, rotate=True)
                mb, mt = statistics.median(samples["base"]), statistics.median(samples["this"])
                lo, hi = ratio_interval(samples["base"], samples["this"])
                verdict = "within 5 %" if hi <= 1.05 else ("over 5 %" if lo > 1.05 else "undecided")
                title = f"bs{bs} {path}"
                print(f"{title:16} {mb:9.1f} {mt:9.1f} {mt / mb:10.3f} {lo:7.3f}–{hi:<7.3f}  {verdict}", flush=True)
                rows.append({"row": title, "base_us": mb, "this_us": mt, "ratio": mt / mb, "interval": [lo, hi]})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        meta = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "baseline_src": args.baseline_src,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
