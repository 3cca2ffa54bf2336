"""`attn-core bench` numbers a user can trust: every row reports min / median / max and the spread of its
repetitions, rows whose spread passes the threshold are flagged (table, JSON, plot), and a loaded machine
is named in a warning (stderr, the table's footer, the JSON and the plot). The timer and the load average
are replaced by noisy stand-ins, so the flags and warnings are forced, not hoped for."""

from __future__ import annotations

import json
import time

import pytest
import torch

from attn_core.bench import timing
from attn_core.cli.main import main


class SteppedClock:
    """A clock whose successive readings advance by the given durations (seconds) in turn."""

    def __init__(self, steps):
        self.steps, self.now, self.i = list(steps), 0.0, 0

    def __call__(self) -> float:
        self.now += self.steps[self.i % len(self.steps)]
        self.i += 1
        return self.now


def noisy_clock(jumps_s=(0.0, 0.01, 0.02, 0.03, 0.04)):
    """The real clock plus a jump at every reading, cycling through `jumps_s`: a machine that preempts the
    benchmark. A measurement (two readings) gains the jump of its second reading; with 5 jumps and 2
    readings a measurement, any 5 measurements in a row gain each jump once (2 is invertible mod 5), so
    the spread they show does not depend on how many readings the warm-up took."""
    offset, i = [0.0], [0]

    def clock() -> float:
        offset[0] += jumps_s[i[0] % len(jumps_s)]
        i[0] += 1
        return time.perf_counter() + offset[0]

    return clock


def test_summary_reports_quartiles_and_spread():
    t = timing.summarize([1.0, 2.0, 3.0, 4.0])
    assert (t.median_us, t.min_us, t.max_us, t.runs) == (2.5, 1.0, 4.0, 4)
    assert (t.q1_us, t.q3_us) == (1.75, 3.25) and t.spread == pytest.approx(0.6) and t.noisy()
    steady = timing.summarize([10.0, 10.1, 9.9, 10.0, 10.05])
    assert steady.spread < 0.02 and not steady.noisy()
    assert timing.Timing(5.0, 4.0, 6.0, 3).spread == 0.0  # quartiles unknown: no spread claimed


def test_time_calls_flags_a_timer_that_disagrees_with_itself():
    cpu = torch.device("cpu")
    steady = timing.time_calls(lambda i: None, cpu, 0.01, clock=SteppedClock([0.001]), min_runs=20, max_runs=20)
    assert steady.median_us == pytest.approx(1000.0) and steady.spread == pytest.approx(0.0) and not steady.noisy()
    # each call measures one reading to the next: 1 ms, 1 ms, then a 30 ms preemption every third call
    jumpy = timing.time_calls(
        lambda i: None, cpu, 0.01, clock=SteppedClock([0.001, 0.001, 0.03]), min_runs=30, max_runs=30
    )
    assert jumpy.max_us == pytest.approx(30_000.0) and jumpy.noisy() and jumpy.spread > 1.0


def test_load_warning_names_the_load(monkeypatch):
    monkeypatch.setattr(timing, "machine_load", lambda: (9.0, 2))
    assert timing.load_warning() == "the machine is loaded (load average 9.0 on 2 CPUs)"
    monkeypatch.setattr(timing, "machine_load", lambda: (0.4, 2))
    assert timing.load_warning() is None
    monkeypatch.setattr(timing, "machine_load", lambda: (None, 2))  # no load average on this OS
    assert timing.load_warning() is None


def test_bench_flags_noisy_rows_and_warns_of_a_loaded_machine(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(timing, "perf_counter", noisy_clock())
    monkeypatch.setattr(timing, "machine_load", lambda: (9.0, 2))
    doc_path, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", "torch_native", "--device", "cpu", "--workload", "decode", "--budget", "0.05"]
    assert main([*argv, "--json", str(doc_path), "--plot", str(plot)]) == 0
    captured = capsys.readouterr()
    assert "warning: the machine is loaded (load average 9.0 on 2 CPUs)" in captured.err  # before the run
    header = next(line for line in captured.out.splitlines() if line.startswith("SHAPE"))
    assert all(col in header for col in ("MIN", "MEDIAN", "MAX", "SPREAD"))
    assert "NOISY" in captured.out
    assert "warning: the machine is loaded (load average 9.0 on 2 CPUs)" in captured.out
    assert "rows have a spread over ±12% (marked NOISY)" in captured.out
    doc = json.loads(doc_path.read_text())
    assert doc["spread_threshold"] == timing.SPREAD_THRESHOLD
    assert any("machine is loaded" in w for w in doc["warnings"]) and any("NOISY" in w for w in doc["warnings"])
    rows = doc["rows"]
    assert any(r["noisy"] for r in rows)
    for r in rows:
        assert r["min_us"] <= r["q1_us"] <= r["median_us"] <= r["q3_us"] <= r["max_us"]
        assert r["noisy"] == (r["spread"] > timing.SPREAD_THRESHOLD)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_on_a_steady_timer_flags_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(timing, "perf_counter", SteppedClock([0.0005]))  # every call 0.5 ms exactly
    monkeypatch.setattr(timing, "machine_load", lambda: (0.1, 2))
    doc_path = tmp_path / "bench.json"
    argv = [
        "bench",
        "torch_native",
        "--device",
        "cpu",
        "--workload",
        "decode",
        "--budget",
        "0.01",
        "--json",
        str(doc_path),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "NOISY" not in out and "warning:" not in out
    doc = json.loads(doc_path.read_text())
    assert doc["warnings"] == [] and not any(r["noisy"] for r in doc["rows"])
    assert all(r["spread"] == pytest.approx(0.0) and r["median_us"] == pytest.approx(500.0) for r in doc["rows"])
