"""The `attn-core` command line. Each subcommand lives in one function `cmd_<name>`; the work is done by
`attn_core.discovery.registry`, `attn_core.testing` (check) and `attn_core.bench` (bench).

Import-light: reading the arguments, `--help`, `list` and `explain` import no torch on a machine without
a GPU (each command imports what it needs when it runs); `check` and `bench` do. Argument types live in
`attn_core.cli.args`: a bad argument is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import textwrap
from typing import Any, Callable, Optional, Sequence

from attn_core.bench.cli import add_bench_arguments
from attn_core.cli.args import (
    ArgumentParser,
    compute_capability,
    device_arg,
    device_or_auto,
    dtype_arg,
    forward_mode_name,
    positive_int,
)
from attn_core.cli.verdicts import fail, unavailable_here
from attn_core.contract.capabilities import ARCH_MHA, ARCH_MLA, CudaGraphLevel, Feature, Requirements
from attn_core.contract.errors import AttnError, BackendUnavailableError, quote
from attn_core.contract.forward_mode import ForwardMode
from attn_core.discovery import registry


def list_rows(probe: bool = True) -> list[dict]:
    """One record per discovered backend (and per known backend not installed): name, distribution,
    version, state ("available", "unavailable", "not probed", "failed", "not installed"), reason, what
    the backend found here (info), registry notes, its unverified paths, its declared known gaps
    (`BackendSpec.known_gaps`, `{"checks": glob, "why": reason}`) and a capability summary. What
    `list` prints and `list --json` writes."""
    rows: list[dict] = []
    entries = registry.list_backends()
    for entry in entries if probe else ():
        entry.start_probe()  # all probes run at once: a hanging one costs one time limit in all
    for entry in entries:
        row: dict[str, Any] = dict(
            name=entry.name, distribution=entry.distribution, version=entry.version, state="failed"
        )
        row.update(reason=None, info=None)
        row.update(notes=list(entry.notes), unverified=None, capabilities=None, known_gaps=[])
        if entry.ok:
            reason = entry.probe() if probe else None
            row["state"] = "not probed" if not probe else "unavailable" if reason else "available"
            row["reason"] = reason
            row["info"] = entry.info() if probe and not reason else None
            row["unverified"] = entry.usable_spec.unverified or None
            row["known_gaps"] = [{"checks": pattern, "why": why} for pattern, why in entry.usable_spec.known_gaps]
            row["capabilities"] = entry.usable_spec.capabilities.summary()
        else:
            row["reason"] = str(entry.error)
        rows.append(row)
    installed = {r["name"] for r in rows}
    aliases = registry.default_registry().aliases()
    for name, dist in registry.KNOWN_BACKENDS.items():
        if name not in installed and name not in aliases:
            reason = registry.not_installed_reason(dist)
            row = dict(name=name, distribution=dist, version=None, state="not installed", reason=reason, info=None)
            rows.append({**row, "notes": [], "unverified": None, "capabilities": None, "known_gaps": []})
    return rows


def _status(row: dict) -> str:
    """The STATUS cell of a `list_rows` record."""
    state, reason = row["state"], row["reason"]
    if state == "not installed":
        status = reason
    elif state in ("unavailable", "failed"):
        status = f"{state}: {reason}"
    else:
        status = f"{state} ({row['info']})" if row["info"] else state
    if row["notes"]:
        status += f" ({'; '.join(row['notes'])})"
    if row["unverified"]:
        status += f" [unverified: {row['unverified']}]"
    if row["known_gaps"]:
        status += f" [known gaps: {', '.join(g['checks'] for g in row['known_gaps'])}]"
    return status


def cmd_list(args: argparse.Namespace) -> int:
    """One row per discovered backend: name, distribution, version, available here or why not,
    key capabilities. Lines are wrapped to the terminal's width (`COLUMNS`) when stdout is a terminal; piped
    or captured output keeps one line per backend (what scripts and `grep` read)."""
    rows = list_rows(args.probe)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [("NAME", "DISTRIBUTION", "VERSION", "STATUS", "CAPABILITIES")]
    table += [(r["name"], r["distribution"], r["version"] or "-", _status(r), r["capabilities"] or "-") for r in rows]
    width = shutil.get_terminal_size((0, 0)).columns if sys.stdout.isatty() else 0
    if width > 0:
        _print_wrapped(table, width)
    else:
        _print_table(table)
    return 0


def _check_child(args: argparse.Namespace, device: str) -> Callable[[Sequence[str]], list[str]]:
    """The command line of `check --isolate`'s child for a group of check ids: this check's settings, those ids."""
    base = [sys.executable, "-m", "attn_core.cli.main", "check", args.name, "--device", device]
    base += ["--seed", str(args.seed)]
    base += ["--quick"] if args.quick else []
    for key, value in args.option:
        base += ["--option", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    for pattern in args.skip:
        base += ["--skip", pattern]
    return lambda ids: [*base, *(arg for check_id in ids for arg in ("--id", check_id)), "--outcome-lines"]


def cmd_check(args: argparse.Namespace) -> int:
    """Run the conformance kit on one backend: every declared capability against the float64
    reference, K/V writes slot by slot, the CUDA-graph path, bad inputs, refusals, spec lightness.
    `--isolate` runs each check in a process of its own (`attn_core.testing.isolated`): a check that kills
    its process (an illegal memory access, an abort) fails alone and the others still run."""
    from attn_core.testing.isolated import outcome_line, run_isolated
    from attn_core.testing.kit import make_plan, run_plan, selected
    from attn_core.testing.outcome import Outcome

    try:
        if (unavailable := unavailable_here(args.name)) is not None:
            return fail("check", unavailable)
        plan = make_plan(
            args.name,
            device=args.device,
            quick=args.quick,
            seed=args.seed,
            options=dict(args.option),
            skip={pattern: "skipped with --skip" for pattern in args.skip},
        )
    except AttnError as exc:
        return fail("check", exc)
    target = plan.target
    if plan.unavailable:
        return fail("check", BackendUnavailableError(target.name, plan.unavailable))
    if args.list:
        for check in plan.checks:
            print(f"{check.id}  {check.description}".rstrip())
        return 0
    if args.outcome_lines:  # an --isolate child: its checks' outcome lines only
        run_plan(plan, select=args.k, ids=args.id, on_outcome=lambda o: print(outcome_line(o), flush=True))
        return 0  # (each line as its check ends: a crash later in the group keeps the lines before it)
    print(f"checking {target.name} on {plan.profile.device} ({plan.profile.name} profile, {len(plan.checks)} checks)")
    for pattern, reason in plan.skip.items():
        print(f"skipping {pattern}: {reason}")

    def show(outcome) -> None:
        if outcome.status == "passed" and args.quiet:
            return
        tag = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}[outcome.status]
        first, *rest = (outcome.message or "").splitlines() or [""]
        if outcome.status == "failed":
            print(f"{tag}  {outcome.check_id}  ({outcome.seconds:.2f}s)")
            for line in [first, *rest]:
                print(f"      {line}")
        else:
            print(f"{tag}  {outcome.check_id}  ({outcome.seconds:.2f}s)  {first}")
        sys.stdout.flush()

    if args.isolate:
        outcomes: list[Outcome] = []
        to_run: list[str] = []
        for check in selected(plan, args.k, args.id):  # skips first, without a process
            why = plan.skip_reason(check.id)
            if why is None:
                to_run.append(check.id)
            else:
                outcomes.append(Outcome(check.id, "skipped", why, 0.0))
                show(outcomes[-1])
        child = _check_child(args, str(plan.profile.device))
        outcomes += run_isolated(to_run, child, args.jobs, on_outcome=show, per_process=args.per_process)
    else:
        outcomes = run_plan(plan, select=args.k, on_outcome=show, ids=args.id)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("passed", "failed", "skipped")}
    seconds = sum(o.seconds for o in outcomes)
    print(f"check: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped in {seconds:.1f}s")
    if not outcomes:
        return fail("check", f"no check matches {args.k}")
    return 1 if counts["failed"] else 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Time backends on the standard decode / extend / mixed shapes (docs/design.md §8, scaled down on CPU),
    each checked against the float64 reference first."""
    from attn_core.bench.cli import run_bench_command

    return run_bench_command(args)


