"""Timers: CUDA events per call on GPU (after warm-up), wall clock per call on CPU; both report the
median over repetitions chosen to fill a time budget, with the minimum, maximum, quartiles and the
spread (how far the repetitions disagree), and `machine_load` / `load_warning` say whether the machine
was busy enough to distrust the numbers.

Example: `t = time_calls(lambda i: f(), torch.device("cpu"), 0.2)`; `t.median_us`, `t.spread`
(interquartile range over the median: 0.03 on a quiet machine, 0.5 and more under load) and
`t.noisy()` (spread above `SPREAD_THRESHOLD`).

`time_calls` and `time_host` serve `attn-core bench`. The sample functions at the end serve the scripts in
`benchmarks/` (every timing there goes through this module): each returns the raw per-call samples in
microseconds, so a script reports the median (or a percentile; `summarize` gives the `Timing`) and keeps
the spread.

- `event_times_us`: GPU time between two CUDA events around `iters` back-to-back eager calls;
- `capture_graph` / `graph_times_us`: calls captured in one CUDA graph, the replays timed by events (how
  engines run decode: no host time between kernels);
- `interleaved_graph_times_us`: several candidates' graphs replayed in turn, each round starting one
  candidate later, so drift and the first-timed position hit every candidate alike;
- `host_times_us`: host wall (or thread CPU) time of single calls, by default with the device idle before
  each (what a step's metadata costs the host, not the device work it queues);
- `interleave`: any of these measurements taken in turn over several rounds.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence, Union

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


def time_host(
    fn: Callable[[], object], device: torch.device, runs: int, clock: Optional[Callable[[], float]] = None
) -> Timing:
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


# ---- sample functions for benchmarks/ (additive: the functions above keep their behaviour) -------------
#: a measurement that returns its samples (µs), e.g. `lambda: event_times_us(fn, 3)`
Measure = Callable[[], list[float]]


def event_times_us(fn: Callable[[], object], reps: int, iters: int = 1) -> list[float]:
    """GPU µs per call of `fn`, `reps` samples: each sample runs `fn` `iters` times back to back between two
    CUDA events (recorded on the current stream) and divides the elapsed time by `iters`. Needs CUDA; warm
    `fn` up first (compiles, allocations). Eager back-to-back calls whose kernels are shorter than their
    host path measure the host path: time such calls with `graph_times_us`."""
    import torch

    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / iters)
    return out


def capture_graph(fns: Sequence[Callable[[], object]], calls: int, warmup: int = 1) -> torch.cuda.CUDAGraph:
    """One CUDA graph of `calls` rounds over `fns` (round = every fn once, in order), replayed once and
    synchronized before it is returned. Capture needs each fn run first: `warmup` rounds run on a side
    stream (as torch's capture rules ask). Every fn must launch graph-safe work only (metadata built
    before, no host sync, no allocation that outlives the capture's pool)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            for f in fns:
                f()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_times_us(fns: Sequence[Callable[[], object]], calls: int, reps: int, warmup: int = 1) -> list[float]:
    """µs per call of `fns` replayed from one CUDA graph (`capture_graph(fns, calls, warmup)`): `reps`
    samples, each one replay timed by events and divided by the calls it holds (calls × len(fns)).
    Several fns (e.g. one per KV set, rotated so that L2 cannot hold the working set) count as one
    call each."""
    graph = capture_graph(fns, calls, warmup)
    per = calls * len(fns)
    return [t / per for t in event_times_us(graph.replay, reps)]


def interleaved_graph_times_us(
    groups: Mapping[str, Sequence[Callable[[], object]]], calls: int, reps: int, warmup: int = 1
) -> dict[str, list[float]]:
    """`graph_times_us` of several candidates at once: one graph per group, captured first, then `reps`
    rounds replaying every graph once, round r starting with group r mod n (`interleave(..., rotate=True)`),
    so no candidate is always timed first or after the same neighbour. Returns each group's samples (µs
    per call). Example: groups {"a": [f], "b": [g]}, reps 4 replays a b, b a, a b, b a."""
    graphs = {name: capture_graph(fns, calls, warmup) for name, fns in groups.items()}

    def replay_once(name: str) -> Measure:
        graph, per = graphs[name], calls * len(groups[name])
        return lambda: [t / per for t in event_times_us(graph.replay, 1)]

    return interleave({name: replay_once(name) for name in graphs}, reps, rotate=True)


def host_times_us(
    fn: Callable[[], object],
    reps: int,
    device: Union[torch.device, str, None] = None,
    *,
    idle: bool = True,
    iters: int = 1,
    clock: Callable[[], float] = perf_counter,
) -> list[float]:
    """Host µs per call of `fn`, `reps` samples of `iters` back-to-back calls each (divided by `iters`),
    read on `clock` (seconds: wall time by default; `time.thread_time` gives the calling thread's CPU
    time). On a CUDA `device` with `idle`, the device is synchronized before each sample, outside the
    timed region: the sample is the host's work alone, not the device work `fn` queues (back-to-back
    calls without it end up timing the device once its queue fills). Nothing is synchronized after.

    Worked example: with a clock that advances 2.0 s per read and iters 1, every sample is 2e6 µs."""
    on_cuda = device is not None and str(getattr(device, "type", device)).startswith("cuda")
    sync = None
    if idle and on_cuda:
        import torch

        sync = torch.cuda.synchronize
    samples = []
    for _ in range(reps):
        if sync is not None:
            sync()
        t0 = clock()
        for _ in range(iters):
            fn()
        samples.append((clock() - t0) * 1e6 / iters)
    return samples


def interleave(measures: Mapping[str, Measure], rounds: int, rotate: bool = False) -> dict[str, list[float]]:
    """Take several measurements in turn: `rounds` rounds, each calling every measure once and appending
    the samples it returns to that name's list, so drift over time (clock, other processes, heat) hits
    every candidate alike. With `rotate`, round r starts at the r-th name (mod n).

    Worked example: measures {"a": A, "b": B, "c": C}, rounds 2: order A B C A B C; with rotate,
    A B C B C A. Returns {name: samples in the order taken}."""
    names = list(measures)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)] if rotate else names[i]
            samples[name] += measures[name]()
    return samples
