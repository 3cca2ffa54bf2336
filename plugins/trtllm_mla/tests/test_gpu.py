"""trtllm_mla on a Blackwell GPU against the float64 reference: attn-core's conformance kit (every declared
capability, CUDA graphs). Skips everywhere else with the reason, which names the missing architecture
(no Blackwell GPU was available to this project: these tests have never run)."""

from __future__ import annotations

import pytest

from attn_trtllm_mla.spec import SPEC

pytestmark = pytest.mark.gpu
REASON = SPEC.probe()


def _kit_checks():
    if REASON is not None:
        return [pytest.param(None, id="kit", marks=pytest.mark.skip(reason=f"trtllm_mla cannot run here: {REASON}"))]
    from attn_core.testing.kit import make_plan

    plan = make_plan("trtllm_mla", device="cuda", quick=True)
    return [pytest.param(c, id=c.id) for c in plan.checks]


@pytest.mark.parametrize("check", _kit_checks())
def test_conformance_kit(check):
    from attn_core.testing.outcome import execute

    outcome = execute(check)
    if outcome.status == "skipped":
        pytest.skip(outcome.message)
    assert outcome.status == "passed", outcome.message