def cmd_explain(args: argparse.Namespace) -> int:
    """For a request, every discovered backend with "usable" or every reason it is not, then the selection:
    which backend each phase (prefill, decode) goes to and the declared measurement behind it (with NAME:
    that backend only, no selection; exit status 2 with the registry's one line when it cannot run here)."""
    if args.name is not None:
        try:
            if (unavailable := unavailable_here(args.name)) is not None:
                return fail("explain", unavailable)
        except AttnError as exc:
            return fail("explain", exc)
    req = requirements_from_args(args)
    print("request: " + _describe_request(req))
    rows = [("NAME", "DISTRIBUTION", "USABLE")]
    usable = 0
    reports = registry.explain(req)
    if args.name is not None:
        wanted = registry.default_registry().resolve(args.name).name
        reports = [r for r in reports if r.name == wanted]
    for report in reports:
        if report.usable:
            usable += 1
            rows.append((report.name, report.distribution, "usable"))
            continue
        first, *rest = report.reasons or ("not usable",)
        rows.append((report.name, report.distribution, f"no: {first}"))
        rows += [("", "", f"    {r}") for r in rest]
    _print_table(rows)
    if usable and args.name is None:
        selection = registry.explain_selection(req)
        print(f"selected: {selection.name}")
        for line in selection.describe():
            print(f"  {line}")
    return 0 if usable else 1


