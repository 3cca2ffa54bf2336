"""Host cost of attn-core's per-layer call: `AttentionLayer.__call__` → `AttentionBackend.forward` →
argument validation → dispatch, with the backend's kernels stubbed out.

The backend is attn-core's `torch_native` with `forward_decode` / `forward_extend` replaced by a stub that
returns a preallocated output, so the time is attn-core's path alone (what every backend pays per layer
before its own code runs). Inputs as an engine hands them: q `[T, Hq*D]`, k / v `[T, Hkv, D]`,
save_kv_cache=True (the stub writes nothing), no extras. Sizes as in `cpu_vs_peers.py` (GQA 32 q / 8 kv
heads, head_dim 128, bf16, page size 16); the context length does not matter with the kernels stubbed.

Rows:
  decode bs1        DECODE, 1 request (2047 cached tokens + 1 new)
  decode bs64       DECODE, 64 requests (255 cached + 1 new)
  extend bs4 q128   EXTEND, 4 requests (128 cached + 128 new)
  mla decode bs1    absorbed MLA as in `mla_vs_peers.py` (128 heads, latent 512 + 64): DECODE, 1 request
                    (2047 cached + 1 new), q `[1, 128, 576]`, k `[1, 1, 576]`, v None, save_kv_cache=False

The per-step metadata (`init_forward_metadata`) is measured on the GPU by `triton_vs_peers.py --only meta`
(with its two parts: attn-core's validation and the backend's build).

Step rows (`--steps`; issue 36's "host time per step unchanged within 5 %", what the safe-by-default
checks cost): one whole decode step as an engine issues it, real kernels, on `--device` (cuda on a GPU
machine): `init_forward_metadata(batch)` then `layer(q, k, v, batch)` for `--layers` layers (32; GQA 32 q
/ 8 kv heads, head_dim 128, bf16, page size 16, `--context` 1024 tokens per request), at batch 1 and 256,
for `--step-backends` (triton by default on cuda, torch_native on the CPU), eager and, on cuda, through
`CudaGraphRunner.run` (CUDA graphs). Timed with `attn_core.bench.timing.host_times_us` (idle: the device
drained before each step, outside the timed span): the host time of one step, what the engine's thread
spends issuing it; median of `--step-runs`. Before/after: the same `--baseline-src` machinery (give the
older attn-triton too: `--baseline-src /tmp/base/core/src:/tmp/base/plugins/triton_backend/src`); the timer
is this checkout's in both processes. Paths "host µs / step (eager)" and "host µs / step (graph)".

Timed paths per row (calls interleaved round-robin, `--groups` samples of `--calls` back-to-back calls
each, the median sample / calls reported, in µs):
  layer()           `layer(q, k, v, batch)`: what a model's forward calls
  backend.forward   `batch.attn_backend.forward(q, k, v, layer, batch)`
  stub alone        the stubbed `forward_decode` / `forward_extend` called directly (the floor)

Before/after a change to attn-core: `--baseline-src DIR` (a `core/src` of the older tree, e.g. from
`git archive <base> core/src | tar -x -C /tmp/base`, put on PYTHONPATH as given) times both trees in
fresh processes, alternating baseline / this tree `--rounds` times, and prints per row and path the
median over rounds of each and the ratio baseline / this tree (alternating spreads the drift of a
shared machine over both).

  python benchmarks/forward_host_cost.py [--calls 200] [--groups 200] [--json out.json]
  python benchmarks/forward_host_cost.py --baseline-src /tmp/base/core/src [--rounds 5] [--groups 60]
  python benchmarks/forward_host_cost.py --steps --device cuda --no-layer-rows
      [--baseline-src /tmp/base/core/src:/tmp/base/plugins/triton_backend/src --rounds 3 --step-runs 100]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from typing import Callable

import torch

import attn_core
from attn_core import (
    AttentionLayer,
    BackendContext,
    MHATokenToKVPool,
    MLATokenToKVPool,
    PagedTokenAllocator,
    ReqToTokenPool,
    get_backend_class,
)

try:
    from attn_core.testing.batch_builder import build_forward_batch
except ImportError:  # a --baseline-src tree from before attn-core's layout moved it (2026-11-28)
    from attn_core.batch_builder import build_forward_batch

HQ, HKV, D, PAGE, DTYPE = 32, 8, 128, 16, torch.bfloat16
MLA_HQ, MLA_LORA, MLA_ROPE = 128, 512, 64
ROWS = {  # title: (mode, requests, MLA)
    "decode bs1": ("DECODE", [(2047, 1)], False),
    "decode bs64": ("DECODE", [(255, 1)] * 64, False),
    "extend bs4 q128": ("EXTEND", [(128, 128)] * 4, False),
    "mla decode bs1": ("DECODE", [(2047, 1)], True),
}


class StubbedKernels(get_backend_class("torch_native")):
    """torch_native with its per-layer work replaced by returning a preallocated output."""

    name = "torch_native_stubbed"

    def __init__(self, ctx: BackendContext, out: torch.Tensor):
        super().__init__(ctx)
        self.out = out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        return self.out

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        return self.out


def make_row(mode: str, requests: list[tuple[int, int]], mla: bool) -> dict[str, Callable[[], object]]:
    """The three timed calls of one row, over a fresh pool, batch and stubbed backend."""
    total = sum(p + e for p, e in requests)
    pages = -(-total // PAGE) + len(requests) + 1
    if mla:
        kv_pool = MLATokenToKVPool(pages * PAGE, PAGE, DTYPE, MLA_LORA, MLA_ROPE, 1)
        hq, hkv, d, dv = MLA_HQ, 1, MLA_LORA + MLA_ROPE, MLA_LORA
        arch = {"attention_arch": "mla", "kv_lora_rank": MLA_LORA, "qk_rope_head_dim": MLA_ROPE}
    else:
        kv_pool = MHATokenToKVPool(pages * PAGE, PAGE, DTYPE, HKV, D, 1)
        hq, hkv, d, dv, arch = HQ, HKV, D, D, {}
    req_pool = ReqToTokenPool(len(requests), max(p + e for p, e in requests) + PAGE)
    allocator = PagedTokenAllocator(pages * PAGE, PAGE)
    batch = build_forward_batch(
        mode, requests, req_to_token_pool=req_pool, allocator=allocator, token_to_kv_pool=kv_pool
    )
    ctx = BackendContext(
        device="cpu",
        dtype=DTYPE,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=PAGE,
        max_batch_size=len(requests),
        max_context_len=req_pool.max_context_len,
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
        **arch,
    )
    T = batch.num_tokens
    backend = StubbedKernels(ctx, torch.empty(T, hq * dv, dtype=DTYPE))
    batch.attn_backend = backend
    backend.init_forward_metadata(batch)
    layer = AttentionLayer(0, hq, hkv, d, v_head_dim=dv)
    q3 = torch.randn(T, hq, d).to(DTYPE)
    q = q3 if mla else q3.view(T, hq * d)  # mla_vs_peers hands q as [T, heads, 576]
    k = torch.randn(T, hkv, d).to(DTYPE)
    v = None if mla else torch.randn(T, hkv, dv).to(DTYPE)
    save = not mla
    stub = backend.forward_decode if batch.forward_mode.is_decode() else backend.forward_extend
    return {
        "layer()": lambda: layer(q, k, v, batch, save_kv_cache=save),
        "backend.forward": lambda: backend.forward(q, k, v, layer, batch, save_kv_cache=save),
        "stub alone": lambda: stub(q3, k, v, layer, batch, save_kv_cache=save),
    }


STEP_BATCHES = (1, 256)


def make_step_rows(
    backend_name: str, bs: int, layers: int, context: int, device: str
) -> dict[str, Callable[[], object]]:
    """One decode step of `bs` requests of `context` tokens over `layers` layers on `backend_name`, real
    kernels: eager (`init_forward_metadata` then every layer) and, on cuda, through `CudaGraphRunner.run`
    (`attn_core.bench.steps.decode_steps` of this checkout, given the process's attn_core: the same calls
    run on the baseline tree)."""
    steps = _STEPS.decode_steps(
        attn_core, lambda ctx: attn_core.create_backend(backend_name, ctx), bs, layers, context, torch.device(device)
    )
    return {f"host µs / step ({path})": fn for path, fn in steps.items()}


def _this_trees_module(name: str):
    """`attn_core.bench.<name>` of this checkout (loaded from its file), so that a `--baseline-src` process,
    whose attn_core is the older tree, times with the same timer and builds the same steps."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "core", "src", "attn_core", "bench", name)
    spec = importlib.util.spec_from_file_location(f"_attn_bench_{name[:-3]}_of_this_tree", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


_TIMING = _this_trees_module("timing.py")
_STEPS = _this_trees_module("steps.py")
host_times_us, interleave = _TIMING.host_times_us, _TIMING.interleave


def step_rows(args, report: dict) -> None:
    """Time the step rows (see the module docstring) into `report["rows"]`."""
    default = "triton" if args.device.startswith("cuda") else "torch_native"
    dev = torch.device(args.device)
    report["device"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else report["machine"]
    where = f"{report['device']}: {args.layers} layers, context {args.context}"
    print(f"step rows on {where}, host µs per step (median of {args.step_runs})")
    for name in (args.step_backends or default).split(","):
        for bs in STEP_BATCHES:
            title = f"step {name} bs{bs}"
            paths = make_step_rows(name, bs, args.layers, args.context, args.device)
            med = {}
            for path, fn in paths.items():
                fn()  # warm-up: compile, capture, allocate
                med[path] = statistics.median(host_times_us(fn, args.step_runs, dev))
                if args.profile:
                    profile_calls(fn, dev, f"{title} {path}", args.profile)
            report["rows"][title] = med
            print(f"{title:26} " + "  ".join(f"{p} {t:9.1f}" for p, t in med.items()), flush=True)


def profile_calls(fn: Callable[[], object], dev: torch.device, title: str, path: str, calls: int = 20) -> None:
    """Where a step's host time goes (a diagnosis, not a timing claim): torch.profiler over `calls` calls of
    `fn`, the device drained before each as `host_times_us` does, the ops by self CPU time (a sync or a
    blocking copy shows as cudaStreamSynchronize / cudaMemcpy* / aten::item rows) appended to the text file
    `path` under `title`, then cProfile's table of the Python functions by own time over as many calls."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            fn()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    # the Python functions by their own time (what torch.profiler's op table does not name)
    import cProfile
    import io
    import pstats

    py = cProfile.Profile()
    for _ in range(calls):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        py.enable()
        fn()
        py.disable()
    text = io.StringIO()
    pstats.Stats(py, stream=text).sort_stats("tottime").print_stats(30)
    with open(path, "a") as f:
        f.write(f"== {title} ({attn_core.__file__}), {calls} calls\n{table}\n{text.getvalue()}\n")


def sample(calls: dict[str, Callable[[], object]], n: int, groups: int) -> dict[str, float]:
    """Median µs per call of each entry: `groups` rounds, each timing `n` back-to-back calls of every
    entry in turn (interleaved, so drift hits all alike)."""
    for fn in calls.values():
        for _ in range(n):
            fn()
    measures = {name: (lambda f=fn: host_times_us(f, 1, "cpu", iters=n)) for name, fn in calls.items()}
    return {name: statistics.median(us) for name, us in interleave(measures, groups).items()}


def run_tree(src: str | None, calls: int, groups: int, extra: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """One fresh process timing the attn_core under `src` (None: the installed one): its rows."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if src is not None:
        env["PYTHONPATH"] = src
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--calls",
            str(calls),
            "--groups",
            str(groups),
            "--json",
            out,
            *extra,
        ]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)["rows"]


