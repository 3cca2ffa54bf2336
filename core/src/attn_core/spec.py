"""`BackendSpec`: the import-light object a plugin's entry point names.

A plugin's `pyproject.toml` declares

    [project.entry-points."attn_core.backends"]
    mybackend = "attn_mybackend.spec:SPEC"

and `attn_mybackend/spec.py` builds a `BackendSpec` without importing torch or any kernel library.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Optional

from attn_core.capabilities import Capabilities
from attn_core.errors import BackendLoadError

#: Version of the backend API (the contract in `attn_core.backend`). Plugins must match the major.
API_VERSION = "1.0"


@dataclass(frozen=True)
class BackendSpec:
    """Name, capabilities and where to find the class, readable without importing the backend.

    `backend_class` is "module:Class"; `probe` returns None when the backend can run on this machine,
    else the reason ("needs CUDA", "triton not installed (pip install attn-triton)"); it may import
    torch but should be quick. `info_fn` (optional, same rules) describes what an available backend
    found here, e.g. the CPU ISA and kernel path; `attn-core list` shows it next to "available".
    `priority` orders `select_backend`'s default choice (higher first). `unverified` (optional) says
    what of the backend has never run on hardware (e.g. a kernel path for a GPU nobody could test on);
    `attn-core list` shows it whatever the probe says.
    """

    name: str
    summary: str
    capabilities: Capabilities
    distribution: str
    backend_class: str
    api_version: str = API_VERSION
    aliases: tuple[str, ...] = ()
    priority: int = 0
    probe_fn: Optional[Callable[[], Optional[str]]] = field(default=None, compare=False)
    info_fn: Optional[Callable[[], Optional[str]]] = field(default=None, compare=False)
    unverified: Optional[str] = None

    def load(self) -> type:
        """Import and return the backend class."""
        module_name, _, attr = self.backend_class.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except Exception as exc:  # any import failure of a plugin is reported, never propagated raw
            raise BackendLoadError(self.name, self.backend_class, exc) from exc

    def probe(self) -> Optional[str]:
        return self.probe_fn() if self.probe_fn is not None else None

    def info(self) -> Optional[str]:
        """What the backend found on this machine (None when it says nothing)."""
        return self.info_fn() if self.info_fn is not None else None

    @property
    def api_major(self) -> str:
        return self.api_version.split(".", 1)[0]
