"""Typed errors. Everything attn raises on purpose derives from `AttnError`.

Kept free of torch so the registry can raise them during discovery.
"""

from __future__ import annotations

import difflib
from typing import Iterable, Optional, Sequence

#: at most this many characters of a user-supplied value are quoted in a message (`quote`)
QUOTE_LIMIT = 80


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """`repr(value)` for a message, cut to `limit` characters of the value with how long it was, so that
    a 100,000-character name is not echoed back: `quote("abc") == "'abc'"`,
    `quote("x" * 100) == "'" + "x" * 80 + "…' (100 characters)"`."""
    if isinstance(value, str) and len(value) > limit:
        head = repr(value[:limit])
        return f"{head[:-1]}…{head[-1]} ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= limit + 2 else text[: limit + 1] + f"… ({len(text)} characters)"


class AttnError(Exception):
    """Base class of every error attn raises on purpose."""


class InvalidArgumentError(AttnError, ValueError):
    """An argument has the wrong shape, dtype, device or value.

    The message names the argument, what was expected and what was found.
    """

    def __init__(self, argument: str, expected: str, found: object):
        self.argument = argument
        self.expected = expected
        self.found = found
        super().__init__(f"{argument}: expected {expected}, found {found}")


class UnsupportedFeatureError(AttnError, NotImplementedError):
    """A backend was asked for something its `Capabilities` do not declare."""

    def __init__(self, backend: str, what: str):
        self.backend = backend
        self.what = what
        super().__init__(f"backend {backend!r} does not support {what}")


class KVCacheError(AttnError, ValueError):
    """Misuse of a KV-cache pool or allocator (double free, reserved or out-of-range slot)."""


class InvalidBatchError(InvalidArgumentError):
    """A `ForwardBatch` field is missing, of the wrong dtype, shape or device, out of range, or
    inconsistent with another field (host copy vs device tensor, lengths vs sums). Raised by
    `attn_core.contract.validation` before any kernel runs and before any KV write; `argument` names the field
    (e.g. "forward_batch.seq_lens_cpu")."""


class StaleMetadataError(InvalidArgumentError):
    """`forward` was called with a batch other than the one the backend's current metadata was built for
    (`init_forward_metadata` not called for this step, or called for another batch since, e.g. by another
    thread sharing the backend). Checked by identity, so it costs no device work and is graph-safe. The
    ragged op raises it too (argument "ragged"), for a `RaggedBatch` other than that of `init_ragged_metadata`."""

    def __init__(self, expected: str, found: object, argument: str = "forward_batch"):
        super().__init__(argument, expected, found)


class RegistryError(AttnError):
    """Base class of the registry's errors."""


class UnknownBackendError(RegistryError, KeyError):
    """No backend of that name is installed or known."""

    def __init__(self, name: str, known: Iterable[str]):
        self.name = name
        self.known = sorted(set(known))
        close = difflib.get_close_matches(name, self.known, n=1) if len(name) <= QUOTE_LIMIT else []
        self.suggestion = close[0] if close else None
        hint = f"; did you mean {self.suggestion!r}?" if self.suggestion else ""
        super().__init__(f"unknown attention backend {quote(name)} (known: {', '.join(self.known)}){hint}")

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


def install_hint(distribution: str, source: Optional[str] = None) -> str:
    """How to install `distribution`: the package name, and where the attn repository holds it (`source`,
    a folder of the repository) the command that installs it from a clone:
    `install_hint("attn-triton", "plugins/triton_backend")` → "pip install attn-triton (from a clone of the
    attn repository: pip install ./plugins/triton_backend)"."""
    hint = f"pip install {distribution}"
    return f"{hint} (from a clone of the attn repository: pip install ./{source})" if source else hint


class BackendNotInstalledError(RegistryError):
    """A known backend whose distribution is not installed. `pip_command` names the package;
    `source_command` installs it from a clone of the attn repository (None where the repository does not
    hold it)."""

    def __init__(self, name: str, distribution: str, source: Optional[str] = None):
        self.name = name
        self.distribution = distribution
        self.pip_command = f"pip install {distribution}"
        self.source_command = f"pip install ./{source}" if source else None
        super().__init__(f"attention backend {name!r} is not installed: {install_hint(distribution, source)}")


class BackendUnavailableError(RegistryError):
    """The backend is installed but cannot run on this machine."""

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason
        super().__init__(f"attention backend {name!r} cannot run here: {reason}")


class IncompatibleBackendError(RegistryError):
    """The backend runs here but cannot serve the request; lists every failing capability."""

    def __init__(self, name: str, reasons: Sequence[str]):
        self.name = name
        self.reasons = list(reasons)
        super().__init__(f"attention backend {name!r} cannot serve this request: " + "; ".join(self.reasons))


