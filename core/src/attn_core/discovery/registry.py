"""Discovery and creation of attention backends by name.

Backends are found through the entry-point group "attn_core.backends" (each entry names a
`BackendSpec`) and the pluggy hook `attn_core_register_backends`. Discovery is cached per process,
deterministic (sorted by name), imports no torch, and one broken plugin never hides the others: it is
listed with its error. What counts as broken, and what each failure reads like, is in
docs/plugin-authors.md ("When a plugin is broken"): a spec with a field of the wrong type
(`InvalidSpecError`), a spec that fails to import (`BackendLoadError`), a hook plugin that fails to import
or raises in a hook (`HookPluginError`, listed as "hook:<plugin>"), an alias that would shadow another
backend (refused, noted on the entry), a probe that raises or exits ("probe failed: ...") or runs past
its time limit ("probe timed out after N s"; `probe_timeout` argument or `$ATTN_CORE_PROBE_TIMEOUT`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence, Union

import pluggy

from attn_core.contract import hookspecs
from attn_core.contract.capabilities import Requirements
from attn_core.contract.errors import (
    ApiVersionMismatchError,
    AttnError,
    BackendLoadError,
    BackendNotInstalledError,
    BackendUnavailableError,
    DuplicateBackendError,
    HookPluginError,
    IncompatibleBackendError,
    InvalidArgumentError,
    InvalidSpecError,
    NoBackendError,
    RegistryError,
    UnknownBackendError,
    install_hint,
)
from attn_core.contract.phases import DECODE, PREFILL, phases_of
from attn_core.contract.spec import API_VERSION, BackendSpec, spec_problems
from attn_core.discovery import probes
from attn_core.discovery.probes import TimedCheck
from attn_core.discovery.selection import PhaseChoice, Selection, choose, parse_hybrid_name

if TYPE_CHECKING:  # annotations only: the registry imports no torch
    from attn_core.contract.backend import AttentionBackend
    from attn_core.contract.context import BackendContext
    from attn_core.wrappers.hybrid import HybridAttnBackend

#: what `explain`, `select_backend` and `check` match backends against: a context, or its requirements
ContextOrRequirements = Union["BackendContext", Requirements]

ENTRY_POINT_GROUP = "attn_core.backends"
CORE_DISTRIBUTION = "attn-core"
#: Prefix of the entry that lists a failed pluggy hook plugin ("hook:<plugin name>").
HOOK_ENTRY_PREFIX = "hook:"

#: Backends we know of that live in separate distributions: name → pip distribution.
KNOWN_BACKENDS: dict[str, str] = {
    "triton": "attn-triton",
    "flashinfer": "attn-flashinfer",
    "trtllm_mla": "attn-trtllm-mla",
    "ascend": "attn-ascend",
    "aiter": "attn-aiter",
    "wave": "attn-wave",
    "cpu_amx": "attn-cpu-amx",
    "intel_amx": "attn-cpu-amx",
    "fa4": "attn-flashattention",
    "double_sparsity": "attn-sparse",
    "dual_chunk": "attn-sparse",
}
#: Where a clone of the attn repository holds each distribution (install hints: `errors.install_hint`).
SOURCE_FOLDERS: dict[str, str] = {
    "attn-core": "core",
    "attn-triton": "plugins/triton_backend",
    "attn-flashinfer": "plugins/flashinfer_backend",
    "attn-trtllm-mla": "plugins/trtllm_mla",
    "attn-ascend": "plugins/ascend",
    "attn-aiter": "plugins/aiter",
    "attn-wave": "plugins/wave",
    "attn-cpu-amx": "plugins/cpu_amx",
    "attn-flashattention": "plugins/flashattention",
    "attn-sparse": "plugins/sparse",
}


def not_installed_reason(distribution: str) -> str:
    """The one line `list` and `explain` show for a known backend whose distribution is missing:
    "not installed (pip install attn-triton (from a clone of the attn repository: pip install
    ./plugins/triton_backend))"."""
    return f"not installed ({install_hint(distribution, SOURCE_FOLDERS.get(distribution))})"


