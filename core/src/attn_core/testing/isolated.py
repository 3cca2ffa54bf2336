"""Kit checks each in a process of its own (`attn-core check NAME --isolate`), so that a check which kills
its process (an illegal memory access poisons the CUDA context for every later check; an abort, a
segmentation fault) fails that check alone, named, and the others still run and report.

`run_isolated(ids, command, jobs, on_outcome, per_process=K)` runs `command(group)` (an argv) for groups of
up to K consecutive check ids, `jobs` groups at a time, and reads each check's outcome from the child's
output: one line `OUTCOME_MARKER` + JSON (`{"check_id", "status", "message", "seconds"}`) per check that
`outcome_line` writes, in the group's order. A child that ends without the line of a check gives that
check (the first one missing: the check that was running) a failed outcome naming how the child ended (exit
status, signal, or the time limit) and the end of its stderr; the checks after it, which never ran, run
again each in a process of its own. So a crash still fails exactly one check, while K checks share one
process's start-up (importing torch, initializing CUDA, loading compiled kernels: seconds a process on a
GPU machine). Outcomes are reported in the order of `ids`, whatever order the children finish in.

Worked example: `outcome_line(Outcome("dtype-float16-DECODE", "passed", "rel err 0.0003", 0.21))` is
`'ATTN-KIT-OUTCOME {"check_id": "dtype-float16-DECODE", "status": "passed", "message": "rel err 0.0003",
"seconds": 0.21}'`, and `reported(<that line + other output>)` gives the outcome back under its id; for a
child killed by SIGABRT (exit status -6) before that line, `ended_early("dtype-float16-DECODE", stderr, -6,
0.3)` is `Outcome("dtype-float16-DECODE", "failed", "the check's process ended by signal SIGABRT before it
reported ...", 0.3)`. With K = 3 and ids [a, b, c], a child that reports a and then aborts gives a passed, b failed
(SIGABRT), and c run again alone.
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


def reported(stdout: str) -> dict[str, Outcome]:
    """The outcomes a child's output reports, by check id (lines that are not outcome lines, or do not parse,
    are ignored). Example: the output `"noise\n" + outcome_line(o)` gives `{o.check_id: o}`."""
    found: dict[str, Outcome] = {}
    for line in stdout.splitlines():
        if not line.startswith(OUTCOME_MARKER):
            continue
        try:
            fields = json.loads(line[len(OUTCOME_MARKER) :])
            check_id, status = str(fields["check_id"]), fields["status"]
            seconds = float(fields["seconds"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
        if status in ("passed", "failed", "skipped"):
            found[check_id] = Outcome(check_id, status, str(fields.get("message", "")), seconds)
    return found


def ended_early(check_id: str, stderr: str, returncode: int, seconds: float) -> Outcome:
    """The failed outcome of a check whose process ended (`returncode`) before it reported it."""
    tail = stderr.strip()[-STDERR_TAIL:]
    message = (
        f"the check's process ended {how_it_ended(returncode)} before it reported (an illegal memory access, an "
        f"abort or a crash kills the process: the other checks ran in processes of their own)"
    )
    return Outcome(check_id, "failed", message + (f"; the end of its stderr:\n{tail}" if tail else ""), seconds)


def run_isolated(
    ids: Sequence[str],
    command: Callable[[Sequence[str]], list[str]],
    jobs: int = 1,
    on_outcome: Optional[Callable[[Outcome], None]] = None,
    timeout: Optional[float] = None,
    per_process: int = 1,
) -> list[Outcome]:
    """Run check `ids` in processes of their own, `command(group)` for groups of up to `per_process`
    consecutive ids, `jobs` processes at once; outcomes in the order of `ids` (`on_outcome` called in that
    order too, as soon as each and those before it are in). A check a child did not report fails (the first
    missing one of its group) or runs again alone (the ones after it): module docstring. `timeout` (seconds a
    check, None: none): a child still running after that times its group's size is killed, and the check it
    was running fails."""
    if jobs < 1:
        raise ValueError(f"jobs: expected >= 1, found {jobs}")
    if per_process < 1:
        raise ValueError(f"per_process: expected >= 1, found {per_process}")

    def group_outcomes(group: Sequence[str]) -> list[Outcome]:
        t0 = time.perf_counter()
        limit = None if timeout is None else timeout * len(group)
        killed: Optional[str] = None  # why the child was killed, when it was
        try:
            done = subprocess.run(command(group), capture_output=True, text=True, timeout=limit)
            stdout, stderr, code = done.stdout, done.stderr, done.returncode
        except subprocess.TimeoutExpired as exc:
            stdout, stderr, code = _text(exc.stdout), _text(exc.stderr), 0
            killed = (
                f"the check's process ran past {limit} s ({timeout} s a check, {len(group)} in its process) "
                "and was killed"
            )
        found = reported(stdout)
        out: list[Outcome] = []
        for i, check_id in enumerate(group):
            if check_id in found:
                out.append(found[check_id])
                continue
            spent = max(0.0, time.perf_counter() - t0 - sum(o.seconds for o in out))
            if killed is not None:
                out.append(Outcome(check_id, "failed", killed, spent))
            else:
                out.append(ended_early(check_id, stderr, code, spent))
            for rest in group[i + 1 :]:  # never ran: each alone now
                out += group_outcomes([rest]) if rest not in found else [found[rest]]
            break
        return out

    groups = [list(ids[i : i + per_process]) for i in range(0, len(ids), per_process)]
    outcomes: list[Outcome] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for group in pool.map(group_outcomes, groups):  # map yields in the order of the groups
            for outcome in group:
                outcomes.append(outcome)
                if on_outcome is not None:
                    on_outcome(outcome)
    return outcomes


def _text(out) -> str:
    """A TimeoutExpired's captured output as text (bytes on some Python versions, None when nothing came)."""
    if out is None:
        return ""
    return out.decode(errors="replace") if isinstance(out, bytes) else out


__all__ = ["OUTCOME_MARKER", "ended_early", "how_it_ended", "outcome_line", "reported", "run_isolated"]
