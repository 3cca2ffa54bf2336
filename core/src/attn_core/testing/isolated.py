"""Kit checks each in a process of its own (`attn-core check NAME --isolate`), so that a check which kills
its process (an illegal memory access poisons the CUDA context for every later check; an abort, a
segmentation fault) fails that check alone, named, and the others still run and report.

`run_isolated(ids, command, jobs, on_outcome)` runs `command(id)` (an argv) for each check id, `jobs` at a
time, and reads the child's outcome from its output: one line `OUTCOME_MARKER` + JSON
(`{"check_id", "status", "message", "seconds"}`) that `outcome_line` writes. A child that exits without
such a line gives a failed outcome naming how it ended (exit status or signal) and the end of its
stderr. Outcomes are reported in the order of `ids`, whatever order the children finish in.

Worked example: `outcome_line(Outcome("dtype-float16-DECODE", "passed", "rel err 0.0003", 0.21))` is
`'ATTN-KIT-OUTCOME {"check_id": "dtype-float16-DECODE", "status": "passed", "message": "rel err 0.0003",
"seconds": 0.21}'`, and `read_outcome("dtype-float16-DECODE", <that line + other output>, "", 0, 0.3)` gives
the outcome back; a child killed by SIGABRT (exit status -6) without that line gives
`Outcome("dtype-float16-DECODE", "failed", "the check's process ended by signal SIGABRT before it reported
...", 0.3)`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

from attn_core.testing.outcome import Outcome

#: the prefix of the one line a child writes with its outcome
OUTCOME_MARKER = "ATTN-KIT-OUTCOME "
#: how much of a crashed child's stderr the failure quotes (characters, from the end)
STDERR_TAIL = 600


def outcome_line(outcome: Outcome) -> str:
    """The line a child prints for `outcome` (module docstring)."""
    fields = {"check_id": outcome.check_id, "status": outcome.status, "message": outcome.message}
    return OUTCOME_MARKER + json.dumps({**fields, "seconds": outcome.seconds})


def how_it_ended(returncode: int) -> str:
    """A child's exit in words. Example: -6 -> "by signal SIGABRT"; 3 -> "with exit status 3"."""
    if returncode < 0:
        try:
            return f"by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"by signal {-returncode}"
    return f"with exit status {returncode}"


def read_outcome(check_id: str, stdout: str, stderr: str, returncode: int, seconds: float) -> Outcome:
    """The outcome a child reported for `check_id`, or a failed one saying how the child ended without."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(OUTCOME_MARKER):
            try:
                fields = json.loads(line[len(OUTCOME_MARKER) :])
            except json.JSONDecodeError:
                break
            if fields.get("check_id") == check_id and fields.get("status") in ("passed", "failed", "skipped"):
                return Outcome(check_id, fields["status"], str(fields.get("message", "")), float(fields["seconds"]))
            break
    tail = stderr.strip()[-STDERR_TAIL:]
    message = (
        f"the check's process ended {how_it_ended(returncode)} before it reported (an illegal memory access, an "
        f"abort or a crash kills the process: the other checks ran in processes of their own)"
    )
    return Outcome(check_id, "failed", message + (f"; the end of its stderr:\n{tail}" if tail else ""), seconds)


def run_isolated(
    ids: Sequence[str],
    command: Callable[[str], list[str]],
    jobs: int = 1,
    on_outcome: Optional[Callable[[Outcome], None]] = None,
    timeout: Optional[float] = None,
) -> list[Outcome]:
    """Run check `ids` each as `command(id)` in a process of its own, `jobs` at once; outcomes in the
    order of `ids` (`on_outcome` called in that order too, as soon as each and those before it are in).
    `timeout` (seconds, None: none): a child still running then is killed and its check fails."""
    if jobs < 1:
        raise ValueError(f"jobs: expected >= 1, found {jobs}")

    def one(check_id: str) -> Outcome:
        t0 = time.perf_counter()
        try:
            done = subprocess.run(command(check_id), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            killed = f"the check's process ran past {timeout} s and was killed"
            return Outcome(check_id, "failed", killed, timeout or 0.0)
        return read_outcome(check_id, done.stdout, done.stderr, done.returncode, time.perf_counter() - t0)

    outcomes: list[Outcome] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for outcome in pool.map(one, ids):  # map yields in the order of ids
            outcomes.append(outcome)
            if on_outcome is not None:
                on_outcome(outcome)
    return outcomes


__all__ = ["OUTCOME_MARKER", "how_it_ended", "outcome_line", "read_outcome", "run_isolated"]