@dataclass
class BackendEntry:
    """One discovered backend: its spec, or the error that keeps it from being used. `notes` says what
    the registry refused of an otherwise usable spec (an alias that would shadow another backend)."""

    name: str
    distribution: str
    version: Optional[str]
    source: str
    spec: Optional[BackendSpec] = None
    error: Optional[AttnError] = None
    notes: tuple[str, ...] = ()
    probe_timeout: Optional[float] = field(default=None, repr=False)  # None: `probes.probe_timeout()`
    _checks: dict[str, TimedCheck] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def usable_spec(self) -> BackendSpec:
        """The spec of an entry without an error (`ok`); raises the entry's error otherwise."""
        if self.spec is None:
            raise self.error or RegistryError(f"backend {self.name!r} has no spec")
        return self.spec

    def _timed(self, label: str, check) -> TimedCheck:
        return self._checks.setdefault(label, TimedCheck(check, label))

    def start_probe(self) -> None:
        """Start the probe in its thread without waiting (`explain` starts every probe first, so a
        probe that hangs costs one time limit in all, not one per backend)."""
        if self.error is None:
            self._timed("probe", self.usable_spec.probe).start()

    def probe(self) -> Optional[str]:
        """Why the backend cannot run here, or None. The probe runs once, in a daemon thread, for at most
        the time limit; anything it raises (`SystemExit` included) becomes "probe failed: ..."."""
        if self.error is not None:
            return str(self.error)
        return self._timed("probe", self.usable_spec.probe).result(probes.probe_timeout(self.probe_timeout))

    def info(self) -> Optional[str]:
        """What the backend found on this machine (the spec's `info_fn`), run like `probe`."""
        if self.error is not None:
            return None
        return self._timed("info", self.usable_spec.info).result(probes.probe_timeout(self.probe_timeout))


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


def _contained(exc: BaseException) -> BaseException:
    """`exc` when a plugin's failure may be reported instead of raised; re-raises a user's Ctrl-C."""
    if isinstance(exc, KeyboardInterrupt):
        raise exc
    return exc


def _is_backend_name(name: str) -> bool:
    """Whether an entries key names a backend (not "name@distribution" or "hook:plugin")."""
    return "@" not in name and not name.startswith(HOOK_ENTRY_PREFIX)


