"""What every `attn-core` command does when it cannot go on: one line on stderr and one exit status, shared
by the top-level commands (`attn_core.cli.main`) and `bench` (`attn_core.bench.cli`).

>>> fail("check", "attention backend 'x' cannot run here: needs CUDA")  # prints that line on stderr
2
"""

from __future__ import annotations

import sys
from typing import Optional

from attn_core.cli.args import clip_quoted
from attn_core.contract.errors import BackendUnavailableError
from attn_core.discovery import registry

#: exit status when the command could not do its job (unknown backend, not installed, cannot run here)
EXIT_CANNOT_RUN = 2


def fail(command: str, problem: object) -> int:
    """Print `attn-core COMMAND: PROBLEM` on stderr (one line; quoted user values cut to ~80 characters,
    `cli_args.clip_quoted`) and return `EXIT_CANNOT_RUN`."""
    print(f"attn-core {command}: {clip_quoted(str(problem))}", file=sys.stderr)
    return EXIT_CANNOT_RUN


def unavailable_here(name: str) -> Optional[BackendUnavailableError]:
    """The registry's verdict on backend `name` for `check`, `bench` and `explain NAME`: None when it can
    run here, else the typed error `create_backend` would raise, whose message is the one line every
    command prints ("attention backend 'flashinfer' cannot run here: <the probe's reason>"). Raises the
    registry's own errors (unknown, not installed, failed to load)."""
    entry = registry.default_registry().resolve(name)
    reason = entry.probe()
    return BackendUnavailableError(entry.name, reason) if reason else None
