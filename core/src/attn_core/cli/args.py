"""Argument types of the `attn-core` command line: each turns one string into a checked value or raises
`argparse.ArgumentTypeError` with what was expected, so that a bad argument ends the command with one
line naming it and exit status 2 before any work starts. Torch-free (dtypes are checked by name).

>>> positive_int("16")
16
>>> device_arg("cuda:1")
'cuda:1'
>>> dtype_arg("bf16")
'bfloat16'
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import NoReturn, Optional

from attn_core.contract.errors import QUOTE_LIMIT, quote

#: the dtype names the command line accepts (torch attribute names; capabilities use the same names)
DTYPE_NAMES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)
#: short spellings accepted for the common dtypes
DTYPE_ALIASES = {
    "fp32": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp64": "float64",
    "double": "float64",
}
#: device types a backend can declare (`Capabilities.devices`); an index may follow (`cuda:1`)
DEVICE_TYPES = ("cpu", "cuda", "xpu", "npu", "mps")


#: a single-quoted value longer than QUOTE_LIMIT, starting and ending with a non-space (so the text between
#: two short quoted values never matches)
_QUOTED = re.compile(r"'([^'\s][^'\n]{" + str(QUOTE_LIMIT - 1) + r",}[^'\s])'")


def clip_quoted(message: str, limit: int = QUOTE_LIMIT) -> str:
    """`message` with every single-quoted value longer than `limit` characters cut to `limit` and its
    length (argparse quotes the raw value in its own messages): "invalid choice: 'xxx…' (5000
    characters)"; a short message comes back unchanged."""
    return _QUOTED.sub(lambda m: m.group(0) if m.group(1).endswith("…") else quote(m.group(1), limit), message)


class ArgumentParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose usage errors are one line on stderr (`PROG: error: ...`,
    with a pointer to `--help`; a quoted value cut to ~80 characters) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {clip_quoted(message)} (see {self.prog} --help)\n")
        sys.exit(2)


def positive_int(text: str) -> int:
    """An integer ≥ 1, e.g. a page size or a head dim. `positive_int("0")` raises."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {quote(text)}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0, e.g. a time budget in seconds. NaN, inf and ≤ 0 raise."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {quote(text)}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {quote(text)}")
    return value


def dtype_arg(text: str) -> str:
    """A dtype name of `DTYPE_NAMES` (or a short alias of `DTYPE_ALIASES`), returned as the full name:
    "bf16" → "bfloat16", "torch.float16" → "float16"; "int3" raises."""
    name = text.strip().lower().removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"unknown dtype {quote(text)}; expected one of {', '.join(DTYPE_NAMES)}")
    return name


def device_arg(text: str, types: tuple[str, ...] = DEVICE_TYPES) -> str:
    """A device `TYPE` or `TYPE:INDEX` with TYPE in `types`, e.g. "cpu", "cuda", "cuda:1"."""
    kind, sep, index = text.partition(":")
    if kind not in types or (sep and not index.isdigit()):
        raise argparse.ArgumentTypeError(
            f"unknown device {quote(text)}; expected one of {', '.join(types)} (an index may follow: cuda:1)"
        )
    return text


def device_or_auto(text: str) -> str:
    """`device_arg`, or "auto" (the command picks: cuda when torch sees one, else cpu): "auto" → "auto",
    "cuda:1" → "cuda:1"; "cuda:x" raises."""
    return text if text == "auto" else device_arg(text)


def bench_device(text: str) -> str:
    """A device the benchmark runs on: "cpu", "cuda" or "cuda:N" ("cuda:0" → "cuda:0"; "mps" raises)."""
    return device_arg(text, ("cpu", "cuda"))


def compute_capability(text: str) -> tuple[int, int]:
    """ "MAJOR.MINOR" (or "MAJOR") of a CUDA compute capability: `compute_capability("9.0") == (9, 0)`."""
    major, _, minor = text.partition(".")
    if not major.isdigit() or (minor and not minor.isdigit()):
        raise argparse.ArgumentTypeError(f"expected MAJOR.MINOR (e.g. 9.0), got {quote(text)}")
    return int(major), int(minor or 0)


def forward_mode_name(text: str) -> str:
    """A `ForwardMode` name (any case), returned upper-case: "decode" → "DECODE"."""
    from attn_core.contract.forward_mode import ForwardMode

    try:
        return ForwardMode.parse(text).name
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown forward mode {quote(text)}; expected one of {', '.join(m.name for m in ForwardMode)}"
        ) from None


def writable_file(text: str) -> str:
    """A path the command will write at the end: its folder must exist and be writable, and the path
    must not be a folder or a read-only file. Checked when the arguments are read, before any work.
    Example: "/tmp/out.json" → "/tmp/out.json"; "/tmp" raises ("is a folder"), "/missing/out.json" raises
    ("folder /missing does not exist")."""
    folder = os.path.dirname(os.path.abspath(text))
    problem: Optional[str] = None
    if os.path.isdir(text):
        problem = "is a folder"
    elif not os.path.isdir(folder):
        problem = f"folder {folder} does not exist"
    elif os.path.exists(text) and not os.access(text, os.W_OK):
        problem = "is not writable"
    elif not os.path.exists(text) and not os.access(folder, os.W_OK | os.X_OK):
        problem = f"folder {folder} is not writable"
    if problem:
        raise argparse.ArgumentTypeError(f"cannot write {quote(text)}: {problem}")
    return text