class Registry:
    """Backends known to this process. Use the module-level functions; this class exists so tests can
    build isolated registries."""

    def __init__(self, use_entry_points: bool = True, probe_timeout: Optional[float] = None):
        """`probe_timeout`: seconds one probe may run (default `$ATTN_CORE_PROBE_TIMEOUT`, else 10)."""
        self._use_entry_points = use_entry_points
        self._probe_timeout = None if probe_timeout is None else probes.probe_timeout(probe_timeout)
        self._lock = threading.RLock()
        self._entries: Optional[dict[str, BackendEntry]] = None
        self._aliases: dict[str, str] = {}
        self._ambiguous: dict[str, DuplicateBackendError] = {}
        self._extra: list[tuple[BackendSpec, str]] = []
        self._pm: Optional[pluggy.PluginManager] = None
        self._plugin_dists: dict[str, tuple[str, Optional[str]]] = {}
        self._broken_plugins: dict[str, BackendEntry] = {}

    # ---- hook plugins --------------------------------------------------------------------------
    @property
    def plugin_manager(self) -> pluggy.PluginManager:
        with self._lock:
            if self._pm is None:
                pm = pluggy.PluginManager(hookspecs.PROJECT)
                pm.add_hookspecs(hookspecs)
                self._pm = pm
                if self._use_entry_points:
                    self._load_hook_plugins(pm)
            return self._pm

    def _load_hook_plugins(self, pm: pluggy.PluginManager) -> None:
        """Register every plugin of the "attn_core" entry-point group, one at a time: one that fails
        to import or to register is listed as failed and the others still load."""
        eps = sorted(metadata.entry_points(group=hookspecs.PROJECT), key=lambda e: (e.name, e.value))
        for ep in eps:
            if pm.has_plugin(ep.name) or pm.is_blocked(ep.name):
                continue
            self._plugin_dists[ep.name] = _dist_of(ep)
            try:
                pm.register(ep.load(), name=ep.name)
            except BaseException as exc:
                self._hook_failed(ep.name, f"loading {ep.value}", _contained(exc))

    def _hook_failed(self, plugin: str, where: str, exc: BaseException) -> None:
        """Stop calling `plugin`'s hooks and list it as a failed entry "hook:<plugin>"."""
        dist, version = self._plugin_dists.get(plugin, ("unknown", None))
        entry = BackendEntry(
            HOOK_ENTRY_PREFIX + plugin, dist, version, "pluggy hook plugin", error=HookPluginError(plugin, where, exc)
        )
        with self._lock:
            self._broken_plugins.setdefault(plugin, entry)
            if self._entries is not None:
                self._entries.setdefault(entry.name, entry)

    def _call_hook(self, hook_name: str, **kwargs) -> list[tuple[str, object]]:
        """Call every implementation of `hook_name` in pluggy's order, one at a time, and return their
        non-None results as (plugin name, result): an implementation that raises (or is a hook wrapper,
        which attn does not support) marks its plugin broken instead of failing the call or dropping the
        others."""
        results = []
        for impl in reversed(getattr(self.plugin_manager.hook, hook_name).get_hookimpls()):
            if impl.plugin_name in self._broken_plugins:
                continue
            if impl.hookwrapper or impl.wrapper:
                self._hook_failed(impl.plugin_name, hook_name, TypeError("hook wrappers are not supported"))
                continue
            try:
                result = impl.function(*[kwargs[arg] for arg in impl.argnames])
            except BaseException as exc:
                self._hook_failed(impl.plugin_name, hook_name, _contained(exc))
                continue
            if result is not None:
                results.append((impl.plugin_name, result))
        return results

    # ---- discovery -----------------------------------------------------------------------------

    def register(self, spec: BackendSpec, distribution: Optional[str] = None) -> None:
        """Add a backend in-process (tests, notebooks). Takes effect at the next lookup."""
        with self._lock:
            self._extra.append((spec, distribution or _dist_name(spec, "unknown")))
            self._entries = None

    def refresh(self) -> None:
        """Forget the cached discovery (after installing or removing plugins)."""
        with self._lock:
            self._entries = None
            self._pm = None
            self._plugin_dists = {}
            self._broken_plugins = {}

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
                entry = self._entry(ep.name, dist, version, ep.value)
                try:
                    spec = ep.load()
                except BaseException as exc:
                    entry.error = BackendLoadError(ep.name, ep.value, _contained(exc))
                else:
                    self._accept(entry, spec)
                found.append(entry)
        for spec, dist in self._extra:
            entry = self._entry(_spec_name(spec, "registered"), dist, _version_of(dist), "registered")
            self._accept(entry, spec)
            found.append(entry)
        for plugin, specs in self._call_hook("attn_core_register_backends"):
            if not isinstance(specs, (list, tuple)):
                self._hook_failed(
                    plugin, "attn_core_register_backends", TypeError(f"expected a list of BackendSpec, got {specs!r}")
                )
                continue
            for spec in specs:
                source = f"pluggy hook plugin {plugin}"
                entry = self._entry(
                    _spec_name(spec, source), _dist_name(spec, f"unknown (hook plugin {plugin})"), None, source
                )
                self._accept(entry, spec)
                found.append(entry)
        found += self._broken_plugins.values()
        return self._resolve_duplicates(found)

    def _entry(self, name: str, distribution: str, version: Optional[str], source: str) -> BackendEntry:
        return BackendEntry(name, distribution, version, source, probe_timeout=self._probe_timeout)

    @staticmethod
    def _accept(entry: BackendEntry, spec) -> None:
        """Attach `spec` to `entry`, or the error that makes the entry unusable."""
        problems = spec_problems(spec)
        if problems:
            entry.error = InvalidSpecError(entry.name, entry.source, problems)
            return
        if spec.name != entry.name:
            entry.error = BackendLoadError(
                entry.name, entry.source, ValueError(f"entry point name != spec name {spec.name!r}")
            )
        elif spec.api_major != API_VERSION.split(".", 1)[0]:
            entry.error = ApiVersionMismatchError(spec.name, spec.api_version, API_VERSION)
        entry.spec = spec

    def _resolve_duplicates(self, found: list[BackendEntry]) -> dict[str, BackendEntry]:
        by_name: dict[str, list[BackendEntry]] = {}
        for e in found:
            by_name.setdefault(e.name, []).append(e)
        entries: dict[str, BackendEntry] = {}
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
        self._aliases, self._ambiguous = _resolve_aliases(entries)
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
        if name in self._ambiguous:
            raise self._ambiguous[name]
        key = self._aliases.get(name, name)
        entry = entries.get(key)
        if entry is None:
            if name in KNOWN_BACKENDS:
                raise BackendNotInstalledError(name, KNOWN_BACKENDS[name], SOURCE_FOLDERS.get(KNOWN_BACKENDS[name]))
            raise UnknownBackendError(
                name, [n for n in entries if _is_backend_name(n)] + list(self._aliases) + list(KNOWN_BACKENDS)
            )
        if entry.error is not None:
            raise entry.error
        return entry

    def get_backend_class(self, name: str) -> type[AttentionBackend]:
        entry = self.resolve(name)
        cls = entry.usable_spec.load()
        from attn_core.contract.backend import AttentionBackend  # torch import only when a class is wanted

        if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
            raise BackendLoadError(name, entry.usable_spec.backend_class, TypeError("not an AttentionBackend subclass"))
        return cls

    def _requirements(self, request: ContextOrRequirements) -> Requirements:
        """`request` as `Requirements`, after the first `attn_core_adjust_requirements` hook that
        returns one (a hook that raises or returns something else is listed as failed and skipped)."""
        req = request if isinstance(request, Requirements) else request.requirements()
        for plugin, adjusted in self._call_hook("attn_core_adjust_requirements", requirements=req):
            if isinstance(adjusted, Requirements):
                return adjusted
            self._hook_failed(
                plugin, "attn_core_adjust_requirements", TypeError(f"expected Requirements or None, got {adjusted!r}")
            )
        return req

    def check(self, name: str, request: ContextOrRequirements) -> BackendEntry:
        """Raise unless backend `name` is installed, runs here and serves `request`."""
        entry = self.resolve(name)
        reason = entry.probe()
        if reason:
            raise BackendUnavailableError(entry.name, reason)
        reasons = entry.usable_spec.capabilities.mismatches(self._requirements(request))
        if reasons:
            raise IncompatibleBackendError(entry.name, reasons)
        return entry

    def create_backend(self, name: str, ctx: BackendContext, **options: Any) -> AttentionBackend:
        parts = parse_hybrid_name(name)
        if parts is not None:
            return self._create_hybrid(parts, ctx, options)
        entry = self.check(name, ctx)
        backend = self.get_backend_class(entry.name)(ctx, **options)
        self._call_hook("attn_core_backend_selected", name=entry.name, requirements=self._requirements(ctx))
        return backend

    def explain(self, request: ContextOrRequirements) -> list[BackendReport]:
        """Every discovered backend (and every known one not installed) with whether it can serve
        `request` (a `BackendContext` or `Requirements`) and why not."""
        req = self._requirements(request)
        rows: list[BackendReport] = []
        entries = self.entries()
        for e in entries.values():
            e.start_probe()
        for name, e in list(entries.items()):
            if not e.ok:
                rows.append(BackendReport(name, e.distribution, False, (str(e.error),)))
                continue
            reasons = []
            probe = e.probe()
            if probe:
                reasons.append(probe)
            reasons += e.usable_spec.capabilities.mismatches(req)
            rows.append(BackendReport(name, e.distribution, not reasons, tuple(reasons)))
        for name, dist in KNOWN_BACKENDS.items():
            if name not in entries and name not in self._aliases and name not in self._ambiguous:
                rows.append(BackendReport(name, dist, False, (not_installed_reason(dist),)))
        return rows

    def _create_hybrid(self, parts: tuple[str, str], ctx: BackendContext, options: dict[str, Any]) -> HybridAttnBackend:
        """`HybridAttnBackend(prefill=..., decode=...)` of a `hybrid(prefill=A,decode=B)` name: each part
        checked and created like a name of its own (no options: give each part's through a
        `HybridAttnBackend` built by hand)."""
        if options:
            want = "none for a composed backend (build HybridAttnBackend by hand to pass options)"
            raise InvalidArgumentError("options", want, sorted(options))
        prefill, decode = (self.create_backend(p, ctx) for p in parts)
        from attn_core.wrappers.hybrid import HybridAttnBackend  # torch import only when one is built

        return HybridAttnBackend(prefill=prefill, decode=decode)

    def explain_selection(self, request: ContextOrRequirements, prefer: Sequence[str] = ()) -> Selection:
        """The backend of each phase (prefill, decode) `request` needs, among the usable ones
        (`attn_core.discovery.selection.choose`: per phase the highest priority the specs declare for this device),
        or the first of `prefer` that is usable (a backend name, or a `hybrid(prefill=A,decode=B)` name
        whose parts both are). Raises `NoBackendError` with every reason when no backend is usable."""
        reports = {r.name: r for r in self.explain(request)}

        def usable(name: str) -> Optional[str]:
            key = self._aliases.get(name, name)
            return key if key in reports and reports[key].usable else None

        for name in prefer:
            parts = parse_hybrid_name(name)
            found = [usable(p) for p in parts] if parts is not None else [usable(name)]
            keys = [k for k in found if k is not None]
            if len(keys) == len(found):
                return _fixed_selection(self._requirements(request), keys)
        specs = [self.entries()[r.name].usable_spec for r in reports.values() if r.usable]
        if not specs:
            raise NoBackendError([(r.name, r.reasons) for r in reports.values()])
        return choose(specs, self._requirements(request))

    def select_backend(self, request: ContextOrRequirements, prefer: Sequence[str] = ()) -> str:
        """The name `create_backend` takes for `request`: the first of `prefer` that is usable, else the
        usable backend of highest priority, or `hybrid(prefill=A,decode=B)` when the fastest prefill and
        decode backends differ (`explain_selection`). Raises `NoBackendError` with every reason when none is."""
        return self.explain_selection(request, prefer).name

    def list_backends(self) -> list[BackendEntry]:
        return list(self.entries().values())

    def aliases(self) -> dict[str, str]:
        """Every alias in force: alias → backend name (refused aliases are in the entries' `notes`)."""
        self.entries()
        return dict(self._aliases)


