"""`attn-core bench --plot FILE`: one PNG of the time per shape per backend (grouped bars of the median,
an error bar from the fastest to the slowest repetition, hatched bars where the spread passed the
threshold, the speedup against the reference backend over each bar, a log axis in µs / ms, and the run's
warnings in red under the title). Needs matplotlib (`pip install 'attn-core[plot]'`); imported only here."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from attn_core.bench.runner import BenchRow


def times_by_backend(rows: Sequence[BenchRow]) -> tuple[list[str], dict[str, list[float | None]]]:
    """The shapes in run order and, per backend, its median time in µs for each shape (None where it was
    skipped, wrong or failed). Example: rows (decode, a, 10), (decode, b, 20), (extend, a, 5) give
    (["decode", "extend"], {"a": [10, 5], "b": [20, None]})."""
    shapes: list[str] = []
    for r in rows:
        if r.workload not in shapes:
            shapes.append(r.workload)
    backends: dict[str, list[float | None]] = {}
    for r in rows:
        series = backends.setdefault(r.backend, [None] * len(shapes))
        series[shapes.index(r.workload)] = r.median_us if r.status == "ok" else None
    return shapes, backends


def format_us(us: float) -> str:
    """A time in µs for an axis or a label: 850 → "850 µs", 1500 → "1.5 ms", 0.25 → "0.25 µs",
    2.5e6 → "2.5 s"."""
    if us >= 1e6:
        return f"{us / 1e6:g} s"
    if us >= 1e3:
        return f"{us / 1e3:g} ms"
    return f"{us:g} µs"


def plot_times(
    rows: Sequence[BenchRow],
    path: str,
    title: str = "attn-core bench",
    reference: Optional[str] = None,
    warnings: Sequence[str] = (),
) -> None:
    """Write a PNG at `path`: for every shape, one bar per backend with its median time per call and an
    error bar over [min, max] of its repetitions (log axis, µs / ms ticks), hatched where the row is
    noisy, labelled with its speedup against `reference` (the backend the others are measured
    against); `warnings` (e.g. a loaded machine) are printed in red under the title. A backend that did
    not run on a shape gets no bar there."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    shapes, backends = times_by_backend(rows)
    by_key = {(r.workload, r.backend): r for r in rows if r.status == "ok"}
    width = 0.8 / max(1, len(backends))
    handles: list = []
    fig, ax = plt.subplots(figsize=(max(7.0, 1.5 * len(shapes) + 2.5), 5.4))
    for i, (name, times) in enumerate(backends.items()):
        xs, ys, lo, hi, noisy, labels = [], [], [], [], [], []
        for j, t in enumerate(times):
            if t is None:
                continue
            r = by_key[(shapes[j], name)]
            xs.append(j + (i - (len(backends) - 1) / 2) * width)
            ys.append(t)
            lo.append(max(t - (r.min_us if r.min_us is not None else t), 0.0))
            hi.append(max((r.max_us if r.max_us is not None else t) - t, 0.0))
            noisy.append(r.noisy)
            labels.append(
                None
                if reference is None or name == reference or r.speedup_vs_baseline is None
                else r.speedup_vs_baseline
            )
        bars = ax.bar(xs, ys, width, label=name, yerr=[lo, hi], capsize=2, error_kw={"elinewidth": 0.8, "alpha": 0.7})
        handles.append(Patch(facecolor=bars.patches[0].get_facecolor() if bars.patches else None, label=name))
        for bar, is_noisy, speed in zip(bars, noisy, labels):
            if is_noisy:
                bar.set_hatch("///")
                bar.set_edgecolor("red")
            if speed is not None:
                top = (bar.get_x() + bar.get_width() / 2, bar.get_height())
                style: dict[str, Any] = dict(textcoords="offset points", ha="center", va="bottom", fontsize=7)
                style["bbox"] = dict(fc="white", ec="none", pad=0.5)
                ax.annotate(f"{speed:.2f}×", top, xytext=(0, 3), **style)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(shapes, rotation=25, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_us(v)))
    against = f"; labels: speedup vs {reference}" if reference else ""
    ax.set_ylabel(f"time per layer call (median, bars: min..max; lower is better{against})", fontsize=8)
    heading = title
    if warnings:
        heading += "\n" + "\n".join(f"warning: {w}" for w in warnings)
    ax.set_title(heading, fontsize=9, color="red" if warnings else "black")
    handles.append(Patch(facecolor="white", edgecolor="red", hatch="///", label="noisy: spread over the threshold"))
    ax.legend(handles=handles, fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    plt.close(fig)
