"""attn-cpu-amx on MIXED steps: one kernel call over the whole step (unsplit, what the backend does)
against the split a backend could make, decodes in one call and prefill chunks in another (on CPU).

Rows (GQA 32 q / 8 kv heads, head_dim 128, page size 16 with pages in random order, bf16 and fp32),
requests decode-first:
  mixed 32x2048 + 1x512          32 decodes (2047 cached tokens + 1 new) + one prefill chunk of 512
  mixed 32x2048 + 2x(1536+512)   32 decodes + two chunks of 512 after 1536 cached tokens each

Peers, on the same pool and q:
  unsplit   one backend, `init_forward_metadata(step)`, one layer's `forward` over every row
  split     two backends, metadata of `slice_batch(step, 0, D)` (the decodes) and of
            `slice_batch(step, D, n)` (the chunks); one layer = the two `forward`s on q's two row ranges
            (their outputs are not concatenated: the best case for the split)
Metadata is built once per row outside the timed region; `save_kv_cache=False` (the step's K/V are
already in the pool). The split's outputs are checked against the unsplit ones (relative error
printed). Calls interleaved round-robin, median reported; the claim is the ratio unsplit / split, also
given as the median over rounds of each round's ratio (steadier on a shared machine: both calls of a
round see about the same load). `--clock thread` (with `--threads 1`) times the calling thread's CPU
time instead of wall time and reports the minimum: the kernels' work, without the other jobs of a
shared machine (both peers run every kernel on the calling thread then).

  python benchmarks/mixed_split.py [--out mixed_split.json] [--threads N] [--dtypes bfloat16,float32] [--reps 7]
      [--clock wall|thread]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch
from cpu_vs_peers import Row, bench, cpu_description

from attn_core.batch_utils import slice_batch, split_decodes_and_prefills, token_range
from attn_core.registry import create_backend
from attn_core.testing.reference import relative_error

DECODES = [(2047, 1)] * 32
ROWS = {
    "one_chunk": ("mixed 32x2048 + 1x512", DECODES + [(0, 512)]),
    "two_chunks": ("mixed 32x2048 + 2x(1536+512)", DECODES + [(1536, 512)] * 2),
}


def split_call(row: Row):
    """The split step: decodes and chunks through two backend objects (metadata built here, once)."""
    b = row.batch
    parts = split_decodes_and_prefills(b)
    n, nd = b.batch_size, parts.num_decodes
    calls = []
    for start, end in ((0, nd), (nd, n)):
        sub = slice_batch(b, start, end)
        first, last = token_range(b, start, end)
        backend = create_backend("cpu_amx", row.ctx)
        backend.init_forward_metadata(sub)
        calls.append((backend, sub, row.q[first:last]))
    return lambda: [be.forward(q, None, None, row.layer, sub, save_kv_cache=False) for be, sub, q in calls]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="mixed_split.json")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rows", default="one_chunk,two_chunks")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall")
    args = ap.parse_args()
    if args.clock == "thread" and args.threads != 1:
        ap.error("--clock thread needs --threads 1 (the kernels must run on the calling thread)")
    torch.set_num_threads(args.threads)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_description(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
        "clock": args.clock,
        "rows": [],
    }
    print(f"CPU {report['cpu']['model']}, paths {report['cpu']['runnable_paths']}, {report['threads']} threads, torch {torch.__version__}")
    print(f"{'row':30} {'dtype':9} {'path':7} {'unsplit ms':>11} {'split ms':>9} {'unsplit/split':>14} {'per round':>10}  rel err")
    for key in args.rows.split(","):
        title, requests = ROWS[key]
        for dname in args.dtypes.split(","):
            row = Row("MIXED", requests, getattr(torch, dname))
            whole = create_backend("cpu_amx", row.ctx)
            unsplit = row.backend_call(whole)
            split = split_call(row)
            err = relative_error(torch.cat(split()).float(), unsplit().float())
            if args.clock == "thread":
                times = bench({"unsplit": unsplit, "split": split}, args.reps, clock=time.thread_time)
                med = {name: min(ts) for name, ts in times.items()}  # CPU time: the minimum is the work
            else:
                times = bench({"unsplit": unsplit, "split": split}, args.reps)
                med = {name: statistics.median(ts) for name, ts in times.items()}
            ratio = med["unsplit"] / med["split"]
            round_ratio = statistics.median(u / s for u, s in zip(times["unsplit"], times["split"]))
            times_txt = f"{med['unsplit'] * 1e3:11.2f} {med['split'] * 1e3:9.2f}"
            print(f"{title:30} {dname:9} {whole.kernel_path:7} {times_txt} {ratio:14.3f} {round_ratio:10.3f}  {err:.2g}", flush=True)
            report["rows"].append(
                {
                    "row": title,
                    "dtype": dname,
                    "path": whole.kernel_path,
                    "median_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
                    "all_ms": {k: [round(t * 1e3, 3) for t in v] for k, v in times.items()},
                    "unsplit_over_split": round(ratio, 3),
                    "unsplit_over_split_per_round_median": round(round_ratio, 3),
                    "split_rel_err_vs_unsplit": float(err),
                }
            )
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
