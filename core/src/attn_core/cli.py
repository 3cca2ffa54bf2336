"""The `attn-core` command line. Each subcommand lives in one function `cmd_<name>`."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from attn_core import registry


def cmd_list(args: argparse.Namespace) -> int:
    """One row per discovered backend: name, distribution, version, available here or why not,
    key capabilities."""
    rows = [("NAME", "DISTRIBUTION", "VERSION", "STATUS", "CAPABILITIES")]
    for entry in registry.list_backends():
        if entry.ok:
            reason = entry.probe() if args.probe else None
            status = "available" if not reason else f"unavailable: {reason}"
            caps = entry.spec.capabilities.summary()
        else:
            status, caps = f"failed: {entry.error}", "-"
        rows.append((entry.name, entry.distribution, entry.version or "-", status, caps))
    installed = {r[0] for r in rows}
    for name, dist in registry.KNOWN_BACKENDS.items():
        if name not in installed and not any(e.ok and name in e.spec.aliases for e in registry.list_backends()):
            rows.append((name, dist, "-", f"not installed (pip install {dist})", "-"))
    _print_table(rows)
    return 0


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        head = "  ".join(str(c).ljust(w) for c, w in zip(r, widths))
        print(f"{head}  {r[-1]}".rstrip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attn-core",
        description="Discover, check and benchmark attention backends of the attn project.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "list",
        help="list discovered backends: distribution, version, availability here, capabilities",
        description=cmd_list.__doc__,
    )
    p.add_argument("--no-probe", dest="probe", action="store_false", help="do not probe availability (no torch import)")
    p.set_defaults(func=cmd_list)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
