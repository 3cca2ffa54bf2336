"""attn_core.bench.timing's sample functions: the order `interleave` takes measurements in, and what
`host_times_us` counts (clocks faked, so the numbers are exact). The CUDA timers run in the GPU
benchmarks (`scripts/gpu_checks.sh bench`)."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from attn_core.bench.timing import host_times_us, interleave


def _recorder(order: list[str], name: str, value: float):
    def measure() -> list[float]:
        order.append(name)
        return [value]

    return measure


def test_interleave_takes_every_measure_once_a_round_in_order():
    order: list[str] = []
    got = interleave({n: _recorder(order, n, v) for n, v in (("a", 1.0), ("b", 2.0), ("c", 3.0))}, 2)
    assert order == ["a", "b", "c", "a", "b", "c"]
    assert got == {"a": [1.0, 1.0], "b": [2.0, 2.0], "c": [3.0, 3.0]}


def test_interleave_rotated_starts_each_round_one_later():
    order: list[str] = []
    got = interleave({n: _recorder(order, n, 0.0) for n in "abc"}, 4, rotate=True)
    assert order == list("abc" + "bca" + "cab" + "abc")
    assert {n: len(s) for n, s in got.items()} == {"a": 4, "b": 4, "c": 4}


def test_interleave_keeps_every_sample_a_measure_returns():
    got = interleave({"x": lambda: [1.0, 2.0]}, 3)
    assert got == {"x": [1.0, 2.0] * 3}


def test_host_times_us_counts_clock_reads_per_call():
    ticks = itertools.count(0.0, 2.0)  # every read 2 s later
    calls = []
    got = host_times_us(lambda: calls.append(1), 3, "cpu", clock=lambda: next(ticks))
    assert got == [2e6, 2e6, 2e6] and len(calls) == 3  # the docstring's worked example


def test_host_times_us_divides_by_iters():
    ticks = iter([0.0, 1.0, 5.0, 9.0])  # two samples of 1 s and 4 s over 4 calls each
    calls = []
    got = host_times_us(lambda: calls.append(1), 2, torch.device("cpu"), iters=4, clock=lambda: next(ticks))
    assert got == [pytest.approx(0.25e6), pytest.approx(1e6)] and len(calls) == 8


def test_host_times_us_on_the_wall_clock_is_positive_and_one_per_rep():
    got = host_times_us(lambda: time.sleep(0.001), 3)
    assert len(got) == 3 and all(us >= 900 for us in got)
