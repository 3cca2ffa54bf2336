"""One kit check, its outcome, and the two exceptions a check raises to fail or to skip."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Callable


class KitFailure(AssertionError):
    """A check found the backend wrong; the message names the case."""


class KitSkip(Exception):
    """A check does not apply here; the message says why."""


@dataclass(frozen=True)
class Check:
    """One named check. `run()` returns a short detail line, or raises `KitFailure` / `KitSkip`."""

    id: str
    run: Callable[[], str]
    description: str = ""


@dataclass(frozen=True)
class Outcome:
    """What running a check gave: status "passed", "failed" or "skipped", a message, wall seconds."""

    check_id: str
    status: str
    message: str
    seconds: float

    @property
    def failed(self) -> bool:
        return self.status == "failed"


def execute(check: Check) -> Outcome:
    """Run `check`, turning every exception into a failed outcome that names the check and its case."""
    t0 = time.perf_counter()
    try:
        detail = check.run()
        status, message = "passed", detail
    except KitSkip as exc:
        status, message = "skipped", str(exc)
    except KitFailure as exc:
        status, message = "failed", f"{check.id}: {exc}"
    except Exception as exc:  # a crash of the backend under test is a failure of that check
        where = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-3)).rstrip()
        message = f"{check.id}: raised {type(exc).__name__}: {exc}\n  case: {check.description}\n{where}"
        status = "failed"
    return Outcome(check.id, status, message, time.perf_counter() - t0)
