"""Arguments and driver of `attn-core bench`."""

from __future__ import annotations

import argparse
import sys

import torch

from attn_core import registry
from attn_core.bench.report import Progress, document, table, write_json
from attn_core.bench.runner import run_bench
from attn_core.bench.workloads import KINDS, model_for, standard_workloads
from attn_core.errors import AttnError


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="backend to benchmark")
    p.add_argument("--vs", action="append", default=[], metavar="OTHER", help="also time OTHER (repeatable); speedups are vs the first")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when visible, else cpu)")
    p.add_argument("--workload", default="all", choices=KINDS + ("all",), help="which rows (default all)")
    p.add_argument("--size", default="auto", choices=("auto", "small", "full"), help="auto: full on GPU, small (scaled) on CPU")
    p.add_argument("--dtype", default="bfloat16", help="q and KV dtype (default bfloat16)")
    p.add_argument("--page-size", type=int, default=1, help="KV page size (default 1)")
    p.add_argument("--budget", type=float, default=None, help="seconds of timed calls per measurement (default 0.5 GPU, 0.3 CPU)")
    p.add_argument("--json", metavar="FILE", help="write every number, the device, versions and date as JSON")


def run_bench_command(args: argparse.Namespace) -> int:
    names = [args.name, *[n for n in args.vs if n != args.name]]
    try:
        for name in names:
            registry.default_registry().resolve(name)
    except AttnError as exc:
        print(f"attn-core bench: {exc}", file=sys.stderr)
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("attn-core bench: no CUDA device visible to torch", file=sys.stderr)
        return 2
    size = args.size if args.size != "auto" else ("full" if device.type == "cuda" else "small")
    model = model_for(size, args.dtype, args.page_size)
    workloads = standard_workloads(args.workload, size)
    budget = args.budget if args.budget is not None else (0.5 if device.type == "cuda" else 0.3)
    print(
        f"bench on {device} ({size} shapes: {model.num_q_heads}/{model.num_kv_heads} heads, head_dim {model.head_dim}, "
        f"{model.dtype}, page {model.page_size}): {', '.join(names)}",
        flush=True,
    )
    rows = run_bench(names, workloads, model, device, budget, progress=Progress())
    print(table(rows, names[1] if len(names) > 1 else None))
    if args.json:
        versions = {}
        for e in registry.list_backends():
            if e.name in names:
                versions[e.name] = {"distribution": e.distribution, "version": e.version}
        write_json(args.json, document(rows, model, device, size, sys.argv, {"backends": versions}))
        print(f"wrote {args.json}")
    return 1 if any(r.status in ("wrong", "error") for r in rows) else 0
