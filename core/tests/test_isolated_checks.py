"""`attn-core check --isolate` (`attn_core.testing.isolated`): each check in a process of its own, so that a check
that kills its process (on a GPU: an illegal memory access, an abort) fails alone, named, and the others report.
Children here are small Python programs standing in for `attn-core check ... --id ID --outcome-lines`, then the
real command on torch_native."""

from __future__ import annotations

import subprocess
import sys

import pytest

from attn_core.testing.isolated import OUTCOME_MARKER, ended_early, how_it_ended, outcome_line, reported, run_isolated
from attn_core.testing.outcome import Outcome


def test_outcome_lines_round_trip_and_crashes_are_named():
    good = Outcome("dtype-float16-DECODE", "passed", "rel err 0.0003", 0.21)
    line = outcome_line(good)
    assert line.startswith(OUTCOME_MARKER)
    assert reported(f"noise\n{line}\nmore noise\n{OUTCOME_MARKER}not json\n") == {good.check_id: good}
    assert reported("no outcome here\n") == {}
    crashed = ended_early("hostile-basic-row_huge", "x" * 5000 + "CUDA error: illegal memory access", -6, 1.5)
    assert crashed.status == "failed" and crashed.seconds == 1.5
    assert "by signal SIGABRT" in crashed.message and crashed.message.endswith("illegal memory access")
    assert len(crashed.message) < 1000  # the end of stderr only
    assert "a" not in reported(outcome_line(Outcome("b", "passed", "", 0.1)))  # another check's line
    other = ended_early("a", "", 0, 0.2)
    assert other.status == "failed" and "with exit status 0" in other.message
    assert how_it_ended(3) == "with exit status 3" and how_it_ended(-11) == "by signal SIGSEGV"


def _script(check_id: str) -> str:
    """A stand-in check: reports for "ok-*", aborts for "abort-*", sleeps for "slow-*"."""
    if check_id.startswith("abort"):
        return "import os, sys; sys.stderr.write('fatal: the context is gone'); sys.stderr.flush(); os.abort()"
    if check_id.startswith("slow"):
        return "import time; time.sleep(30)"
    return f"print({outcome_line(Outcome(check_id, 'passed', 'fine', 0.01))!r}, flush=True)"


def _child(ids) -> list[str]:
    """A stand-in child running its group's checks in order, in one process (a group of one: one check)."""
    return [sys.executable, "-c", "\n".join(_script(check_id) for check_id in ids)]


def test_a_crashing_check_fails_alone_and_the_order_is_the_plans():
    seen = []
    ids = ["ok-1", "abort-2", "ok-3", "slow-4", "ok-5"]
    outcomes = run_isolated(ids, _child, jobs=3, on_outcome=seen.append, timeout=5)
    assert [o.check_id for o in outcomes] == ids and seen == outcomes
    status = {o.check_id: o.status for o in outcomes}
    assert status == {"ok-1": "passed", "abort-2": "failed", "ok-3": "passed", "slow-4": "failed", "ok-5": "passed"}
    assert "SIGABRT" in outcomes[1].message and "the context is gone" in outcomes[1].message
    assert "ran past 5 s" in outcomes[3].message


def test_checks_sharing_a_process_fail_alone_too():
    # groups [ok-1, abort-2, ok-3] and [ok-4, slow-5, ok-6]: the check that was running when its process died fails,
    # the one before it keeps its report, the one after it (which never ran) runs again in a process of its own
    runs = []

    def child(ids):
        runs.append(list(ids))
        return _child(ids)

    seen = []
    ids = ["ok-1", "abort-2", "ok-3", "ok-4", "slow-5", "ok-6"]
    outcomes = run_isolated(ids, child, jobs=2, on_outcome=seen.append, timeout=2, per_process=3)
    assert [o.check_id for o in outcomes] == ids and seen == outcomes
    assert [o.status for o in outcomes] == ["passed", "failed", "passed", "passed", "failed", "passed"]
    assert "SIGABRT" in outcomes[1].message and "ran past 6 s (2 s a check, 3 in its process)" in outcomes[4].message
    assert sorted(runs) == sorted([["ok-1", "abort-2", "ok-3"], ["ok-4", "slow-5", "ok-6"], ["ok-3"], ["ok-6"]])
    with pytest.raises(ValueError, match="per_process"):
        run_isolated(ids, child, per_process=0)


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "attn_core.cli.main", "check", "torch_native", "--device", "cpu", "--quick", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_the_command_isolated_gives_what_it_gives_in_one_process():
    plain = _cli("-k", "bad_input-q")
    isolated = _cli("-k", "bad_input-q", "--isolate", "--jobs", "2")
    assert plain.returncode == 0 and isolated.returncode == 0, isolated.stderr[-2000:]

    def verdicts(out: str) -> list[tuple[str, str]]:
        return [tuple(line.split()[:2]) for line in out.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))]

    assert verdicts(plain.stdout) == verdicts(isolated.stdout) and len(verdicts(plain.stdout)) >= 3
    grouped = _cli("-k", "bad_input-q", "--isolate", "--jobs", "2", "--per-process", "2")
    assert grouped.returncode == 0 and verdicts(grouped.stdout) == verdicts(plain.stdout), grouped.stderr[-2000:]
    one = _cli("--id", "bad_input-q_rows")
    assert one.returncode == 0 and [v[1] for v in verdicts(one.stdout)] == ["bad_input-q_rows"]
    bad = _cli("--isolate", "--jobs", "0")
    assert bad.returncode == 2 and "--jobs" in bad.stderr
