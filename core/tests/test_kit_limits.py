"""The machine's known limits (`attn_core.testing.limits`) as the kit applies them to every plan."""

from __future__ import annotations

import pytest

from attn_core.testing.kit import make_plan
from attn_core.testing.limits import (
    BF16_INTERPRETER_REASON,
    distribution_requires,
    environment_skips,
    runs_in_triton_interpreter,
)

BF16 = frozenset({"bfloat16", "float16"})


def test_distribution_requirements_are_read_from_metadata():
    assert distribution_requires("attn-triton", "triton")
    assert not distribution_requires("attn-core", "triton")
    assert distribution_requires("attn-core", "pluggy") and not distribution_requires(
        "attn-core", "hypothesis"
    )  # extras do not count
    assert not distribution_requires("no-such-distribution-xyz", "triton")


def test_bf16_is_skipped_only_for_triton_kernels_on_the_cpu_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert environment_skips("attn-triton", BF16, "cpu") == {
        "dtype-bfloat16-*": BF16_INTERPRETER_REASON,
        "fp8_kv-*-dtype-bfloat16-*": BF16_INTERPRETER_REASON,
        "ragged-dtype-bfloat16": BF16_INTERPRETER_REASON,
    }
    assert runs_in_triton_interpreter("attn-triton", "cpu") and not runs_in_triton_interpreter("attn-triton", "cuda:0")
    assert environment_skips("attn-triton", BF16, "cuda") == {}
    assert environment_skips("attn-triton", frozenset({"float16"}), "cpu") == {}
    assert environment_skips("attn-core", BF16, "cpu") == {}
    assert environment_skips(None, BF16, "cpu") == {}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert environment_skips("attn-triton", BF16, "cpu") == {}


@pytest.mark.parametrize("interpret", ["1", "0"])
def test_plans_carry_the_limits_after_the_callers_skips(monkeypatch, interpret):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    plan = make_plan("torch_native", device="cpu", quick=True, skip={"mode-*": "mine"})
    assert plan.skip == {"mode-*": "mine"}  # attn-core does not depend on triton: nothing added
    assert plan.skip_reason("mode-DECODE") == "mine" and plan.skip_reason("dtype-bfloat16-DECODE") is None
