"""Choosing a backend per phase of a step, from speed data the plugins declare.

A step is in one of two phases: **decode** (DECODE; the no-token modes IDLE and DUMMY_FIRST go with it)
or **prefill** (every other mode: EXTEND, MIXED, TARGET_VERIFY, DRAFT_EXTEND, SPLIT_PREFILL), the two
halves `HybridAttnBackend` routes. Among the backends that serve a request (`Capabilities` and probe,
`attn_core.registry`), each phase the request needs goes to the backend of highest priority *for that
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
priority 40 on 9.0) and attn-triton (`triton`: priority 10) installed, prefill goes to fa4 (40 > 10),
decode to triton (10 > 5): the selection is `hybrid(prefill=fa4,decode=triton)`.

Import-light (no torch): the registry and `attn-core explain` run it without a GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from attn_core.capabilities import Requirements
from attn_core.forward_mode import ForwardMode

if TYPE_CHECKING:
    from attn_core.spec import BackendSpec

PREFILL = "prefill"
DECODE = "decode"
#: the phases in the order selections list them
PHASES = (PREFILL, DECODE)

_HYBRID = re.compile(
    r"hybrid\(\s*prefill\s*=\s*([A-Za-z0-9][A-Za-z0-9_.\-]*)\s*,\s*decode\s*=\s*([A-Za-z0-9][A-Za-z0-9_.\-]*)\s*\)"
)


def phase_of(mode: ForwardMode) -> Optional[str]:
    """The phase a step of `mode` belongs to: DECODE -> "decode", the no-token modes -> None (they run
    on the decode half of a hybrid, but ask nothing of its speed), every other mode -> "prefill"."""
    if mode.is_decode():
        return DECODE
    if mode.is_no_tokens():
        return None
    return PREFILL


def phases_of(modes: Iterable[ForwardMode]) -> tuple[str, ...]:
    """The phases a request's forward modes need, in `PHASES` order.

    Example: `phases_of({ForwardMode.MIXED, ForwardMode.DECODE, ForwardMode.IDLE}) == ("prefill", "decode")`.
    """
    found = {phase_of(m) for m in modes}
    return tuple(p for p in PHASES if p in found)


def _cc(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


@dataclass(frozen=True)
class PhasePriority:
    """A backend's priority for one phase where a condition on the device holds, backed by a measurement.

    - `phase`: "prefill" or "decode".
    - `priority`: replaces the spec's `priority` for that phase where this entry holds (higher wins;
      torch_native, the reference, has 0: a negative value means "slower than the reference here").
    - `evidence`: where the numbers are (docs section and benchmark), shown by `attn-core explain`.
    - `device`: the device type it holds on ("cuda", "cpu", ...).
    - `min_compute_capability` / `max_compute_capability`: on cuda, the range it holds in (inclusive;
      None: unbounded). A request without a compute capability matches no bounded entry.
    - `cpu_isa`: CPU flags (as /proc/cpuinfo names them) that must all be present; a request without CPU
      flags matches no entry that names some.
    - `q_dtypes`: the query dtypes it was measured with ("bfloat16", ...; empty: any).

    Example: `PhasePriority("prefill", 40, "docs/performance.md#fa4", min_compute_capability=(9, 0),
    max_compute_capability=(9, 0))` holds for a request on a cuda device of compute capability 9.0 only.
    """

    phase: str
    priority: int
    evidence: str
    device: str = "cuda"
    min_compute_capability: Optional[tuple[int, int]] = None
    max_compute_capability: Optional[tuple[int, int]] = None
    cpu_isa: frozenset[str] = frozenset()
    q_dtypes: frozenset[str] = frozenset()

    def holds(self, req: Requirements) -> bool:
        """Whether this entry applies to a request on `req`'s device."""
        if req.device_type != self.device:
            return False
        if self.min_compute_capability is not None or self.max_compute_capability is not None:
            if req.compute_capability is None:
                return False
            cc = tuple(req.compute_capability)
            if self.min_compute_capability is not None and cc < tuple(self.min_compute_capability):
                return False
            if self.max_compute_capability is not None and cc > tuple(self.max_compute_capability):
                return False
        if self.cpu_isa and (req.cpu_flags is None or not self.cpu_isa <= req.cpu_flags):
            return False
        return not self.q_dtypes or req.q_dtype in self.q_dtypes

    def condition(self) -> str:
        """Where it holds, in words: "cuda, compute capability 9.0", "cpu with avx512f", "cpu, q bfloat16"."""
        parts = [self.device]
        lo, hi = self.min_compute_capability, self.max_compute_capability
        if lo is not None and hi is not None:
            parts.append(
                f"compute capability {_cc(lo)}"
                if tuple(lo) == tuple(hi)
                else f"compute capability {_cc(lo)}..{_cc(hi)}"
            )
        elif lo is not None:
            parts.append(f"compute capability >= {_cc(lo)}")
        elif hi is not None:
            parts.append(f"compute capability <= {_cc(hi)}")
        if self.cpu_isa:
            parts.append("with " + " ".join(sorted(self.cpu_isa)))
        if self.q_dtypes:
            parts.append("q " + "/".join(sorted(self.q_dtypes)))
        return ", ".join(parts)


def phase_priority_problems(entries: object) -> list[str]:
    """Every entry of a spec's `phase_priorities` the registry cannot use (empty when all are sound).

    Example: `phase_priority_problems((PhasePriority("warmup", 1, "x"),))` is
    `["phase_priorities[0].phase: expected one of ('prefill', 'decode'), found 'warmup'"]`.
    """
    if not isinstance(entries, tuple):
        return [f"phase_priorities: expected a tuple of PhasePriority, found {entries!r}"]
    out = []
    for i, e in enumerate(entries):
        where = f"phase_priorities[{i}]"
        if not isinstance(e, PhasePriority):
            out.append(f"{where}: expected a PhasePriority, found {e!r}")
            continue
        if e.phase not in PHASES:
            out.append(f"{where}.phase: expected one of {PHASES}, found {e.phase!r}")
        if type(e.priority) is not int:
            out.append(f"{where}.priority: expected an int, found {e.priority!r}")
        if not (isinstance(e.evidence, str) and e.evidence.strip()):
            out.append(f"{where}.evidence: expected where the measurement is (a non-empty str), found {e.evidence!r}")
        if not isinstance(e.device, str):
            out.append(f"{where}.device: expected a device type, found {e.device!r}")
        for name in ("min_compute_capability", "max_compute_capability"):
            cc = getattr(e, name)
            if cc is not None and not (isinstance(cc, tuple) and len(cc) == 2 and all(type(v) is int for v in cc)):
                out.append(f"{where}.{name}: expected None or a (major, minor) tuple of int, found {cc!r}")
        for name in ("cpu_isa", "q_dtypes"):
            value = getattr(e, name)
            if not (isinstance(value, frozenset) and all(isinstance(f, str) for f in value)):
                out.append(f"{where}.{name}: expected a frozenset of str, found {value!r}")
    return out


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
        if self.is_hybrid:
            return hybrid_name(self.backend_of(PREFILL), self.backend_of(DECODE))
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
