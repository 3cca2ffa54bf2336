"""Choosing a backend per phase of a step, from speed data the plugins declare.

A step is in one of two phases: **decode** (DECODE; the no-token modes IDLE and DUMMY_FIRST go with it)
or **prefill** (every other mode: EXTEND, MIXED, TARGET_VERIFY, DRAFT_EXTEND, SPLIT_PREFILL), the two
halves `HybridAttnBackend` routes. Among the backends that serve a request (`Capabilities` and probe,
`attn_core.discovery.registry`), each phase the request needs goes to the backend of highest priority *for that
phase*:

- a spec's `priority` is its priority in every phase, unless
- one of its `phase_priorities` (`PhasePriority`) is for that phase and holds on the request's device
  (device type, compute-capability range, CPU flags); then the highest such entry's priority counts.

Ties go to the name that sorts first. When both phases are needed and their best backends differ, the
selection is the composition of the two, named `hybrid(prefill=A,decode=B)` (`hybrid_name`), which
`attn_core.create_backend` builds as `HybridAttnBackend(prefill=A, decode=B)`.

A `PhasePriority` states a measurement, so it carries `evidence`: where the numbers are (a section of
docs/performance.md or docs/dev/perf-notebook.md, with the benchmark command that produced them). core
holds no list of preferred backends; it only compares what the installed specs declare.

Worked example: on a compute-capability-9.0 GPU with attn-flashattention (`fa4`: priority 5, prefill
priority 40 on 9.0) and attn-triton (`triton`: priority 10, MHA decode priority 25 on 9.0) installed,
prefill goes to fa4 (40 > 10), decode to triton (25 > 5): the selection is `hybrid(prefill=fa4,decode=triton)`;
with attn-flashinfer (priority 20) installed too, decode still goes to triton (25 > 20).

Import-light (no torch): the registry and `attn-core explain` run it without a GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from attn_core.contract.capabilities import Requirements
from attn_core.contract.phases import DECODE, PREFILL, PhasePriority, phases_of

if TYPE_CHECKING:
    from attn_core.contract.spec import BackendSpec

_HYBRID = re.compile(
    r"hybrid\(\s*prefill\s*=\s*([A-Za-z0-9][A-Za-z0-9_.\-]*)\s*,\s*decode\s*=\s*([A-Za-z0-9][A-Za-z0-9_.\-]*)\s*\)"
)


def priority_for(spec: BackendSpec, phase: str, req: Requirements) -> tuple[int, Optional[PhasePriority]]:
    """The spec's priority for `phase` on `req`'s device and the entry it comes from (None: the spec's
    own `priority`)."""
    held = [e for e in spec.phase_priorities if e.phase == phase and e.holds(req)]
    if not held:
        return spec.priority, None
    best = max(held, key=lambda e: e.priority)
    return best.priority, best


@dataclass(frozen=True)
class PhaseChoice:
    """The backend one phase goes to, with its priority there and the entry that gave it (`rule` None:
    the spec's own priority; `priority` None: the caller's `prefer` chose it)."""

    phase: str
    backend: str
    priority: Optional[int]
    rule: Optional[PhasePriority] = None

    def describe(self) -> str:
        if self.priority is None:
            return f"{self.phase}: {self.backend} (preferred by the caller)"
        if self.rule is None:
            return f"{self.phase}: {self.backend} (priority {self.priority})"
        return (
            f"{self.phase}: {self.backend} (priority {self.priority} on {self.rule.condition()}; {self.rule.evidence})"
        )


@dataclass(frozen=True)
class Selection:
    """The backend of each phase a request needs (`choices`, in `PHASES` order). `name` is what
    `create_backend` takes: the one backend's name, or `hybrid(prefill=A,decode=B)`."""

    choices: tuple[PhaseChoice, ...]

    def backend_of(self, phase: str) -> Optional[str]:
        return next((c.backend for c in self.choices if c.phase == phase), None)

    @property
    def is_hybrid(self) -> bool:
        return len({c.backend for c in self.choices}) > 1

    @property
    def name(self) -> str:
        prefill, decode = self.backend_of(PREFILL), self.backend_of(DECODE)
        if self.is_hybrid and prefill is not None and decode is not None:
            return hybrid_name(prefill, decode)
        return self.choices[0].backend

    def describe(self) -> list[str]:
        """One line per phase (`PhaseChoice.describe`)."""
        return [c.describe() for c in self.choices]


def choose(specs: Sequence[BackendSpec], req: Requirements) -> Selection:
    """The selection among `specs` (every one of which serves `req`; at least one) for `req`: per phase
    the highest `priority_for`, ties to the first name. A request with no token mode is decided by the
    decode phase."""
    if not specs:
        raise ValueError("choose() needs at least one backend")
    choices = []
    for phase in phases_of(req.forward_modes) or (DECODE,):
        ranked = sorted(((priority_for(s, phase, req), s.name) for s in specs), key=lambda t: (-t[0][0], t[1]))
        (priority, rule), name = ranked[0]
        choices.append(PhaseChoice(phase, name, priority, rule))
    return Selection(tuple(choices))


def hybrid_name(prefill: str, decode: str) -> str:
    """The name of the composition of two backends. Example: `hybrid_name("fa4", "triton") ==
    "hybrid(prefill=fa4,decode=triton)"`."""
    return f"hybrid(prefill={prefill},decode={decode})"


def parse_hybrid_name(name: str) -> Optional[tuple[str, str]]:
    """(prefill, decode) of a `hybrid_name`, else None. Spaces around the parts are allowed.

    Example: `parse_hybrid_name("hybrid(prefill=fa4, decode=triton)") == ("fa4", "triton")`;
    `parse_hybrid_name("triton") is None`."""
    m = _HYBRID.fullmatch(name.strip()) if isinstance(name, str) else None
    return (m.group(1), m.group(2)) if m else None
