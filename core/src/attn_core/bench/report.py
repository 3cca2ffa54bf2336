"""Printing and saving benchmark results: the table, the JSON document and a progress bar on stderr."""

from __future__ import annotations

import datetime
import json
import platform
import sys
import time
from typing import Optional, Sequence, TextIO

import torch

from attn_core.bench.runner import BenchRow
from attn_core.bench.workloads import BenchModel


def _fmt_time(us: Optional[float]) -> str:
    if us is None:
        return "-"
    return f"{us / 1e3:.2f} ms" if us >= 1e3 else f"{us:.1f} µs"


def _throughput(r: BenchRow) -> str:
    if r.median_us is None:
        return "-"
    if r.kind == "decode":
        return f"{r.gbps:.2f} GB/s"
    if r.kind == "extend":
        return f"{r.tflops:.3f} TFLOP/s"
    return f"{r.gbps:.2f} GB/s, {r.tflops:.3f} TFLOP/s"


def _spread(r: BenchRow) -> str:
    """The SPREAD cell: "±4%" (half the interquartile range over the median), "±63% NOISY" past the threshold."""
    if r.spread is None:
        return "-"
    return f"±{50 * r.spread:.0f}%" + (" NOISY" if r.noisy else "")


def table(rows: Sequence[BenchRow], baseline: Optional[str]) -> str:
    """The human-readable result table, one line per (shape, backend): min / median / max per call,
    the spread (NOISY past the threshold), throughput, metadata time, speedup and the reference check."""
    speedup = f"SPEEDUP VS {baseline}" if baseline else "SPEEDUP"
    head = ["SHAPE", "BACKEND", "MIN", "MEDIAN", "MAX", "SPREAD", "THROUGHPUT", "METADATA/STEP", speedup, "CHECK"]
    lines = [head]
    for r in rows:
        check = "-" if r.rel_error is None else f"ok ({r.rel_error:.1e})" if r.status == "ok" else "WRONG"
        speed = "-" if r.speedup_vs_baseline is None else f"{r.speedup_vs_baseline:.2f}x"
        if r.status in ("skipped", "error"):
            lines.append([r.workload, r.backend, r.status, r.note] + [""] * (len(head) - 4))
            continue
        times = [_fmt_time(r.min_us), _fmt_time(r.median_us), _fmt_time(r.max_us), _spread(r)]
        lines.append([r.workload, r.backend, *times, _throughput(r), _fmt_time(r.metadata_us), speed, check])
    measured = [line for line in lines if line[2] not in ("skipped", "error")]
    widths = [max(len(line[i]) for line in measured) for i in range(len(head))]
    widths[:2] = [max(len(line[i]) for line in lines) for i in range(2)]
    out = []
    for line in lines:
        if line[2] in ("skipped", "error"):
            out.append("  ".join([line[0].ljust(widths[0]), line[1].ljust(widths[1]), line[2] + ": " + line[3]]))
        else:
            out.append("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    return "\n".join(out)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def run_warnings(rows: Sequence[BenchRow], load_notes: Sequence[str], threshold: float) -> list[str]:
    """Why this run's numbers should not be trusted, one line each: the machine's load (`load_notes`,
    from `timing.load_warning` before and after the run) and the rows whose spread passed `threshold`."""
    out = list(dict.fromkeys(load_notes))
    timed = [r for r in rows if r.status == "ok" and r.spread is not None]
    noisy = [r for r in timed if r.noisy]
    if noisy:
        out.append(
            f"{len(noisy)} of {len(timed)} rows have a spread over ±{50 * threshold:.0f}% (marked NOISY): "
            "their medians and speedups are not to be trusted"
        )
    if out:
        out.append("rerun on a quiet machine before comparing these numbers")
    return out


def document(
    rows: Sequence[BenchRow],
    model: BenchModel,
    device: torch.device,
    size: str,
    argv: Sequence[str],
    versions: dict,
    warnings: Sequence[str] = (),
    spread_threshold: Optional[float] = None,
) -> dict:
    """Every number of the run with the device, software versions and date (the `--json` file), the
    spread threshold rows were flagged against and the run's warnings."""
    import attn_core

    dev = {"type": device.type, "name": device_name(device)}
    if device.type == "cuda":
        dev["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    else:
        dev["cpu_count"] = __import__("os").cpu_count()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": list(argv),
        "device": dev,
        "versions": {
            "attn_core": attn_core.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            **versions,
        },
        "size": size,
        "model": model.__dict__,
        "timing": "CUDA events per call, median after warm-up, layers rotated"
        if device.type == "cuda"
        else "wall clock per call, median",
        "spread": "interquartile range / median of the per-call times; rows above spread_threshold are noisy",
        "spread_threshold": spread_threshold,
        "warnings": list(warnings),
        "rows": [r.to_json() for r in rows],
    }


def write_json(path: str, doc: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


class Progress:
    """A one-line progress bar on a TTY stderr (plain lines elsewhere), shown once a run passes `after_s`."""

    def __init__(self, stream: Optional[TextIO] = None, after_s: float = 1.0, width: int = 24):
        self.stream, self.after_s, self.width = stream or sys.stderr, after_s, width
        self.t0 = time.perf_counter()
        self.tty = self.stream.isatty()
        self.shown = False

    def __call__(self, done: int, total: int, label: str) -> None:
        elapsed = time.perf_counter() - self.t0
        if elapsed < self.after_s and done < total:
            return
        filled = self.width * done // max(total, 1)
        bar = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {elapsed:5.1f}s {label}"
        if self.tty:
            self.stream.write("\r\033[K" + bar + ("\n" if done >= total else ""))
        elif done < total or self.shown:
            self.stream.write(bar + "\n")
        self.shown = True
        self.stream.flush()
