"""Progress on long work, for the people waiting on it (attn-cpu-amx's first compile, the example
engine, `attn-core bench`). No dependency: where stderr is a terminal a line counts the seconds in place,
elsewhere (logs, CI) one line when the work starts and one when it ends.

    from attn_core.cli.progress import working

    with working("attn-cpu-amx: compiling the C++ kernels (first use, about 25-60 s)"):
        build()
    # stderr: "attn-cpu-amx: compiling the C++ kernels (first use, about 25-60 s) ... done in 31.2 s"
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Iterator, Optional, TextIO


@contextlib.contextmanager
def working(label: str, stream: Optional[TextIO] = None, tick_s: float = 1.0) -> Iterator[None]:
    """Say `label ...` on `stream` (default stderr) when the block starts, count the seconds in place
    while it runs (terminals only) and end the line with "done in N s" (or "failed after N s")."""
    out = stream or sys.stderr
    tty = hasattr(out, "isatty") and out.isatty()
    start = time.perf_counter()
    stop = threading.Event()
    out.write(f"{label} ...")
    out.write("" if tty else "\n")
    out.flush()

    def tick() -> None:
        while not stop.wait(tick_s):
            out.write(f"\r\033[K{label} ... {time.perf_counter() - start:.0f} s")
            out.flush()

    ticker = threading.Thread(target=tick, daemon=True) if tty else None
    if ticker is not None:
        ticker.start()
    outcome = "failed after"
    try:
        yield
        outcome = "done in"
    finally:
        stop.set()
        if ticker is not None:
            ticker.join()
        elapsed = time.perf_counter() - start
        prefix = f"\r\033[K{label} ... " if tty else f"{label}: "
        out.write(f"{prefix}{outcome} {elapsed:.1f} s\n")
        out.flush()