def _fixed_selection(req: Requirements, keys: list[str]) -> Selection:
    """The selection of a preferred name: its one backend for every phase, or a preferred hybrid's parts."""
    phases = phases_of(req.forward_modes) or (DECODE,)
    by_phase = {PREFILL: keys[0], DECODE: keys[-1]}
    if len(keys) > 1 and len(phases) < 2:
        phases = (PREFILL, DECODE)  # a preferred hybrid stays one
    return Selection(tuple(PhaseChoice(p, by_phase[p], None) for p in phases))


def _failed(entry: BackendEntry, error: AttnError) -> BackendEntry:
    entry.error = error
    return entry


def _resolve_aliases(entries: dict[str, BackendEntry]) -> tuple[dict[str, str], dict[str, DuplicateBackendError]]:
    """Aliases in force (alias → name) and aliases claimed by several backends. An alias is refused,
    with a note on its entry, when it is the name of a discovered backend (the name always wins, so no
    plugin can take over `torch_native`) or of a known backend of another distribution."""
    claims: dict[str, list[BackendEntry]] = {}
    for name, e in entries.items():
        if not (e.ok and _is_backend_name(name)):
            continue
        for alias in e.usable_spec.aliases:
            if alias == name:
                continue
            if alias in entries:
                e.notes += (f"alias {alias!r} refused: it is the name of a discovered backend",)
            elif alias in KNOWN_BACKENDS and _canon(KNOWN_BACKENDS[alias]) != _canon(e.distribution):
                e.notes += (f"alias {alias!r} refused: it is reserved for {KNOWN_BACKENDS[alias]}",)
            else:
                claims.setdefault(alias, []).append(e)
    aliases: dict[str, str] = {}
    ambiguous: dict[str, DuplicateBackendError] = {}
    for alias, owners in sorted(claims.items()):
        if len(owners) == 1:
            aliases[alias] = owners[0].name
            continue
        ambiguous[alias] = DuplicateBackendError(alias, [f"{e.distribution} (alias of {e.name})" for e in owners])
        for e in owners:
            e.notes += (f"alias {alias!r} refused: also claimed by {', '.join(o.name for o in owners if o is not e)}",)
    return aliases, ambiguous


