"""Running the conformance kit: resolve a backend, plan its checks, run them (CLI and pytest share this)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Optional, Sequence, Union

from attn_core.contract.spec import BackendSpec
from attn_core.testing.limits import distribution_of_module, environment_skips
from attn_core.testing.outcome import Check, Outcome, execute
from attn_core.testing.plan import build_checks
from attn_core.testing.profile import KitProfile, profile_for
from attn_core.testing.target import KitTarget, resolve_target

BackendRef = Union[str, BackendSpec, type]


@dataclass
class KitPlan:
    """The checks for one backend on one device, or why none can run here (`unavailable`). `skip`
    holds the caller's skips followed by the machine's known limits (`attn_core.testing.limits`)."""

    target: KitTarget
    profile: KitProfile
    checks: list[Check]
    unavailable: Optional[str] = None
    skip: Mapping[str, str] = field(default_factory=dict)

    def skip_reason(self, check_id: str) -> Optional[str]:
        """The reason of the first skip pattern (fnmatch glob) matching `check_id`, or None."""
        for pattern, reason in self.skip.items():
            if fnmatch.fnmatchcase(check_id, pattern):
                return reason or f"skipped by pattern {pattern!r}"
        return None


def default_device(target: KitTarget) -> str:
    """cuda when the backend declares it and a GPU is visible, else cpu."""
    import torch

    if "cuda" in target.capabilities.devices and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def unavailable_reason(target: KitTarget, device: str) -> Optional[str]:
    """Why the kit cannot run `target` on `device` here, or None."""
    reason = target.probe()
    if reason:
        return reason
    kind = device.split(":", 1)[0]
    if kind not in target.capabilities.devices:
        return f"backend {target.name!r} declares devices {sorted(target.capabilities.devices)}, not {kind!r}"
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device visible to torch"
    return None


def make_plan(
    backend: BackendRef,
    *,
    device: Optional[str] = None,
    quick: bool = False,
    seed: int = 0,
    options: Optional[Mapping[str, Any]] = None,
    skip: Optional[Mapping[str, str]] = None,
    registry=None,
) -> KitPlan:
    """Resolve `backend` and list its checks. Raises the registry's typed errors for unknown, not
    installed or broken backends; an unavailable one gives a plan with `unavailable` set and no checks.
    `skip` ({check-id glob: reason}) comes first; the backend's declared `BackendSpec.known_gaps` and the
    known limits of this machine for this backend (`environment_skips`) are added after it, so the CLI and
    `ConformanceSuite` skip the same checks."""
    target = resolve_target(backend, options, registry)
    device = device or default_device(target)
    profile = profile_for(device, quick)
    reason = unavailable_reason(target, device)
    checks = [] if reason else build_checks(target, profile, seed)
    distribution = (
        target.spec.distribution if target.spec is not None else distribution_of_module(target.backend_class.__module__)
    )
    skips = dict(skip or {})
    spec = target.spec
    if spec is not None:
        for pattern, why in spec.known_gaps:
            skips.setdefault(pattern, f"a known gap of {spec.name}'s kernels: {why}")
    for pattern, why in environment_skips(distribution, target.capabilities.q_dtypes, device).items():
        skips.setdefault(pattern, why)
    return KitPlan(target, profile, checks, reason, skips)


def selected(plan: KitPlan, select: Sequence[str] = (), ids: Collection[str] = ()) -> list[Check]:
    """The plan's checks whose id contains one of `select` (when given) and is one of `ids` (when given)."""
    return [c for c in plan.checks if (not select or any(s in c.id for s in select)) and (not ids or c.id in ids)]


def run_plan(
    plan: KitPlan,
    select: Sequence[str] = (),
    on_outcome: Optional[Callable[[Outcome], None]] = None,
    ids: Collection[str] = (),
) -> list[Outcome]:
    """Run the plan's checks (only those whose id contains one of `select`, when given, and is one of `ids`,
    when given)."""
    outcomes = []
    for check in selected(plan, select, ids):
        reason = plan.skip_reason(check.id)
        outcome = Outcome(check.id, "skipped", reason, 0.0) if reason else execute(check)
        outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)
    return outcomes
