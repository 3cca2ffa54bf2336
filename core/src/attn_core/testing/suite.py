"""`ConformanceSuite`: the whole kit as a pytest test class. A plugin's tests/test_conformance.py:

    from attn_core.testing import ConformanceSuite

    class TestConformance(ConformanceSuite):
        backend = "mybackend"
        skip = {"page_size-64-*": "reason"}    # optional; known limits of the machine are added by the kit

Every check of the plan becomes one parametrized test `test_check[<check id>]`, and each declared
forward mode gets a hypothesis-driven `test_random_batches[<MODE>]`. Device and size come from (first
found) the pytest options `--attn-device` / `--attn-quick` (registered by attn-core's pytest plugin), the
environment variables ATTN_KIT_DEVICE / ATTN_KIT_QUICK=1, the class attributes, and else: cuda when
the backend declares it and a GPU is visible, cpu otherwise; full size.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Mapping, Optional, Union

from attn_core.contract.spec import BackendSpec
from attn_core.testing.outcome import Check, execute

_PLANS: dict = {}


def _setting(config, option: str, env: str, attr: Any) -> Any:
    value = config.getoption(option, default=None) if config is not None else None
    if value not in (None, False):
        return value
    if os.environ.get(env):
        return os.environ[env]
    return attr


class ConformanceSuite:
    """Subclass it in a plugin's tests, set `backend` (a registry name, a `BackendSpec` or an
    `AttentionBackend` subclass) and optionally `skip` ({check-id glob: reason}), `options`
    (constructor options), `device`, `quick`, `seed`, `only` (check-id prefixes: run those checks alone,
    e.g. `("ragged-",)`, and no hypothesis test unless a prefix starts with "hypothesis")."""

    backend: ClassVar[Union[str, BackendSpec, type, None]] = None
    skip: ClassVar[Mapping[str, str]] = {}
    options: ClassVar[Mapping[str, Any]] = {}
    device: ClassVar[Optional[str]] = None
    quick: ClassVar[Optional[bool]] = None
    seed: ClassVar[int] = 0
    only: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def kit_plan(cls, config=None):
        """The plan for this class under the session's settings (built once per class and settings)."""
        from attn_core.testing.kit import make_plan

        device = _setting(config, "attn_device", "ATTN_KIT_DEVICE", cls.device)
        quick = _setting(config, "attn_quick", "ATTN_KIT_QUICK", cls.quick)
        quick = quick not in (None, False, "0", "", "false")
        key = (cls, device, quick)
        if key not in _PLANS:
            if cls.backend is None:
                raise TypeError(f"{cls.__name__}: set `backend` to the backend under test")
            _PLANS[key] = make_plan(
                cls.backend, device=device, quick=quick, seed=cls.seed, options=cls.options, skip=cls.skip
            )
        return _PLANS[key]

    def pytest_generate_tests(self, metafunc) -> None:
        import pytest

        plan = type(self).kit_plan(metafunc.config)
        only = type(self).only
        if "kit_check" in metafunc.fixturenames:
            checks = [c for c in plan.checks if not only or c.id.startswith(tuple(only))]
            params = [
                pytest.param(c, id=c.id, marks=[pytest.mark.skip(reason=r)] if (r := plan.skip_reason(c.id)) else [])
                for c in checks
            ]
            if plan.unavailable:
                params = [pytest.param(None, id="unavailable", marks=pytest.mark.skip(reason=plan.unavailable))]
            metafunc.parametrize("kit_check", params)
        if "kit_mode" in metafunc.fixturenames:
            from attn_core.testing.plan import choose_base

            modes = [] if plan.unavailable else list(choose_base(plan.target, plan.profile).modes)
            if only and not any(o.startswith("hypothesis") for o in only):
                modes = []
            params = [
                pytest.param(
                    m,
                    id=m.name,
                    marks=[pytest.mark.skip(reason=r)] if (r := plan.skip_reason(f"hypothesis-{m.name}")) else [],
                )
                for m in modes
            ]
            if not params:
                params = [
                    pytest.param(
                        None, id="unavailable", marks=pytest.mark.skip(reason=plan.unavailable or "no forward mode")
                    )
                ]
            metafunc.parametrize("kit_mode", params)

    def test_check(self, kit_check: Check) -> None:
        """One check of the kit (ids: `attn-core check NAME --list`)."""
        import pytest

        outcome = execute(kit_check)
        if outcome.status == "skipped":
            pytest.skip(outcome.message)
        if outcome.failed:
            pytest.fail(outcome.message, pytrace=False)

    def test_random_batches(self, kit_mode, request) -> None:
        """Hypothesis draws batch compositions of this mode (shrinking failures to small batches).
        Skip-list id: ``hypothesis-<MODE>``."""
        import pytest

        hypothesis = pytest.importorskip("hypothesis")
        from hypothesis import strategies as st

        from attn_core.testing.plan import PlanBuilder, numeric_check

        plan = type(self).kit_plan(request.config)
        builder = PlanBuilder(plan.target, plan.profile, type(self).seed)

        @hypothesis.settings(
            max_examples=plan.profile.hypothesis_examples,
            deadline=None,
            suppress_health_check=list(hypothesis.HealthCheck),
            database=None,
        )
        @hypothesis.given(st.data())
        def run(data) -> None:
            case = builder.random_case(kit_mode, lambda lo, hi: data.draw(st.integers(lo, hi)), type(self).seed)
            outcome = execute(Check(f"hypothesis-{kit_mode.name}", numeric_check(plan.target, case), case.describe()))
            assert not outcome.failed, outcome.message

        run()
