"""`attn-core bench --plot FILE`: one PNG of the median time per shape per backend (grouped bars, log
scale, lower is better). Needs matplotlib (`pip install 'attn-core[plot]'`); imported only here."""

from __future__ import annotations

from typing import Sequence

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


def plot_times(rows: Sequence[BenchRow], path: str, title: str = "attn-core bench") -> None:
    """Write a PNG at `path`: for every shape, one bar per backend with its median time (µs, log axis);
    a backend that did not run on a shape gets no bar there."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    shapes, backends = times_by_backend(rows)
    width = 0.8 / max(1, len(backends))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(shapes) + 2.0), 4.8))
    for i, (name, times) in enumerate(backends.items()):
        xs = [j + (i - (len(backends) - 1) / 2) * width for j, t in enumerate(times) if t is not None]
        ax.bar(xs, [t for t in times if t is not None], width, label=name)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(shapes, rotation=25, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("median time per layer call (µs, lower is better)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    plt.close(fig)
