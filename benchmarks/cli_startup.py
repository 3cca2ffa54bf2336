"""Start-up time of the `attn-core` command: a fresh process per run, wall clock from spawn to exit.

Peers measured in the same run: the bare interpreter (`python -c pass`, the floor), `python -c
"import torch"` (what every `attn-core` command paid before the command line imported lazily) and,
with `--before REV`, the same commands on the sources of git revision REV (core and plugins put first on
PYTHONPATH; the installed entry points are the same).

    .venv/bin/python benchmarks/cli_startup.py --runs 10 --before fcb7faa

Prints one row per command: the first run (the coldest this process can see: nothing of attn-core
imported yet in this run, the file cache as the machine left it) and the median of the others.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from attn_core.bench.timing import host_times_us


def attn_core_command() -> list[str]:
    """The installed `attn-core` script beside this interpreter (else `python -m attn_core.cli.main`)."""
    script = Path(sys.executable).with_name("attn-core")
    if script.exists():
        return [str(script)]
    found = shutil.which("attn-core")
    return [found] if found else [sys.executable, "-m", "attn_core.cli.main"]


def time_runs(cmd: list[str], runs: int, env: dict) -> list[float]:
    """Wall-clock seconds of `runs` fresh processes of `cmd` (output discarded; a failure raises)."""

    def run() -> None:
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)

    return [us * 1e-6 for us in host_times_us(run, runs)]


def sources_of(rev: str, into: str) -> str:
    """Extract core/src and plugins/*/src of git revision `rev` under `into`; the PYTHONPATH that puts
    them first."""
    root = Path(__file__).resolve().parents[1]
    archive = Path(into) / "src.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "archive", rev, "core/src", "plugins"], cwd=root, stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return os.pathsep.join([str(Path(into) / "core" / "src"), *map(str, sorted(Path(into).glob("plugins/*/src")))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10, help="processes per command (default 10)")
    ap.add_argument("--before", metavar="REV", help="also time the commands on the sources of git revision REV")
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cli = attn_core_command()
    commands = [
        ("attn-core list", [*cli, "list"]),
        ("attn-core list --no-probe", [*cli, "list", "--no-probe"]),
        ("attn-core --help", [*cli, "--help"]),
        ("peer: python -c pass", [sys.executable, "-c", "pass"]),
        ('peer: python -c "import torch"', [sys.executable, "-c", "import torch"]),
    ]
    print(
        f"{platform.node()} · {platform.processor() or platform.machine()} · {os.cpu_count()} cpus · "
        f"Python {platform.python_version()}"
    )
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · {args.runs} runs each\n")
    runs = [(label, cmd, env) for label, cmd in commands]
    with tempfile.TemporaryDirectory() as tmp:
        if args.before:
            before = {**env, "PYTHONPATH": sources_of(args.before, tmp)}
            runs += [(f"{label} @{args.before}", cmd, before) for label, cmd in commands[:3]]
        print(f"{'COMMAND':42}  {'FIRST':>8}  {'MEDIAN':>8}  {'MIN':>8}")
        for label, cmd, run_env in runs:
            times = time_runs(cmd, args.runs, run_env)
            rest = times[1:] or times
            print(f"{label:42}  {times[0]:7.3f}s  {statistics.median(rest):7.3f}s  {min(times):7.3f}s")


if __name__ == "__main__":
    main()
