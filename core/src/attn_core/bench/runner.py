"""Check each backend against the reference once, then time metadata and forward on every row."""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import torch

from attn_core.bench.env import BenchEnv
from attn_core.bench.timing import SPREAD_THRESHOLD, Timing, time_calls, time_host
from attn_core.bench.workloads import BenchModel, Workload, step_bytes, step_flops
from attn_core.contract.errors import AttnError
from attn_core.discovery.registry import create_backend
from attn_core.testing.reference import relative_error, tolerance


@dataclass
class BenchRow:
    """One (workload, backend) measurement. Times in µs (median, min, max, quartiles over `runs`
    repetitions); status "ok", "wrong", "skipped" or "error"; `noisy` when the spread passed the threshold."""

    workload: str
    kind: str
    backend: str
    status: str
    note: str = ""
    batch_size: int = 0
    num_tokens: int = 0
    rel_error: Optional[float] = None
    median_us: Optional[float] = None
    min_us: Optional[float] = None
    max_us: Optional[float] = None
    runs: int = 0
    q1_us: Optional[float] = None
    q3_us: Optional[float] = None
    spread: Optional[float] = None  # interquartile range / median (`Timing.spread`)
    noisy: bool = False  # spread above the run's threshold: the median is not to be trusted
    metadata_us: Optional[float] = None
    gbps: Optional[float] = None
    tflops: Optional[float] = None
    bytes: int = 0
    flops: int = 0
    speedup_vs_baseline: Optional[float] = None
    layers_rotated: int = 1
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def _measure(
    name: str, env: BenchEnv, budget_s: float, clock=None, spread_threshold: float = SPREAD_THRESHOLD
) -> BenchRow:
    w, m = env.workload, env.model
    row = BenchRow(
        w.label,
        w.kind,
        name,
        "ok",
        batch_size=w.batch_size,
        num_tokens=env.batch.num_tokens,
        layers_rotated=env.num_layers,
    )
    try:
        backend = create_backend(name, env.ctx)
    except AttnError as exc:
        row.status, row.note = "skipped", str(exc)
        return row
    batch = env.batch
    batch.attn_backend = backend
    backend.init_forward_metadata(batch)
    result = backend.forward(env.q, env.k, env.v, env.layers[0], batch)
    out = result[0] if isinstance(result, tuple) else result  # no LSE asked: a tensor
    ref = env.reference()
    row.rel_error = relative_error(out.reshape(ref.shape), ref)
    tol = tolerance(getattr(torch, m.dtype))
    if not row.rel_error <= tol:
        row.status, row.note = (
            "wrong",
            f"rel err {row.rel_error:.3g} > {tol:g} against the float64 reference; not timed",
        )
        return row
    runs = 10 if env.device.type == "cuda" else 5
    row.metadata_us = time_host(lambda: backend.init_forward_metadata(batch), env.device, runs, clock=clock).median_us
    layers = env.layers

    def step(i: int):
        return backend.forward(env.q, env.k, env.v, layers[i % len(layers)], batch)

    t: Timing = time_calls(step, env.device, budget_s, clock=clock)
    row.median_us, row.min_us, row.max_us, row.runs = t.median_us, t.min_us, t.max_us, t.runs
    row.q1_us, row.q3_us, row.spread, row.noisy = t.q1_us, t.q3_us, t.spread, t.noisy(spread_threshold)
    row.bytes = step_bytes(w, m, env.q.element_size(), env.kv_pool.get_key_buffer(0).element_size())
    row.flops = step_flops(w, m)
    row.gbps = row.bytes / (t.median_us * 1e-6) / 1e9
    row.tflops = row.flops / (t.median_us * 1e-6) / 1e12
    return row


def run_bench(
    names: Sequence[str],
    workloads: Sequence[Workload],
    model: BenchModel,
    device: torch.device,
    budget_s: float,
    progress: Optional[Callable[[int, int, str], None]] = None,
    baseline: Optional[int] = None,
    clock: Optional[Callable[[], float]] = None,
    spread_threshold: float = SPREAD_THRESHOLD,
) -> list[BenchRow]:
    """Every backend of `names` on every workload; speedups are relative to `names[baseline]` (an
    index; None: no speedups). `clock`: the CPU timer (`timing.time_calls`); rows whose spread passes
    `spread_threshold` are marked `noisy`."""
    rows: list[BenchRow] = []
    total = len(workloads) * len(names)
    done = 0
    for w in workloads:
        env = BenchEnv(w, model, device)
        group = []
        for name in names:
            if progress is not None:
                progress(done, total, f"{w.label} · {name}")
            try:
                group.append(_measure(name, env, budget_s, clock, spread_threshold))
            except Exception as exc:  # one broken backend must not end the run
                group.append(BenchRow(w.label, w.kind, name, "error", note=f"{type(exc).__name__}: {exc}"))
            done += 1
        base = group[baseline] if baseline is not None else None
        for r in group:
            if base is not None and base.median_us and r.median_us:
                r.speedup_vs_baseline = base.median_us / r.median_us
        rows += group
        del env
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if progress is not None:
        progress(total, total, "done")
    return rows