def _spec_name(spec: object, source: str) -> str:
    """The entries key of a spec found by a hook or `register`: its name when that is a string, else
    a placeholder naming where it came from (the spec is then listed as invalid)."""
    name = getattr(spec, "name", None)
    return name if isinstance(name, str) and _is_backend_name(name) and name else f"?{source}"


def _dist_name(spec: object, fallback: str) -> str:
    """The spec's distribution when it is a string (an invalid spec may have anything), else `fallback`."""
    dist = getattr(spec, "distribution", None)
    return dist if isinstance(dist, str) else fallback


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


def get_backend_class(name: str) -> type[AttentionBackend]:
    """The backend class for `name` (imports the plugin's kernels)."""
    return _default.get_backend_class(name)


def create_backend(name: str, ctx: BackendContext, **options: Any) -> AttentionBackend:
    """Create backend `name` (or `hybrid(prefill=A,decode=B)`) for `ctx`, passing `options` to the backend
    class; raises a typed error saying exactly why it cannot (`UnknownBackendError`,
    `BackendUnavailableError`, `IncompatibleBackendError`, ...). Example:
    `create_backend("torch_native", BackendContext(device="cpu", dtype=torch.float32, num_q_heads=8,
    num_kv_heads=2, head_dim=64))` is a `TorchNativeBackend`."""
    return _default.create_backend(name, ctx, **options)


def select_backend(request: ContextOrRequirements, prefer: Iterable[str] = ()) -> str:
    """Name of the best backend for `request` (a `BackendContext` or `Requirements`): one backend, or
    `hybrid(prefill=A,decode=B)` where the fastest prefill and decode backends differ."""
    return _default.select_backend(request, tuple(prefer))


def explain_selection(request: ContextOrRequirements, prefer: Iterable[str] = ()) -> Selection:
    """Which backend each phase of `request` goes to, and why (`Selection.describe()`)."""
    return _default.explain_selection(request, tuple(prefer))


def explain(request: ContextOrRequirements) -> list[BackendReport]:
    """For each backend, usable or every reason it is not."""
    return _default.explain(request)


def register_backend(spec: BackendSpec) -> None:
    """Register a spec in-process (no packaging needed)."""
    _default.register(spec)


def refresh() -> None:
    _default.refresh()
