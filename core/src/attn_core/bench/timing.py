"""Timers: CUDA events per call on GPU (after warm-up), wall clock per call on CPU; both report the
median over repetitions chosen to fill a time budget, with the minimum, maximum, quartiles and the
spread (how far the repetitions disagree), and `machine_load` / `load_warning` say whether the machine
was busy enough to distrust the numbers.

Example: `t = time_calls(lambda i: f(), torch.device("cpu"), 0.2)`; `t.median_us`, `t.spread`
(interquartile range over the median: 0.03 on a quiet machine, 0.5 and more under load) and
`t.noisy()` (spread above `SPREAD_THRESHOLD`).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:  # torch is imported by the timers themselves: the constants stay import-light for the CLI
    import torch

#: a measurement whose spread (interquartile range / median) exceeds this is flagged as noisy
SPREAD_THRESHOLD = 0.25
#: the 1-minute load average per CPU above which a run's numbers are called untrustworthy
LOAD_PER_CPU_THRESHOLD = 0.75


@dataclass(frozen=True)
class Timing:
    """Per-call times in microseconds: median, min, max, repetitions, and the first and third quartiles."""

    median_us: float
    min_us: float
    max_us: float
    runs: int
    q1_us: Optional[float] = None
    q3_us: Optional[float] = None

    @property
    def spread(self) -> float:
        """Interquartile range over the median (0 when the quartiles are unknown): 0.1 means the middle
        half of the repetitions lie within 10 % of the median's size."""
        if self.q1_us is None or self.q3_us is None or self.median_us <= 0:
            return 0.0
        return (self.q3_us - self.q1_us) / self.median_us

    def noisy(self, threshold: float = SPREAD_THRESHOLD) -> bool:
        """Whether the repetitions disagree too much to trust the median (`spread` > `threshold`)."""
        return self.spread > threshold


def summarize(times_us: list[float]) -> Timing:
    """The `Timing` of a list of per-call times (µs): `summarize([1, 2, 3, 4])` has median 2.5, min 1,
    max 4, quartiles 1.75 and 3.25, spread 0.6."""
    if len(times_us) >= 2:
        q1, _, q3 = statistics.quantiles(times_us, n=4, method="inclusive")
    else:
        q1 = q3 = times_us[0]
    return Timing(statistics.median(times_us), min(times_us), max(times_us), len(times_us), q1, q3)


def machine_load() -> tuple[Optional[float], int]:
    """(1-minute load average or None where the OS has none, CPU count)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return load, os.cpu_count() or 1


def load_warning(threshold_per_cpu: float = LOAD_PER_CPU_THRESHOLD) -> Optional[str]:
    """A one-line warning when the machine is busy (load average above `threshold_per_cpu` per CPU):
    "the machine is loaded (load average 7.9 on 2 CPUs)", else None."""
    load, cpus = machine_load()
    if load is not None and load > threshold_per_cpu * cpus:
        return f"the machine is loaded (load average {load:.1f} on {cpus} CPUs)"
    return None


def time_calls(
    fn: Callable[[int], object],
    device: torch.device,
    budget_s: float,
    min_runs: int = 5,
    max_runs: int = 200,
    clock: Optional[Callable[[], float]] = None,
) -> Timing:
    """Time `fn(i)` (i = repetition index) after warm-up. On CUDA each call is bracketed by events and
    the device is synchronized once at the end; on CPU each call is timed with `clock` (seconds;
    default `time.perf_counter`)."""
    import torch

    clock = clock or perf_counter
    on_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    # warm-up: at least 2 calls or 10% of the budget, also measures the per-call cost
    t0 = clock()
    n = 0
    while n < 2 or (clock() - t0 < 0.1 * budget_s and n < max_runs):
        fn(n)
        sync()
        n += 1
    per_call = max(clock() - t0, 0.0) / n
    runs = int(max(min_runs, min(max_runs, budget_s / max(per_call, 1e-6))))
    if on_cuda:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
        for i in range(runs):
            starts[i].record()
            fn(i)
            ends[i].record()
        torch.cuda.synchronize()
        return summarize([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)])
    times = []
    for i in range(runs):
        t = clock()
        fn(i)
        times.append((clock() - t) * 1e6)
    return summarize(times)


def time_host(fn: Callable[[], object], device: torch.device, runs: int, clock: Optional[Callable[[], float]] = None) -> Timing:
    """Wall-clock time of `fn()` including the device work it queues (synchronized before and after):
    what a step's metadata build costs the engine. `clock`: as `time_calls`."""
    import torch

    clock = clock or perf_counter
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(runs):
        sync()
        t = clock()
        fn()
        sync()
        times.append((clock() - t) * 1e6)
    return summarize(times)