def add_explain_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="only this backend (default: every discovered backend)")
    p.add_argument(
        "--device",
        type=device_or_auto,
        default="auto",
        help="cpu, cuda (or another device type); auto: cuda when torch sees one, else cpu",
    )
    p.add_argument(
        "--compute-capability",
        type=compute_capability,
        metavar="MAJOR.MINOR",
        help="CUDA compute capability (default: the visible GPU's)",
    )
    p.add_argument("--dtype", type=dtype_arg, default="bfloat16", help="q dtype (default bfloat16)")
    p.add_argument("--kv-dtype", type=dtype_arg, help="KV-cache dtype (default: --dtype)")
    p.add_argument("--head-dim", type=positive_int, default=128, help="head dim (default 128; 576 with --mla)")
    p.add_argument("--page-size", type=positive_int, default=1, help="KV page size in tokens (default 1)")
    p.add_argument("--mla", action="store_true", help="multi-head latent attention (DeepSeek-style)")
    p.add_argument(
        "--mode",
        type=forward_mode_name,
        action="append",
        default=[],
        help="forward mode needed (repeatable; default EXTEND and DECODE)",
    )
    p.add_argument(
        "--feature", action="append", default=[], choices=[f.value for f in Feature], help="feature needed (repeatable)"
    )
    p.add_argument(
        "--cuda-graph",
        default="never",
        choices=[lvl.name.lower() for lvl in CudaGraphLevel],
        help="CUDA-graph level needed",
    )


def _detect_device(device: str, parsed: Optional[tuple[int, int]]) -> tuple[str, Optional[tuple[int, int]]]:
    """The device type of the request and its compute capability; torch is asked only for "auto" or a
    cuda device without `--compute-capability`, and only where a GPU device node exists."""
    device = device.partition(":")[0]
    if device != "auto" and not (device == "cuda" and parsed is None):
        return device, parsed
    from attn_core.discovery.probes import gpu_device_present

    if not gpu_device_present():
        return ("cpu" if device == "auto" else device), parsed
    try:
        import torch
    except ImportError:
        return ("cpu" if device == "auto" else device), parsed
    if torch.cuda.is_available():
        return "cuda", parsed or torch.cuda.get_device_capability()
    return ("cpu" if device == "auto" else device), parsed


def requirements_from_args(args: argparse.Namespace) -> Requirements:
    device, cc = _detect_device(args.device, args.compute_capability)
    cpu_flags = None
    if device == "cpu":
        from attn_core.discovery.probes import cpu_flags as read_cpu_flags

        cpu_flags = read_cpu_flags()
    head_dim = 576 if args.mla and args.head_dim == 128 else args.head_dim
    modes = (
        frozenset(ForwardMode.parse(m) for m in args.mode)
        if args.mode
        else frozenset({ForwardMode.EXTEND, ForwardMode.DECODE})
    )
    return Requirements(
        device_type=device,
        compute_capability=cc,
        cpu_flags=cpu_flags,
        q_dtype=args.dtype,
        kv_dtype=args.kv_dtype or args.dtype,
        head_dim=head_dim,
        page_size=args.page_size,
        arch=ARCH_MLA if args.mla else ARCH_MHA,
        features=frozenset(Feature(f) for f in args.feature),
        forward_modes=modes,
        cuda_graph=CudaGraphLevel[args.cuda_graph.upper()],
    )


def _describe_request(req) -> str:
    cc = (
        f" (compute capability {req.compute_capability[0]}.{req.compute_capability[1]})"
        if req.compute_capability
        else ""
    )
    return (
        f"device={req.device_type}{cc}, q={req.q_dtype}, kv={req.kv_dtype}, head_dim={req.head_dim}, "
        f"page_size={req.page_size}, "
        f"arch={req.arch}, modes={','.join(sorted(m.name for m in req.forward_modes))}, "
        f"features={','.join(sorted(f.value for f in req.features)) or '-'}, cuda graphs={req.cuda_graph.name}"
    )


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        head = "  ".join(str(c).ljust(w) for c, w in zip(r, widths))
        print(f"{head}  {r[-1]}".rstrip())


