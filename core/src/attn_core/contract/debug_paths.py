"""Which backend path and kernel each layer call took: a debug switch, free when off.

Turn it on for a process with the environment variable `ATTN_DEBUG_PATHS=1` (every layer call prints one
line on stderr) or in code:

    from attn_core.contract import debug_paths

    with debug_paths.recording() as calls:      # records instead of printing
        out = layer(q, k, v, batch)
    calls[0].path   # e.g. "gather + einsum over each request's key slots (self keys, float32)"

`enable()` / `disable()` install and remove a recording `forward` on `AttentionBackend` itself, so with the
switch off `forward` is the plain method: no flag is read per call. A record is made after the call
returns (a backend may choose its kernel inside `forward`) and names the backend, layer, mode, tokens and
the path the backend reports through `AttentionBackend.describe_path(layer, batch)`. The default of that
method reads a `path` string from the step's metadata (`forward_metadata.path`, or the `path` of each
plan in `forward_metadata.plans`): a backend whose plan objects carry one needs nothing else; torch_native
overrides it per layer. A backend that reports nothing shows "(path not reported)".
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, TextIO

#: the environment variable that turns the switch on at import ("1", "true", "yes" or "on")
ENV_VAR = "ATTN_DEBUG_PATHS"


@dataclass(frozen=True)
class PathRecord:
    """One layer call: `backend` name, `layer_id`, `mode` (a ForwardMode name), `num_tokens` of the
    batch and the `path` the backend reported."""

    backend: str
    layer_id: int
    mode: str
    num_tokens: int
    path: str

    def line(self) -> str:
        """`attn path: torch_native layer 0 DECODE (4 tokens): <path>`."""
        return f"attn path: {self.backend} layer {self.layer_id} {self.mode} ({self.num_tokens} tokens): {self.path}"


_original: Optional[Callable] = None
_sinks: list[Callable[[PathRecord], None]] = []
#: the class whose `forward` the switch wraps: `AttentionBackend`, handed over by `attach` when
#: `attn_core.contract.backend` loads (this module imports nothing of it, so the two form no import circle)
_target: Any = None  # the AttentionBackend class (not imported here: it imports this module)


def enabled() -> bool:
    """Whether layer calls are being reported."""
    return _original is not None


def _printer(stream: Optional[TextIO] = None) -> Callable[[PathRecord], None]:
    def emit(record: PathRecord) -> None:
        print(record.line(), file=stream or sys.stderr, flush=True)

    return emit


def attach(backend_class: type) -> None:
    """Called once by `attn_core.contract.backend` with `AttentionBackend`: the class the switch wraps. Turns the
    switch on at once when `ATTN_DEBUG_PATHS` asks for it, or when `enable` / `recording` ran before the
    class was loaded."""
    global _target
    _target = backend_class
    if os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on") and not _sinks:
        _sinks.append(_printer())
    if _sinks:
        _install()


def _install() -> None:
    global _original
    if _original is not None or _target is None:  # not loaded yet: `attach` installs it
        return
    _original = plain = _target.forward

    @functools.wraps(plain)
    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        out = plain(self, q, k, v, layer, forward_batch, save_kv_cache, **extras)
        path = self.describe_path(layer, forward_batch) or "(path not reported)"
        mode = forward_batch.forward_mode
        record = PathRecord(self.name or type(self).__name__, layer.layer_id, mode.name, forward_batch.num_tokens, path)
        for sink in list(_sinks):
            sink(record)
        return out

    _target.forward = forward


def _uninstall() -> None:
    global _original
    if _original is not None and not _sinks and _target is not None:
        _target.forward = _original
        _original = None


def enable(stream: Optional[TextIO] = None) -> Callable[[PathRecord], None]:
    """Report every layer call on `stream` (default stderr) from now on; returns the sink, for `disable`."""
    sink = _printer(stream)
    _sinks.append(sink)
    _install()
    return sink


def disable(sink: Optional[Callable[[PathRecord], None]] = None) -> None:
    """Stop one sink (`enable`'s return value), or every one; `forward` is the plain method again once
    none is left."""
    if sink is None:
        _sinks.clear()
    elif sink in _sinks:
        _sinks.remove(sink)
    _uninstall()


@contextlib.contextmanager
def recording() -> Iterator[list[PathRecord]]:
    """Collect the `PathRecord` of every layer call made inside the block into the yielded list."""
    calls: list[PathRecord] = []
    _sinks.append(calls.append)
    _install()
    try:
        yield calls
    finally:
        _sinks.remove(calls.append)
        _uninstall()


def metadata_path(metadata: object) -> Optional[str]:
    """The path string a step's metadata carries: its `path`, or the distinct `path`s of the plans in its
    `plans` mapping joined by "; ", or None. Example: an object with `path="decode: split-KV kernel"`
    gives that string; one with `plans={key_a: p1, key_b: p2}` whose plans say "ragged" and "paged"
    gives "ragged; paged"."""
    path = getattr(metadata, "path", None)
    if isinstance(path, str):
        return path
    plans = getattr(metadata, "plans", None)
    if isinstance(plans, dict):
        found = [p for p in (getattr(plan, "path", None) for plan in plans.values()) if isinstance(p, str)]
        if found:
            return "; ".join(dict.fromkeys(found))
    return None