class NoBackendError(RegistryError):
    """`select_backend` found no backend that can serve the request."""

    def __init__(self, report: Sequence[tuple[str, Sequence[str]]]):
        self.report = [(name, list(reasons)) for name, reasons in report]
        lines = [f"  {name}: {'; '.join(reasons)}" for name, reasons in self.report]
        super().__init__("no attention backend can serve this request:\n" + "\n".join(lines))


class ApiVersionMismatchError(RegistryError):
    """A plugin was written for another major version of the backend API."""

    def __init__(self, name: str, plugin_version: str, core_version: str):
        self.name = name
        self.plugin_version = plugin_version
        self.core_version = core_version
        super().__init__(
            f"attention backend {name!r} targets backend API {plugin_version}, "
            f"attn-core provides {core_version} (major versions must match)"
        )


class DuplicateBackendError(RegistryError):
    """Two installed distributions claim the same backend name."""

    def __init__(self, name: str, claimants: Sequence[str]):
        self.name = name
        self.claimants = list(claimants)
        super().__init__(f"attention backend name {name!r} is claimed by several distributions: {', '.join(claimants)}")


class BackendLoadError(RegistryError):
    """A plugin's spec or class failed to import."""

    def __init__(self, name: str, where: str, cause: BaseException):
        self.name = name
        self.where = where
        self.cause = cause
        super().__init__(f"attention backend {name!r} failed to load from {where}: {type(cause).__name__}: {cause}")


class InvalidSpecError(RegistryError):
    """A plugin's `BackendSpec` has fields of the wrong type or form; every problem is listed."""

    def __init__(self, name: str, where: str, problems: Sequence[str]):
        self.name = name
        self.where = where
        self.problems = list(problems)
        super().__init__(f"attention backend {name!r} from {where} has an invalid spec: " + "; ".join(self.problems))


class HookPluginError(RegistryError):
    """A pluggy hook plugin (entry-point group "attn_core") failed to load or raised in a hook. The
    registry stops calling its hooks and lists it as failed under the name "hook:<plugin>"."""

    def __init__(self, plugin: str, where: str, cause: BaseException):
        self.plugin = plugin
        self.where = where
        self.cause = cause
        super().__init__(
            f"attn_core hook plugin {plugin!r} failed in {where}: {type(cause).__name__}: {cause} "
            "(its hooks are no longer called)"
        )


class DeviceIndexError(AttnError, IndexError):
    """A kernel found an index out of range on the device (a request row past the req_to_token table,
    a slot outside the KV pool, device lengths needing more key ids than a host-sized buffer holds...).

    The kernels never followed it (they mask such loads and stores) but the step's output is not to be
    trusted. Raised from a backend's `poll_device_fault()` report (checked by `validation="full"`); the
    message names the kind of index that was bad and the buffer it was checked against.
    """


class DeviceFaultError(DeviceIndexError):
    """Device-side checks of an earlier step found bad input (issue 36's "safe by default" path: no host
    sync). On a GPU the default validation cannot read the batch's device tensors without a sync, so the
    per-step kernels check them where they read them (request rows, lengths against the host totals,
    offsets, every new token's slot against the pool and `req_to_token`), drop the K/V writes they refuse
    (a refused token writes the reserved dummy slot 0, never another slot) and record the fault in the
    backend's fault word, which is copied to pinned host memory without a sync. The next
    `init_forward_metadata` (or `AttentionBackend.raise_device_faults()`) raises this error.

    Attributes: `step` (the backend's step counter of the step whose kernels recorded it, `None` when not
    known), `argument` (the field, e.g. "forward_batch.out_cache_loc"), `request` (the first offending
    request's index in its batch, None when the check could not tell), `kinds` (every fault kind
    recorded, as `attn_core.ops.device_faults.DeviceFaultKind` names) and `description`.
    """

    def __init__(self, step, argument: str, request, kinds: Sequence[str], description: str):
        self.step = step
        self.argument = argument
        self.request = request
        self.kinds = list(kinds)
        self.description = description
        when = "an earlier step" if step is None else f"step {step}"
        who = "" if request is None else f" (first offending request: {request})"
        super().__init__(f"{argument}: device checks of {when} refused it{who}: {description}")


class StaleRequestError(InvalidBatchError):
    """A batch built by `build_step` from a `Request` handle that was freed, truncated or forked past
    since (its K/V would land in slots the allocator already handed back, or overwrite tokens another
    request now reads). `argument` names the batch's request (e.g. "forward_batch.requests[1]")."""


class GraphShapeError(InvalidArgumentError):
    """A CUDA-graph replay whose shape differs from what was captured (batch size bucket, tokens per
    request, draft count, mode): replaying it would read or write past the captured buffers, so it is
    refused before any replay. `argument` names the mismatching input."""
