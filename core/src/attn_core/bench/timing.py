"""Timers: CUDA events per call on GPU (after warm-up), wall clock per call on CPU; both report the
median over repetitions chosen to fill a time budget."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

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


def time_host_issue(fn: Callable[[], object], device: torch.device, runs: int) -> Timing:
    """Host time of `fn()` alone: the time the host spends issuing its work, with the device drained
    before each call (not timed) and not waited for inside the timed span (on the CPU: plain wall clock).
    What a step costs the engine's thread when the GPU keeps up: per-step host overheads (validation,
    metadata, launches, copies) compared before and after a change."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(runs):
        sync()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    sync()
    return _summary(times)
