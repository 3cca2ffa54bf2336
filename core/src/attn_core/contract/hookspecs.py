"""Pluggy hooks (project name "attn_core"): low-frequency only, never on the per-step path.

A plugin module registers through the entry-point group "attn_core" and implements any of these with
`@attn_core.contract.hookspecs.hookimpl`. The module must be import-light (no torch).
"""

from __future__ import annotations

import pluggy

PROJECT = "attn_core"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def attn_core_register_backends() -> list:  # type: ignore[empty-body]  # a pluggy spec: plugins implement it
    """Return extra `BackendSpec` objects (for plugins that register in code rather than through the
    "attn_core.backends" entry-point group)."""


@hookspec(firstresult=True)
def attn_core_adjust_requirements(requirements):
    """Return a replacement `Requirements` for a backend request (e.g. force page_size on a platform),
    or None to leave it unchanged."""


@hookspec
def attn_core_backend_selected(name: str, requirements) -> None:
    """Observe that backend `name` was created for `requirements` (logging, metrics)."""