def _print_wrapped(rows: Sequence[Sequence[str]], width: int) -> None:
    """`list`'s table within `width` columns: NAME, DISTRIBUTION and VERSION as columns, STATUS wrapped
    beside them, the capabilities on indented lines below each row."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(3)]
    indent = sum(widths) + 2 * len(widths)
    status_width = max(24, width - indent)
    for i, r in enumerate(rows):
        head = "  ".join(str(c).ljust(w) for c, w in zip(r, widths)) + "  "
        lines = textwrap.wrap(str(r[3]), status_width, break_on_hyphens=False, break_long_words=False) or [""]
        print((head + lines[0]).rstrip())
        for line in lines[1:]:
            print(" " * indent + line)
        if i and r[4] != "-":
            caps = f"capabilities: {r[4]}".replace(",", ", ")
            for line in textwrap.wrap(caps, max(24, width - 4), break_on_hyphens=False, break_long_words=False):
                print("    " + line)


class _VersionAction(argparse.Action):
    """`attn-core --version`: attn-core's version and every installed backend distribution's (discovery
    only: no probe, no torch)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        import attn_core

        print(f"attn-core {attn_core.__version__}")
        dists: dict[str, tuple[str, list[str]]] = {}
        for entry in registry.list_backends():
            if entry.distribution != registry.CORE_DISTRIBUTION:
                dists.setdefault(entry.distribution, (entry.version or "-", []))[1].append(entry.name)
        for dist, (version, names) in sorted(dists.items()):
            print(f"{dist} {version} ({', '.join(names)})")
        parser.exit(0)


def _option(text: str) -> tuple[str, object]:
    """KEY=VALUE with VALUE read as JSON when it parses (numbers, true/false), else as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {quote(text)}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="attn-core",
        description="Discover, check and benchmark attention backends of the attn project.",
    )
    parser.add_argument(
        "--version", action=_VersionAction, help="print the versions of attn-core and of the installed backends"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "list",
        help="list discovered backends: distribution, version, availability here, capabilities",
        description=cmd_list.__doc__,
    )
    p.add_argument(
        "--no-probe",
        dest="probe",
        action="store_false",
        help='do not probe availability (no torch import): "not probed"',
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON (every field, no wrapping)")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("check", help="run the conformance kit on a backend", description=cmd_check.__doc__)
    p.add_argument("name", help="backend name (see `attn-core list`)")
    p.add_argument(
        "--device", type=device_arg, help="cpu, cuda or cuda:N (default: cuda when declared and visible, else cpu)"
    )
    p.add_argument(
        "--quick", action="store_true", help="fewer cases (CI of slow backends, e.g. under the Triton interpreter)"
    )
    p.add_argument(
        "-k",
        action="append",
        default=[],
        metavar="SUBSTR",
        help="run only checks whose id contains SUBSTR (repeatable)",
    )
    p.add_argument(
        "--skip", action="append", default=[], metavar="GLOB", help="skip checks whose id matches GLOB (repeatable)"
    )
    p.add_argument(
        "--option", action="append", default=[], type=_option, metavar="KEY=VALUE", help="backend constructor option"
    )
    p.add_argument("--id", action="append", default=[], metavar="ID", help="run the check of this id (repeatable)")
    p.add_argument(
        "--isolate",
        action="store_true",
        help="run each check in a process of its own: one that kills its process (an illegal memory access, "
        "an abort) fails alone, the others still run",
    )
    p.add_argument(
        "--jobs", type=positive_int, default=1, metavar="N", help="with --isolate: checks run at once (default 1)"
    )
    p.add_argument(
        "--per-process",
        type=positive_int,
        default=1,
        metavar="K",
        help="with --isolate: up to K consecutive checks share a process (its start-up paid once); a crash still "
        "fails only the check that was running, the ones after it run again alone (default 1)",
    )
    p.add_argument("--outcome-lines", action="store_true", help=argparse.SUPPRESS)  # an --isolate child's output
    p.add_argument("--seed", type=int, default=0, help="seed of the random cases (default 0)")
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    p.add_argument("-q", "--quiet", action="store_true", help="print failures and skips only")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("bench", help="benchmark backends on the standard shapes", description=cmd_bench.__doc__)
    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "explain", help="which backends can serve a request, and why not", description=cmd_explain.__doc__
    )
    add_explain_arguments(p)
    p.set_defaults(func=cmd_explain)
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
