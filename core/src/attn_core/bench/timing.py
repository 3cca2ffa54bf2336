"""Timers: CUDA events per call on GPU (after warm-up), wall clock per call on CPU; both report the
median over repetitions chosen to fill a time budget.

`time_calls` and `time_host` serve `attn-core bench`. The sample functions below them serve the scripts in
`benchmarks/` (every timing there goes through this module): each returns the raw per-call samples in
microseconds, so a script reports the median (or a percentile) and keeps the spread.

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

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, Union

import torch


@dataclass(frozen=True)
class Timing:
    """Per-call times in microseconds."""

    median_us: float
    min_us: float
    max_us: float
    runs: int


def _summary(times_us: list[float]) -> Timing:
    return Timing(statistics.median(times_us), min(times_us), max(times_us), len(times_us))


def time_calls(fn: Callable[[int], object], device: torch.device, budget_s: float, min_runs: int = 5, max_runs: int = 200) -> Timing:
    """Time `fn(i)` (i = repetition index) after warm-up. On CUDA each call is bracketed by events and
    the device is synchronized once at the end; on CPU each call is timed with `perf_counter`."""
    on_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    # warm-up: at least 2 calls or 10% of the budget, also measures the per-call cost
    t0 = time.perf_counter()
    n = 0
    while n < 2 or (time.perf_counter() - t0 < 0.1 * budget_s and n < max_runs):
        fn(n)
        sync()
        n += 1
    per_call = (time.perf_counter() - t0) / n
    runs = int(max(min_runs, min(max_runs, budget_s / max(per_call, 1e-6))))
    if on_cuda:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
        for i in range(runs):
            starts[i].record()
            fn(i)
            ends[i].record()
        torch.cuda.synchronize()
        return _summary([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)])
    times = []
    for i in range(runs):
        t = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - t) * 1e6)
    return _summary(times)


def time_host(fn: Callable[[], object], device: torch.device, runs: int) -> Timing:
    """Wall-clock time of `fn()` including the device work it queues (synchronized before and after):
    what a step's metadata build costs the engine."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(runs):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e6)
    return _summary(times)


# ---- sample functions for benchmarks/ (additive: the functions above keep their behaviour) -------------
#: a measurement that returns its samples (µs), e.g. `lambda: event_times_us(fn, 3)`
Measure = Callable[[], list[float]]


def event_times_us(fn: Callable[[], object], reps: int, iters: int = 1) -> list[float]:
    """GPU µs per call of `fn`, `reps` samples: each sample runs `fn` `iters` times back to back between two
    CUDA events (recorded on the current stream) and divides the elapsed time by `iters`. Needs CUDA; warm
    `fn` up first (compiles, allocations). Eager back-to-back calls whose kernels are shorter than their
    host path measure the host path: time such calls with `graph_times_us`."""
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
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Host µs per call of `fn`, `reps` samples of `iters` back-to-back calls each (divided by `iters`),
    read on `clock` (seconds: wall time by default; `time.thread_time` gives the calling thread's CPU
    time). On a CUDA `device` with `idle`, the device is synchronized before each sample, outside the
    timed region: the sample is the host's work alone, not the device work `fn` queues (back-to-back
    calls without it end up timing the device once its queue fills). Nothing is synchronized after.

    Worked example: with a clock that advances 2.0 s per read and iters 1, every sample is 2e6 µs."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    samples = []
    for _ in range(reps):
        if idle and on_cuda:
            torch.cuda.synchronize()
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
