"""`BackendSpec`: the import-light object a plugin's entry point names.

A plugin's `pyproject.toml` declares

    [project.entry-points."attn_core.backends"]
    mybackend = "attn_mybackend.spec:SPEC"

and `attn_mybackend/spec.py` builds a `BackendSpec` without importing torch or any kernel library.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

from attn_core.contract.capabilities import Capabilities, CudaGraphLevel, Feature
from attn_core.contract.errors import BackendLoadError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.phases import PhasePriority, phase_priority_problems

#: Version of the backend API (the contract in `attn_core.contract.backend`). Plugins must match the major.
API_VERSION = "1.0"


@dataclass(frozen=True)
class BackendSpec:
    """Name, capabilities and where to find the class, readable without importing the backend.

    `backend_class` is "module:Class"; `probe` returns None when the backend can run on this machine,
    else the reason ("needs CUDA", "triton not installed (pip install triton)"); it may import
    torch but should be quick. `info_fn` (optional, same rules) describes what an available backend
    found here, e.g. the CPU ISA and kernel path; `attn-core list` shows it next to "available".
    `priority` orders `select_backend`'s default choice (higher first); `phase_priorities` replace it for
    one phase (prefill or decode) on the devices where a measurement says so (`attn_core.discovery.selection`:
    each entry names its evidence). `unverified` (optional) says
    what of the backend has never run on hardware (e.g. a kernel path for a GPU nobody could test on);
    `attn-core list` shows it whatever the probe says. `known_gaps` ((kit check-id glob, why) pairs) names
    where the backend's vendor kernels are known, from a GPU run, to break a rule of the contract that the
    plugin cannot repair around them (e.g. `("masked_nonfinite-*", "...")`): the conformance kit and
    `attn-core check` list those checks as skipped with the reason, `attn-core list` shows them, and
    docs/engine-authors.md lists every declared gap.
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
    phase_priorities: tuple[PhasePriority, ...] = ()
    known_gaps: tuple[tuple[str, str], ...] = ()

    def load(self) -> type:
        """Import and return the backend class."""
        module_name, _, attr = self.backend_class.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # any import failure of a plugin (sys.exit too) is reported, never propagated raw
            raise BackendLoadError(self.name, self.backend_class, exc) from exc

    def probe(self) -> Optional[str]:
        return self.probe_fn() if self.probe_fn is not None else None

    def info(self) -> Optional[str]:
        """What the backend found on this machine (None when it says nothing)."""
        return self.info_fn() if self.info_fn is not None else None

    @property
    def api_major(self) -> str:
        return self.api_version.split(".", 1)[0]


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
_VERSION = re.compile(r"[0-9]+(\.[0-9]+)*")
_SETS = (set, frozenset)


def _name_problem(field_name: str, value: object) -> Optional[str]:
    if isinstance(value, str) and _NAME.fullmatch(value):
        return None
    return f"{field_name}: expected a name of letters, digits, '_', '.' or '-', found {value!r}"


def _set_problem(field_name: str, value: object, kind: type, optional: bool = False) -> Optional[str]:
    if optional and value is None:
        return None
    if isinstance(value, _SETS) and all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        return None
    what = f"a frozenset of {kind.__name__}" + (" or None" if optional else "")
    return f"{field_name}: expected {what}, found {value!r}"


def _cc_problem(field_name: str, value: object) -> Optional[str]:
    if value is None or (isinstance(value, tuple) and len(value) == 2 and all(type(v) is int for v in value)):
        return None
    return f"{field_name}: expected None or a (major, minor) tuple of int, found {value!r}"


def capabilities_problems(caps: object, field_name: str = "capabilities") -> list[str]:
    """Every field of `caps` whose type the registry cannot work with (empty when all are sound).

    Example: `capabilities_problems(Capabilities(devices=None, q_dtypes=frozenset({"float32"}),
    kv_dtypes=frozenset({"float32"})))` is `["capabilities.devices: expected a frozenset of str, found None"]`.
    """
    if not isinstance(caps, Capabilities):
        return [f"{field_name}: expected a Capabilities, found {caps!r}"]
    checks = [
        _set_problem("devices", caps.devices, str),
        _set_problem("q_dtypes", caps.q_dtypes, str),
        _set_problem("kv_dtypes", caps.kv_dtypes, str),
        _set_problem("archs", caps.archs, str),
        _set_problem("head_dims", caps.head_dims, int, optional=True),
        _set_problem("page_sizes", caps.page_sizes, int, optional=True),
        _set_problem("mla_head_dims", caps.mla_head_dims, int, optional=True),
        _set_problem("forward_modes", caps.forward_modes, ForwardMode),
        _set_problem("features", caps.features, Feature),
        None
        if isinstance(caps.cuda_graph, CudaGraphLevel)
        else f"cuda_graph: expected a CudaGraphLevel, found {caps.cuda_graph!r}",
        _cc_problem("min_compute_capability", caps.min_compute_capability),
        _cc_problem("max_compute_capability", caps.max_compute_capability),
        _set_problem("cpu_isa", caps.cpu_isa, str),
        _set_problem("ragged_head_dims", caps.ragged_head_dims, int, optional=True),
    ]
    return [f"{field_name}.{problem}" for problem in checks if problem]


def spec_problems(spec: object) -> list[str]:
    """Every field of `spec` whose type or form the registry cannot work with (empty when the spec is
    sound). The registry calls this for every spec it discovers and lists a spec with problems as
    failed (`InvalidSpecError`) instead of letting it break the listing of the others.

    Example: a `BackendSpec(..., api_version=None, aliases=None)` gives
    `["api_version: expected a version string like '1.0', found None",
    "aliases: expected a tuple of backend names, found None"]`.
    """
    if not isinstance(spec, BackendSpec):
        return [f"expected a BackendSpec, found {type(spec).__name__}"]
    problems = [
        _name_problem("name", spec.name),
        None if isinstance(spec.summary, str) else f"summary: expected a str, found {spec.summary!r}",
        _name_problem("distribution", spec.distribution),
    ]
    module, _, attr = spec.backend_class.partition(":") if isinstance(spec.backend_class, str) else ("", "", "")
    if not (module and attr):
        problems.append(f"backend_class: expected 'module:Class', found {spec.backend_class!r}")
    if not (isinstance(spec.api_version, str) and _VERSION.fullmatch(spec.api_version)):
        problems.append(f"api_version: expected a version string like '1.0', found {spec.api_version!r}")
    aliases = spec.aliases
    if not (isinstance(aliases, (tuple, list, frozenset)) and all(_name_problem("", a) is None for a in aliases)):
        problems.append(f"aliases: expected a tuple of backend names, found {aliases!r}")
    if type(spec.priority) is not int:
        problems.append(f"priority: expected an int, found {spec.priority!r}")
    for name in ("probe_fn", "info_fn"):
        value = getattr(spec, name)
        if value is not None and not callable(value):
            problems.append(f"{name}: expected None or a callable, found {value!r}")
    if spec.unverified is not None and not isinstance(spec.unverified, str):
        problems.append(f"unverified: expected None or a str, found {spec.unverified!r}")
    problems += phase_priority_problems(spec.phase_priorities)
    gaps = spec.known_gaps
    if not (
        isinstance(gaps, tuple)
        and all(isinstance(g, tuple) and len(g) == 2 and all(isinstance(x, str) and x.strip() for x in g) for g in gaps)
    ):
        problems.append(
            f"known_gaps: expected a tuple of (check-id glob, reason) pairs of non-empty str, found {gaps!r}"
        )
    problems += capabilities_problems(spec.capabilities)
    return [p for p in problems if p]
