"""The backend under test: resolved once from a registry name, a `BackendSpec` or a backend class."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from attn_core.contract.capabilities import Capabilities
from attn_core.contract.errors import BackendLoadError
from attn_core.contract.spec import BackendSpec
from attn_core.discovery.probes import TimedCheck, probe_timeout


@dataclass
class KitTarget:
    """What the kit needs of a backend: its class, declared capabilities, constructor options and,
    when it came through an entry point, the "module:attr" of its spec (for the import-light check)."""

    name: str
    backend_class: Optional[type]  # None: not loaded, the backend cannot run here (its probe says why)
    capabilities: Capabilities
    options: Mapping[str, Any] = field(default_factory=dict)
    spec: Optional[BackendSpec] = None
    spec_source: Optional[str] = None

    def factory(self, ctx):
        """A new backend object for `ctx`."""
        return self.backend_class(ctx, **self.options)

    def probe(self) -> Optional[str]:
        """Why the backend cannot run here, or None (run like the registry's probes: with a time
        limit, anything it raises contained)."""
        return TimedCheck(self.spec.probe).result(probe_timeout()) if self.spec is not None else None


def resolve_target(
    backend: Union[str, BackendSpec, type], options: Optional[Mapping[str, Any]] = None, registry=None
) -> KitTarget:
    """Resolve `backend` (a registry name, a spec or an `AttentionBackend` subclass). Raises the
    registry's typed errors (unknown, not installed, load failure, API mismatch, duplicate), except that a
    class that fails to load where the spec's probe says the backend cannot run here (its vendor library
    missing, say) resolves without a class: the plan is then unavailable with the probe's reason."""
    from attn_core.contract.backend import AttentionBackend

    options = dict(options or {})
    if isinstance(backend, str):
        if registry is None:
            from attn_core.discovery.registry import default_registry

            registry = default_registry()
        entry = registry.resolve(backend)
        cls = _load_unless_unavailable(lambda: registry.get_backend_class(entry.name), entry.spec)
        source = entry.source if ":" in entry.source else None
        return KitTarget(entry.name, cls, entry.spec.capabilities, options, entry.spec, source)
    if isinstance(backend, BackendSpec):
        cls = _load_unless_unavailable(backend.load, backend)
        if cls is not None and not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
            raise BackendLoadError(backend.name, backend.backend_class, TypeError("not an AttentionBackend subclass"))
        return KitTarget(backend.name, cls, backend.capabilities, options, backend, None)
    if isinstance(backend, type) and issubclass(backend, AttentionBackend):
        return KitTarget(backend.name or backend.__name__, backend, backend.capabilities, options)
    raise TypeError(f"expected a backend name, a BackendSpec or an AttentionBackend subclass, got {backend!r}")


def _load_unless_unavailable(load, spec: BackendSpec) -> Optional[type]:
    """`load()`, or None when it raises `BackendLoadError` while `spec`'s probe gives a reason."""
    try:
        return load()
    except BackendLoadError:
        if TimedCheck(spec.probe).result(probe_timeout()) is None:
            raise
        return None
