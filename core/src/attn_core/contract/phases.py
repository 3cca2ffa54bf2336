"""The two phases of a step and the per-phase priority a backend spec may declare (the data half of
selection; the choosing is `attn_core.discovery.selection`).

A step is in one of two phases: **decode** (DECODE; the no-token modes IDLE and DUMMY_FIRST go with it) or
**prefill** (every other mode). A `PhasePriority` on a `BackendSpec` says that the backend is the fast path
for one phase on the devices where a measurement says so, and carries that measurement's `evidence`.

>>> phase_of(ForwardMode.DECODE), phase_of(ForwardMode.MIXED)
('decode', 'prefill')

Import-light (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from attn_core.contract.capabilities import Requirements
from attn_core.contract.forward_mode import ForwardMode

PREFILL = "prefill"
DECODE = "decode"
#: the phases in the order selections list them
PHASES = (PREFILL, DECODE)


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
    - `archs`: the attention architectures it was measured with ("mha", "mla"; empty: any).

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
    archs: frozenset[str] = frozenset()

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
        if self.archs and req.arch not in self.archs:
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
        if self.archs:
            parts.append("/".join(sorted(self.archs)))
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
        for name in ("cpu_isa", "q_dtypes", "archs"):
            value = getattr(e, name)
            if not (isinstance(value, frozenset) and all(isinstance(f, str) for f in value)):
                out.append(f"{where}.{name}: expected a frozenset of str, found {value!r}")
    return out
