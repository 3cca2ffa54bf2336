"""Arguments and driver of `attn-core bench`.

`attn-core bench` with no name times every backend usable here against the reference backend
`torch_native` in one run; `attn-core bench X --vs Y` times X (and Y) with speedups relative to Y.
Reading the arguments imports no torch; running does.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from attn_core.bench.timing import SPREAD_THRESHOLD
from attn_core.bench.workloads import KINDS
from attn_core.cli.args import bench_device, dtype_arg, positive_float, positive_int, writable_file

#: the peer every backend is measured against when `attn-core bench` gets no name
BASELINE = "torch_native"


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "name", nargs="?", help=f"backend to benchmark (default: every backend usable here, each against {BASELINE})"
    )
    p.add_argument(
        "--vs",
        action="append",
        default=[],
        metavar="OTHER",
        help="also time OTHER (repeatable); speedups are vs the first",
    )
    p.add_argument("--device", type=bench_device, help="cpu, cuda or cuda:N (default: cuda when visible, else cpu)")
    p.add_argument("--workload", default="all", choices=KINDS + ("all",), help="which rows (default all)")
    p.add_argument(
        "--size", default="auto", choices=("auto", "small", "full"), help="auto: full on GPU, small (scaled) on CPU"
    )
    p.add_argument("--dtype", type=dtype_arg, default="bfloat16", help="q and KV dtype (default bfloat16)")
    p.add_argument("--page-size", type=positive_int, default=1, help="KV page size (default 1)")
    p.add_argument(
        "--budget",
        type=positive_float,
        default=None,
        help="seconds of timed calls per measurement (default 0.5 GPU, 0.3 CPU)",
    )
    p.add_argument(
        "--json", type=writable_file, metavar="FILE", help="write every number, the device, versions and date as JSON"
    )
    p.add_argument(
        "--spread",
        type=positive_float,
        default=SPREAD_THRESHOLD,
        metavar="FRACTION",
        help=f"flag rows whose interquartile range exceeds this fraction of the median (default {SPREAD_THRESHOLD})",
    )
    p.add_argument(
        "--plot",
        type=writable_file,
        metavar="FILE",
        help="write a PNG of time per shape per backend (needs matplotlib: attn-core[plot])",
    )


def usable_backends(device_type: str) -> tuple[list[str], dict[str, str]]:
    """The registered backends that can run on `device_type` here (probe passes, device declared), by
    name, and {name: why not} for the others. A backend whose kernels would run in Triton's CPU
    interpreter is left out: the interpreter is a correctness tool, its times say nothing."""
    from attn_core.discovery import registry
    from attn_core.testing.limits import runs_in_triton_interpreter

    usable, left_out = [], {}
    for entry in registry.list_backends():
        reason = entry.probe()
        if reason is None and device_type not in entry.usable_spec.capabilities.devices:
            reason = f"declares devices {sorted(entry.usable_spec.capabilities.devices)}"
        if reason is None and runs_in_triton_interpreter(entry.distribution, device_type):
            reason = "its kernels would run in the Triton interpreter (TRITON_INTERPRET=1), which times nothing useful"
        if reason is None:
            usable.append(entry.name)
        else:
            left_out[entry.name] = reason
    return usable, left_out


def _backend_names(args: argparse.Namespace, device_type: str) -> tuple[list[str], Optional[int]]:
    """The backends to time, in table order, and the index of the one speedups are relative to."""
    if args.name is None:
        usable, left_out = usable_backends(device_type)
        for name, reason in left_out.items():
            print(f"not benchmarked: {name}: {reason}")
        others = [n for n in usable if n != BASELINE]
        return [BASELINE, *others, *[n for n in args.vs if n != BASELINE and n not in others]], 0
    names = [args.name, *[n for n in args.vs if n != args.name]]
    return names, (1 if len(names) > 1 else None)


def _check_plot_dependency() -> Optional[str]:
    """Why `--plot` cannot work here (matplotlib missing), or None; asked before any timing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib: pip install 'attn-core[plot]' (or pip install matplotlib)"
    return None


def run_bench_command(args: argparse.Namespace) -> int:
    import torch

    from attn_core.bench.report import Progress, document, run_warnings, table, write_json
    from attn_core.bench.runner import run_bench
    from attn_core.bench.timing import load_warning
    from attn_core.bench.workloads import model_for, standard_workloads
    from attn_core.cli.verdicts import fail, unavailable_here
    from attn_core.contract.errors import AttnError
    from attn_core.discovery import registry

    if args.plot and (problem := _check_plot_dependency()):
        return fail("bench", problem)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        return fail("bench", "no CUDA device visible to torch")
    names, baseline = _backend_names(args, device.type)
    try:  # every backend named on the command line must run here: one line and exit 2 before any timing
        for name in names:
            if (unavailable := unavailable_here(name)) is not None:
                return fail("bench", unavailable)
    except AttnError as exc:
        return fail("bench", exc)
    size = args.size if args.size != "auto" else ("full" if device.type == "cuda" else "small")
    model = model_for(size, args.dtype, args.page_size)
    workloads = standard_workloads(args.workload, size)
    budget = args.budget if args.budget is not None else (0.5 if device.type == "cuda" else 0.3)
    print(
        f"bench on {device} ({size} shapes: {model.num_q_heads}/{model.num_kv_heads} heads, head_dim {model.head_dim}, "
        f"{model.dtype}, page {model.page_size}): {', '.join(names)}",
        flush=True,
    )
    load_notes = [note for note in (load_warning(),) if note]
    for note in load_notes:
        print(f"warning: {note}: the times below may not be trustworthy", file=sys.stderr, flush=True)
    rows = run_bench(
        names, workloads, model, device, budget, progress=Progress(), baseline=baseline, spread_threshold=args.spread
    )
    load_notes += [note for note in (load_warning(),) if note]
    warnings = run_warnings(rows, load_notes, args.spread)
    print(table(rows, names[baseline] if baseline is not None else None))
    for line in warnings:
        print(f"warning: {line}")
    if args.json:
        versions = {}
        for e in registry.list_backends():
            if e.name in names:
                versions[e.name] = {"distribution": e.distribution, "version": e.version}
        doc = document(rows, model, device, size, sys.argv, {"backends": versions}, warnings, args.spread)
        write_json(args.json, doc)
        print(f"wrote {args.json}")
    if args.plot:
        from attn_core.bench.plot import plot_times

        title = f"attn-core bench on {device} ({size} shapes, {model.dtype}, page {model.page_size})"
        reference = names[baseline] if baseline is not None else None
        plot_times(rows, args.plot, title=title, reference=reference, warnings=warnings)
        print(f"wrote {args.plot}")
    return 1 if any(r.status in ("wrong", "error") for r in rows) else 0
