"""Discovery and creation of attention backends by name.

Backends are found through the entry-point group "attn_core.backends" (each entry names a
`BackendSpec`) and the pluggy hook `attn_core_register_backends`. Discovery is cached per process,
deterministic (sorted by name), imports no torch, and one broken plugin never hides the others: it is
listed with its error.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from importlib import metadata
from typing import Iterable, Optional, Sequence

import pluggy

from attn_core import hookspecs
from attn_core.capabilities import Requirements
from attn_core.errors import (
    ApiVersionMismatchError,
    AttnError,
    BackendLoadError,
    BackendNotInstalledError,
    BackendUnavailableError,
    DuplicateBackendError,
    IncompatibleBackendError,
    NoBackendError,
    UnknownBackendError,
)
from attn_core.spec import API_VERSION, BackendSpec

ENTRY_POINT_GROUP = "attn_core.backends"
CORE_DISTRIBUTION = "attn-core"

#: Backends we know of that live in separate distributions: name → pip distribution.
KNOWN_BACKENDS: dict[str, str] = {
    "triton": "attn-triton",
    "flashinfer": "attn-flashinfer",
    "trtllm_mla": "attn-trtllm-mla",
    "ascend": "attn-ascend",
    "cpu_amx": "attn-cpu-amx",
    "intel_amx": "attn-cpu-amx",
}


@dataclass
class BackendEntry:
    """One discovered backend: its spec, or the error that keeps it from being used."""

    name: str
    distribution: str
    version: Optional[str]
    source: str
    spec: Optional[BackendSpec] = None
    error: Optional[AttnError] = None
    _probe: Optional[tuple[Optional[str]]] = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    def probe(self) -> Optional[str]:
        """Why the backend cannot run here (cached), or None."""
        if self.error is not None:
            return str(self.error)
        if self._probe is None:
            try:
                self._probe = (self.spec.probe(),)
            except Exception as exc:  # a faulty probe must not break listing
                self._probe = (f"probe failed: {type(exc).__name__}: {exc}",)
        return self._probe[0]


@dataclass(frozen=True)
class BackendReport:
    """One row of `explain`: whether a backend can serve a request, and every reason if not."""

    name: str
    distribution: str
    usable: bool
    reasons: tuple[str, ...]


def _dist_of(ep) -> tuple[str, Optional[str]]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "unknown", None
    return dist.metadata["Name"] or "unknown", dist.version


def _canon(dist: str) -> str:
    return dist.lower().replace("_", "-")


class Registry:
    """Backends known to this process. Use the module-level functions; this class exists so tests can
    build isolated registries."""

    def __init__(self, use_entry_points: bool = True):
        self._use_entry_points = use_entry_points
        self._lock = threading.Lock()
        self._entries: Optional[dict[str, BackendEntry]] = None
        self._aliases: dict[str, str] = {}
        self._extra: list[tuple[BackendSpec, str]] = []
        self._pm: Optional[pluggy.PluginManager] = None

    # ---- discovery -----------------------------------------------------------------------------
    @property
    def plugin_manager(self) -> pluggy.PluginManager:
        if self._pm is None:
            pm = pluggy.PluginManager(hookspecs.PROJECT)
            pm.add_hookspecs(hookspecs)
            if self._use_entry_points:
                try:
                    pm.load_setuptools_entrypoints(hookspecs.PROJECT)
                except Exception:  # a broken hook plugin must not break backend discovery
                    pass
            self._pm = pm
        return self._pm

    def register(self, spec: BackendSpec, distribution: Optional[str] = None) -> None:
        """Add a backend in-process (tests, notebooks). Takes effect at the next lookup."""
        with self._lock:
            self._extra.append((spec, distribution or spec.distribution))
            self._entries = None

    def refresh(self) -> None:
        """Forget the cached discovery (after installing or removing plugins)."""
        with self._lock:
            self._entries = None
            self._pm = None

    def _discover(self) -> dict[str, BackendEntry]:
        found: list[BackendEntry] = []
        if self._use_entry_points:
            eps = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name, e.value))
            seen_values: set[tuple[str, str]] = set()
            for ep in eps:
                if (ep.name, ep.value) in seen_values:  # same distribution visible twice on sys.path
                    continue
                seen_values.add((ep.name, ep.value))
                dist, version = _dist_of(ep)
                entry = BackendEntry(ep.name, dist, version, ep.value)
                try:
                    spec = ep.load()
                except Exception as exc:
                    entry.error = BackendLoadError(ep.name, ep.value, exc)
                else:
                    self._accept(entry, spec)
                found.append(entry)
        for spec, dist in self._extra:
            entry = BackendEntry(spec.name, dist, _version_of(dist), "registered")
            self._accept(entry, spec)
            found.append(entry)
        try:
            hooked = self.plugin_manager.hook.attn_core_register_backends()
        except Exception:
            hooked = []
        for specs in hooked:
            for spec in specs or []:
                entry = BackendEntry(getattr(spec, "name", "?"), getattr(spec, "distribution", "?"), None, "pluggy hook")
                self._accept(entry, spec)
                found.append(entry)
        return self._resolve_duplicates(found)

    @staticmethod
    def _accept(entry: BackendEntry, spec) -> None:
        if not isinstance(spec, BackendSpec):
            entry.error = BackendLoadError(entry.name, entry.source, TypeError(f"expected a BackendSpec, got {type(spec).__name__}"))
        elif spec.name != entry.name and entry.source != "pluggy hook" and entry.source != "registered":
            entry.error = BackendLoadError(entry.name, entry.source, ValueError(f"entry point name != spec name {spec.name!r}"))
        elif spec.api_major != API_VERSION.split(".", 1)[0]:
            entry.error = ApiVersionMismatchError(spec.name, spec.api_version, API_VERSION)
        entry.spec = spec if isinstance(spec, BackendSpec) else None

    def _resolve_duplicates(self, found: list[BackendEntry]) -> dict[str, BackendEntry]:
        by_name: dict[str, list[BackendEntry]] = {}
        for e in found:
            by_name.setdefault(e.name, []).append(e)
        entries: dict[str, BackendEntry] = {}
        aliases: dict[str, str] = {}
        for name in sorted(by_name):
            claim = by_name[name]
            if len(claim) > 1:
                # The embedded backends keep their names; otherwise every claimant is refused.
                core = [e for e in claim if _canon(e.distribution) == CORE_DISTRIBUTION][:1]
                error = DuplicateBackendError(name, [f"{e.distribution} ({e.source})" for e in claim])
                claim = core + [_failed(e, error) for e in claim if not any(e is c for c in core)]
            entries[name] = claim[0]
            for e in claim[1:]:
                entries[f"{name}@{e.distribution}"] = e
        for name, e in entries.items():
            if e.ok and e.spec is not None:
                for alias in e.spec.aliases:
                    aliases.setdefault(alias, name)
        self._aliases = aliases
        return entries

    def entries(self) -> dict[str, BackendEntry]:
        with self._lock:
            if self._entries is None:
                self._entries = self._discover()
            return self._entries

    # ---- lookup --------------------------------------------------------------------------------
    def resolve(self, name: str) -> BackendEntry:
        """The entry for `name` (or an alias). Raises the entry's own error, or not-installed /
        unknown errors."""
        entries = self.entries()
        key = self._aliases.get(name, name)
        entry = entries.get(key)
        if entry is None:
            if name in KNOWN_BACKENDS:
                raise BackendNotInstalledError(name, KNOWN_BACKENDS[name])
            raise UnknownBackendError(name, [n for n in entries if "@" not in n] + list(self._aliases) + list(KNOWN_BACKENDS))
        if entry.error is not None:
            raise entry.error
        return entry

    def get_backend_class(self, name: str) -> type:
        entry = self.resolve(name)
        cls = entry.spec.load()
        from attn_core.backend import AttentionBackend  # torch import only when a class is wanted

        if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
            raise BackendLoadError(name, entry.spec.backend_class, TypeError("not an AttentionBackend subclass"))
        return cls

    def _requirements(self, request) -> Requirements:
        req = request if isinstance(request, Requirements) else request.requirements()
        adjusted = self.plugin_manager.hook.attn_core_adjust_requirements(requirements=req)
        return adjusted if adjusted is not None else req

    def check(self, name: str, request) -> BackendEntry:
        """Raise unless backend `name` is installed, runs here and serves `request`."""
        entry = self.resolve(name)
        reason = entry.probe()
        if reason:
            raise BackendUnavailableError(entry.name, reason)
        reasons = entry.spec.capabilities.mismatches(self._requirements(request))
        if reasons:
            raise IncompatibleBackendError(entry.name, reasons)
        return entry

    def create_backend(self, name: str, ctx, **options):
        entry = self.check(name, ctx)
        backend = self.get_backend_class(entry.name)(ctx, **options)
        self.plugin_manager.hook.attn_core_backend_selected(name=entry.name, requirements=self._requirements(ctx))
        return backend

    def explain(self, request) -> list[BackendReport]:
        """Every discovered backend (and every known one not installed) with whether it can serve
        `request` (a `BackendContext` or `Requirements`) and why not."""
        req = self._requirements(request)
        rows: list[BackendReport] = []
        entries = self.entries()
        for name, e in entries.items():
            if not e.ok:
                rows.append(BackendReport(name, e.distribution, False, (str(e.error),)))
                continue
            reasons = []
            probe = e.probe()
            if probe:
                reasons.append(probe)
            reasons += e.spec.capabilities.mismatches(req)
            rows.append(BackendReport(name, e.distribution, not reasons, tuple(reasons)))
        for name, dist in KNOWN_BACKENDS.items():
            if name not in entries and name not in self._aliases:
                rows.append(BackendReport(name, dist, False, (f"not installed (pip install {dist})",)))
        return rows

    def select_backend(self, request, prefer: Sequence[str] = ()) -> str:
        """The name of the best usable backend: the first of `prefer` that is usable, else the usable
        one of highest priority. Raises `NoBackendError` with every reason when none is."""
        reports = {r.name: r for r in self.explain(request)}
        for name in prefer:
            key = self._aliases.get(name, name)
            if key in reports and reports[key].usable:
                return key
        usable = [self.entries()[r.name] for r in reports.values() if r.usable]
        if not usable:
            raise NoBackendError([(r.name, r.reasons) for r in reports.values()])
        best = sorted(usable, key=lambda e: (-e.spec.priority, e.name))[0]
        return best.name

    def list_backends(self) -> list[BackendEntry]:
        return list(self.entries().values())


def _failed(entry: BackendEntry, error: AttnError) -> BackendEntry:
    entry.error = error
    return entry


def _version_of(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


_default = Registry()


def default_registry() -> Registry:
    return _default


def list_backends() -> list[BackendEntry]:
    """Every discovered backend entry (usable or failed), sorted by name."""
    return _default.list_backends()


def get_backend_class(name: str) -> type:
    """The backend class for `name` (imports the plugin's kernels)."""
    return _default.get_backend_class(name)


def create_backend(name: str, ctx, **options):
    """Create backend `name` for `ctx`; raises a typed error saying exactly why it cannot."""
    return _default.create_backend(name, ctx, **options)


def select_backend(request, prefer: Iterable[str] = ()) -> str:
    """Name of the best backend for `request` (a `BackendContext` or `Requirements`)."""
    return _default.select_backend(request, tuple(prefer))


def explain(request) -> list[BackendReport]:
    """For each backend, usable or every reason it is not."""
    return _default.explain(request)


def register_backend(spec: BackendSpec) -> None:
    """Register a spec in-process (no packaging needed)."""
    _default.register(spec)


def refresh() -> None:
    _default.refresh()
