"""The conformance kit itself: compositions, plan derivation from capabilities, spec lightness, skip
lists, and the pytest face failing a broken backend."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.backends.torch_native.spec import CAPABILITIES, SPEC
from attn_core.contract.capabilities import CudaGraphLevel
from attn_core.contract.forward_mode import ForwardMode
from attn_core.testing.compose import compose_requests
from attn_core.testing.kit import make_plan, run_plan
from attn_core.testing.lightness import spec_import_check
from attn_core.testing.outcome import KitFailure
from attn_core.testing.profile import profile_for
from attn_core.testing.target import KitTarget

QUICK = profile_for("cpu", True)


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from([m for m in ForwardMode if not m.is_no_tokens()]))
def test_compositions_are_legal_for_their_mode(data, mode):
    reqs = compose_requests(lambda lo, hi: data.draw(st.integers(lo, hi)), mode, QUICK)
    assert reqs and all(p >= 0 and e >= 0 for p, e in reqs)
    assert sum(e for _, e in reqs) >= 1
    if mode is ForwardMode.DECODE:
        assert {e for _, e in reqs} == {1}
    if mode is ForwardMode.TARGET_VERIFY:
        assert len({e for _, e in reqs}) == 1 and all(p >= 1 for p, _ in reqs)
    if mode is ForwardMode.MIXED:
        assert any(e == 1 for _, e in reqs) and any(e > 1 for _, e in reqs)
    if mode is not ForwardMode.EXTEND:
        assert all(e >= 1 for _, e in reqs)


def test_compositions_reach_empty_rows_and_long_requests():
    import random

    seen_empty = seen_long = False
    for seed in range(200):
        reqs = compose_requests(random.Random(seed).randint, ForwardMode.EXTEND, QUICK)
        seen_empty |= any(e == 0 for _, e in reqs)
        seen_long |= any(max(p, e) >= QUICK.long_len // 2 for p, e in reqs)
    assert seen_empty and seen_long


class NarrowBackend(TorchNativeBackend):
    """torch_native declaring much less: two modes, page size 16, fp32/bf16, no features, no graphs."""

    name = "narrow"
    capabilities = dataclasses.replace(
        CAPABILITIES,
        archs=frozenset({"mha"}),
        q_dtypes=frozenset({"float32", "bfloat16"}),
        kv_dtypes=frozenset({"float32", "bfloat16"}),
        page_sizes=frozenset({16}),
        head_dims=frozenset({64, 128}),
        forward_modes=frozenset({ForwardMode.DECODE, ForwardMode.EXTEND}),
        features=frozenset(),
        cuda_graph=CudaGraphLevel.NEVER,
    )


def test_plan_follows_declared_capabilities():
    ids = {c.id for c in make_plan(NarrowBackend, device="cpu", quick=False).checks}
    assert {"mode-DECODE", "mode-EXTEND", "page_size-16-DECODE", "page_size-16-EXTEND", "head_dim-128-EXTEND"} <= ids
    assert {"dtype-float32-DECODE", "dtype-bfloat16-EXTEND"} <= ids
    assert not any(
        i.startswith(("mode-MIXED", "page_size-1-", "graph-", "sliding_window", "sinks", "mla-", "empty-")) for i in ids
    )
    refusals = {
        "refuse-sliding_window",
        "refuse-logit_cap",
        "refuse-sinks",
        "refuse-lse_output",
        "refuse-cross_attention",
    }
    refusals |= {
        "refuse-mode-MIXED",
        "refuse-mode-TARGET_VERIFY",
        "refuse-dtype-float16",
        "refuse-page_size-1",
        "refuse-arch-mla",
    }
    assert refusals <= ids
    assert "refuse-head_dim-256" in ids


def test_narrow_backend_passes_its_own_plan():
    plan = make_plan(NarrowBackend, device="cpu", quick=True)
    failed = [o.message for o in run_plan(plan) if o.failed]
    assert not failed, "\n".join(failed)


def test_full_plan_covers_every_declared_capability_of_torch_native():
    ids = {c.id for c in make_plan("torch_native", device="cpu", quick=False).checks}
    for mode in ("EXTEND", "DECODE", "MIXED", "TARGET_VERIFY", "DRAFT_EXTEND"):
        assert f"mode-{mode}" in ids and f"random-{mode}-3" in ids
    for ps in (1, 16, 64):
        assert f"page_size-{ps}-DECODE" in ids and f"page_size-{ps}-EXTEND" in ids
    for feature in (
        "sliding_window-16-EXTEND",
        "logit_cap-DECODE",
        "sinks-EXTEND",
        "lse-DECODE",
        "cross_attention-EXTEND",
        "mla-DECODE",
    ):
        assert feature in ids
    assert {
        "graph-DECODE",
        "graph-TARGET_VERIFY",
        "empty-IDLE",
        "steps-EXTEND",
        "gqa-10x2-DECODE",
        "refuse-mode-SPLIT_PREFILL",
    } <= ids


def test_skip_patterns_and_selection():
    plan = make_plan("torch_native", device="cpu", quick=True, skip={"mode-*": "not today"})
    outcomes = run_plan(plan, select=["mode-", "spec-"])
    assert {o.check_id for o in outcomes if o.status == "skipped"} == {
        c.id for c in plan.checks if c.id.startswith("mode-")
    }
    assert all(o.message == "not today" for o in outcomes if o.status == "skipped")
    assert {o.status for o in outcomes if o.check_id.startswith("spec-")} == {"passed"}


def test_unavailable_device_gives_a_reason_and_no_checks():
    plan = make_plan(NarrowBackend, device="npu")
    assert plan.checks == [] and "declares devices" in plan.unavailable


def test_spec_import_lightness_catches_a_heavy_spec(tmp_path, monkeypatch):
    (tmp_path / "heavy_spec_mod.py").write_text(
        textwrap.dedent(
            """
            import torch  # what a spec must not do
            from attn_core.backends.torch_native.spec import SPEC
            """
        )
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    target = KitTarget("torch_native", TorchNativeBackend, CAPABILITIES, spec=SPEC, spec_source="heavy_spec_mod:SPEC")
    with pytest.raises(KitFailure, match=r"imported \['torch'\]"):
        spec_import_check(target)()
    light = dataclasses.replace(target, spec_source="attn_core.backends.torch_native.spec:SPEC")
    assert "imports none of" in spec_import_check(light)()


def test_pytest_face_fails_a_broken_backend_and_names_the_case(tmp_path):
    test_file = tmp_path / "test_conformance.py"
    test_file.write_text(
        textwrap.dedent(
            """
            import copy
            from attn_core.backends.torch_native.backend import TorchNativeBackend
            from attn_core.testing import ConformanceSuite

            class NoWindow(TorchNativeBackend):
                name = "no_window"

                def _forward(self, q, k, v, layer, batch, save_kv_cache, **extras):
                    layer = copy.copy(layer)
                    layer.sliding_window_size = None
                    return super()._forward(q, k, v, layer, batch, save_kv_cache, **extras)

            class TestNoWindow(ConformanceSuite):
                backend = NoWindow
                skip = {"sliding_window-1-*": "window 1 happens to be skipped here"}
            """
        )
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(test_file),
            "-k",
            "sliding_window or mode-DECODE",
        ]
        + ["--attn-quick"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "FAILED" in out and "test_check[sliding_window-5-EXTEND]" in out and "case: EXTEND reqs=" in out
    assert "test_check[sliding_window_interleaved-DECODE]" in out  # windowed layers between full ones
    assert "test_check[engine_kv-vllm_lbhnc-sliding_window]" in out  # the window over an engine-owned cache
    assert "3 failed, 1 passed, 1 skipped" in out, out


def test_kit_profiles_are_built_by_keyword():
    from dataclasses import fields

    from attn_core.testing.profile import KitProfile, profile_for

    p = profile_for("cpu", True)
    with pytest.raises(TypeError):
        KitProfile(*[getattr(p, f.name) for f in fields(KitProfile)])
    assert KitProfile(**{f.name: getattr(p, f.name) for f in fields(KitProfile)}) == p
    assert profile_for("cuda:1", False).device == "cuda:1" and profile_for("cuda:1", False).name == "cuda"


def test_declared_known_gaps_are_skipped_with_their_reason_and_checked():
    """`BackendSpec.known_gaps`: the kit lists the matching checks as skipped, naming the backend and the
    reason; other checks run; a malformed declaration is a spec problem the registry reports."""
    from attn_core.contract.spec import spec_problems
    from attn_core.discovery import registry as reg

    why = "the vendor kernel computes 0 * Inf for masked keys"
    r = reg.Registry(use_entry_points=False)
    r.register(dataclasses.replace(SPEC, name="gappy", aliases=(), known_gaps=(("masked_nonfinite-MIXED", why),)))
    plan = make_plan("gappy", device="cpu", quick=True, registry=r)
    ids = [c.id for c in plan.checks]
    assert "masked_nonfinite-MIXED" in ids and "masked_nonfinite-EXTEND" in ids
    reason = plan.skip_reason("masked_nonfinite-MIXED")
    assert reason is not None and "gappy" in reason and why in reason
    assert plan.skip_reason("masked_nonfinite-EXTEND") is None
    assert spec_problems(SPEC) == []
    bad = spec_problems(dataclasses.replace(SPEC, known_gaps=(("masked_nonfinite-*", ""),)))
    assert any(p.startswith("known_gaps:") for p in bad), bad