def compare(
    baseline_src: str, rounds: int, calls: int, groups: int, json_path: str | None, extra: tuple[str, ...] = ()
) -> None:
    """Baseline and this tree, alternating in fresh processes; medians over rounds and their ratio."""
    runs: dict[str, list[dict]] = {"baseline": [], "this tree": []}
    for _ in range(rounds):
        runs["baseline"].append(run_tree(baseline_src, calls, groups, extra))
        runs["this tree"].append(run_tree(None, calls, groups, extra))
    med = {
        label: {row: {path: statistics.median(r[row][path] for r in rs) for path in rs[0][row]} for row in rs[0]}
        for label, rs in runs.items()
    }
    print(f"baseline {baseline_src} vs this tree ({attn_core.__file__}), {rounds} alternating rounds, median µs")
    print(f"{'row':26} {'path':22} {'baseline':>9} {'this tree':>10} {'ratio':>6}")
    for row, paths in med["this tree"].items():
        for path, now in paths.items():
            before = med["baseline"][row][path]
            print(f"{row:26} {path:22} {before:9.2f} {now:10.2f} {before / now:6.2f}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {"date": _now(), "baseline_src": baseline_src, "rounds": rounds, "median_us": med, "runs": runs},
                f,
                indent=1,
            )


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200, help="back-to-back calls per sample")
    ap.add_argument("--groups", type=int, default=200, help="samples per timed path")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--baseline-src", default=None, help="also time the attn_core under this directory; print ratios")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds with --baseline-src")
    ap.add_argument("--steps", action="store_true", help="also time whole decode steps with real kernels (docstring)")
    ap.add_argument("--no-layer-rows", action="store_true", help="skip the per-layer rows (with --steps)")
    ap.add_argument("--device", default="cpu", help="device of the step rows (cuda on a GPU machine)")
    ap.add_argument("--layers", type=int, default=32, help="layers of a step row")
    ap.add_argument("--context", type=int, default=1024, help="tokens per request of a step row")
    ap.add_argument("--step-runs", type=int, default=200, help="timed steps per step row")
    ap.add_argument("--step-backends", default=None, help="comma-separated backends of the step rows")
    ap.add_argument(
        "--profile",
        default=None,
        help="with --steps: append a torch.profiler table of each step path to this file (FILE.baseline for the "
        "--baseline-src tree)",
    )
    args = ap.parse_args()
    if args.baseline_src:
        extra: tuple[str, ...] = ()
        if args.steps:
            extra = ("--steps", "--device", args.device, "--layers", str(args.layers), "--context", str(args.context))
            extra += ("--step-runs", str(args.step_runs))
            extra += ("--no-layer-rows",) if args.no_layer_rows else ()
            extra += ("--step-backends", args.step_backends) if args.step_backends else ()
        compare(args.baseline_src, args.rounds, args.calls, args.groups, args.json, extra)
        if args.profile:  # once each tree, after the timed rounds (a profiled run is not timed)
            once = ("--step-runs", "1")
            run_tree(
                args.baseline_src, args.calls, args.groups, (*extra, "--profile", args.profile + ".baseline", *once)
            )
            run_tree(None, args.calls, args.groups, (*extra, "--profile", args.profile, *once))
        return
    torch.set_num_threads(1)
    report = {
        "date": _now(),
        "attn_core": attn_core.__file__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
        "rows": {},
    }
    print(f"attn_core from {attn_core.__file__}; torch {torch.__version__}, python {platform.python_version()}")
    if not (args.steps and args.no_layer_rows):
        print(f"{'row':18} {'layer() µs':>11} {'backend.forward µs':>19} {'stub alone µs':>14}")
        for title, (mode, requests, mla) in ROWS.items():
            med = sample(make_row(mode, requests, mla), args.calls, args.groups)
            report["rows"][title] = med
            row = f"{med['layer()']:11.2f} {med['backend.forward']:19.2f} {med['stub alone']:14.2f}"
            print(f"{title:18} {row}", flush=True)
    if args.steps:
        step_rows(args, report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
