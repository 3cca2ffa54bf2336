"""The conformance kit must fail deliberately broken backends, with a message naming the failing case.

Each broken backend is torch_native with one realistic bug; the test runs the kit's relevant checks
(quick CPU profile) and asserts which check ids fail and what their messages say.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.backends.torch_native.spec import CAPABILITIES
from attn_core.contract.capabilities import Feature
from attn_core.testing.kit import make_plan, run_plan


def run_kit(cls, *select: str) -> dict[str, str]:
    """check id -> message of every failed check among those whose id contains one of `select`."""
    plan = make_plan(cls, device="cpu", quick=True)
    outcomes = run_plan(plan, select=select)
    assert outcomes, f"no check matched {select}"
    return {o.check_id: o.message for o in outcomes if o.failed}


class CausalOffByOne(TorchNativeBackend):
    """Extend queries also see the key right after their own position (a future token)."""

    name = "broken_causal"

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        meta = self.forward_metadata
        if meta is not None and forward_batch.forward_mode.is_extend():
            allowed = meta.self_keys.allowed
            later = torch.zeros_like(allowed)
            later[..., 1:] = allowed[..., :-1]
            allowed |= later & (meta.self_keys.slots != 0)[:, None, :]


class KVOneSlotOff(TorchNativeBackend):
    """Stores the new tokens' K/V one slot after out_cache_loc."""

    name = "broken_kv_slot"

    def _forward(self, q, k, v, layer, batch, save_kv_cache, **extras):
        if save_kv_cache and k is not None and not layer.is_cross_attention:
            pool = batch.token_to_kv_pool
            pool.set_kv_buffer(layer, (batch.out_cache_loc + 1) % pool.num_slots, k, v)
            save_kv_cache = False
        return super()._forward(q, k, v, layer, batch, save_kv_cache, **extras)


class IgnoresSlidingWindow(TorchNativeBackend):
    name = "broken_window"

    def _forward(self, q, k, v, layer, batch, save_kv_cache, **extras):
        layer = copy.copy(layer)
        layer.sliding_window_size = None
        return super()._forward(q, k, v, layer, batch, save_kv_cache, **extras)


class WindowFromContext(TorchNativeBackend):
    """Applies the context's window to every layer (wrong for models interleaving windowed and full layers)."""

    name = "broken_window_ctx"

    def _forward(self, q, k, v, layer, batch, save_kv_cache, **extras):
        layer = copy.copy(layer)
        layer.sliding_window_size = self.ctx.sliding_window_size
        return super()._forward(q, k, v, layer, batch, save_kv_cache, **extras)


class IgnoresLogitCap(TorchNativeBackend):
    name = "broken_logit_cap"

    def _forward(self, q, k, v, layer, batch, save_kv_cache, **extras):
        layer = copy.copy(layer)
        layer.logit_cap = 0.0
        return super()._forward(q, k, v, layer, batch, save_kv_cache, **extras)


class StaleGraphReplay(TorchNativeBackend):
    """Replay keeps the metadata of capture time (padding only) instead of refreshing it."""

    name = "broken_replay"

    def replay_cuda_graph_metadata(self, step):
        self.bind_graph_metadata(self._graph_metadata[(step.bs, step.forward_mode)], step)


class SilentSinks(TorchNativeBackend):
    """Does not declare sinks, yet uses them instead of refusing."""

    name = "broken_sinks"
    capabilities = dataclasses.replace(CAPABILITIES, features=CAPABILITIES.features - {Feature.SINKS})

    def require(self, feature, what=None):
        if feature is not Feature.SINKS:
            super().require(feature, what)


class WritesBeforeValidating(TorchNativeBackend):
    """Stores K/V before the base class validates the inputs."""

    name = "broken_validation"

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        if k is not None and v is not None and k.shape[0] == forward_batch.out_cache_loc.shape[0]:
            forward_batch.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        return super().forward(q, k, v, layer, forward_batch, save_kv_cache, **extras)


def test_wrong_causal_offset_fails_extend_cases():
    failed = run_kit(CausalOffByOne, "mode-")
    assert "mode-EXTEND" in failed and "mode-DECODE" not in failed
    assert "case: EXTEND reqs=[" in failed["mode-EXTEND"] and "out rel err" in failed["mode-EXTEND"]


def test_kv_one_slot_off_fails_with_the_kv_message():
    failed = run_kit(KVOneSlotOff, "mode-DECODE", "mode-EXTEND")
    assert set(failed) == {"mode-DECODE", "mode-EXTEND"}
    assert "case: DECODE reqs=" in failed["mode-DECODE"]
    assert (
        "not written to their slots" in failed["mode-DECODE"]
        or "written outside out_cache_loc" in failed["mode-DECODE"]
    )


def test_ignored_sliding_window_fails_window_cases():
    failed = run_kit(IgnoresSlidingWindow, "sliding_window-", "mode-EXTEND")
    assert failed and all(cid.startswith("sliding_window-") for cid in failed)
    assert any("sliding_window=5" in msg for msg in failed.values())


def test_window_taken_from_the_context_fails_interleaved_layers():
    failed = run_kit(WindowFromContext, "sliding_window")
    assert set(failed) == {"sliding_window_interleaved-DECODE"}
    assert "window on even layers only" in failed["sliding_window_interleaved-DECODE"]
    assert "layer 1: out rel err" in failed["sliding_window_interleaved-DECODE"]


def test_ignored_logit_cap_fails_logit_cap_cases():
    failed = run_kit(IgnoresLogitCap, "logit_cap-", "combined-", "mode-DECODE")
    logit = [n for n in failed if n.startswith("logit_cap-")]  # the plan rotates the mode of each variant
    assert len(logit) == 1 and set(failed) == {logit[0], "combined-MIXED"}, failed
    assert "logit_cap=1.5" in failed[logit[0]]


def test_stale_graph_replay_fails_graph_checks():
    failed = run_kit(StaleGraphReplay, "graph-")
    fp8 = {f"graph-fp8_kv-float8_e4m3fn-{m}" for m in ("DECODE", "TARGET_VERIFY")}  # the same graphs over an fp8 cache
    assert set(failed) == {"graph-DECODE", "graph-TARGET_VERIFY"} | fp8
    assert "graph replay, layer 0" in failed["graph-DECODE"] and "case: DECODE" in failed["graph-DECODE"]


def test_undeclared_feature_used_silently_fails_refusal():
    failed = run_kit(SilentSinks, "refuse-")
    assert set(failed) == {"refuse-sinks"}
    assert (
        "expected UnsupportedFeatureError or IncompatibleBackendError, but the call succeeded" in failed["refuse-sinks"]
    )


def test_writing_kv_before_validation_fails_bad_input():
    failed = run_kit(WritesBeforeValidating, "bad_input-q_rows", "bad_input-q_heads")
    assert set(failed) == {"bad_input-q_rows", "bad_input-q_heads"}
    assert "only after writing to the KV pool" in failed["bad_input-q_rows"]


class IgnoresVScale(TorchNativeBackend):
    """Reads an fp8 cache without multiplying the values by v_scale (keys dequantized right)."""

    name = "broken_fp8_v_scale"

    def _forward(self, q, k, v, layer, batch, save_kv_cache, **extras):
        if save_kv_cache and k is not None:
            batch.token_to_kv_pool.set_kv_buffer(layer, batch.out_cache_loc, k, v, layer.k_scale, layer.v_scale)
        layer = copy.copy(layer)
        layer.v_scale = None
        return super()._forward(q, k, v, layer, batch, False, **extras)


class StoresUnscaledFp8(TorchNativeBackend):
    """Writes new K/V to an fp8 cache without dividing by the scales (reads them right)."""

    name = "broken_fp8_store"

    def _forward(self, q, k, v, layer, batch, save_kv_cache, **extras):
        if save_kv_cache and k is not None:
            batch.token_to_kv_pool.set_kv_buffer(layer, batch.out_cache_loc, k, v)
        return super()._forward(q, k, v, layer, batch, False, **extras)


class NoFp8(TorchNativeBackend):
    """Declares no fp8 KV but never checks: must be refused at construction by the base class."""

    name = "no_fp8"
    capabilities = dataclasses.replace(CAPABILITIES, kv_dtypes=CAPABILITIES.kv_dtypes - {"float8_e4m3fn"})


def test_ignored_v_scale_fails_fp8_cases():
    failed = run_kit(IgnoresVScale, "fp8_kv-float8_e4m3fn-DECODE", "fp8_kv-float8_e4m3fn-EXTEND", "mode-DECODE")
    want = {"fp8_kv-float8_e4m3fn-DECODE", "fp8_kv-float8_e4m3fn-EXTEND", "graph-fp8_kv-float8_e4m3fn-DECODE"}
    assert set(failed) == want, failed
    assert (
        "kv=float8_e4m3fn" in failed["fp8_kv-float8_e4m3fn-DECODE"]
        and "out rel err" in failed["fp8_kv-float8_e4m3fn-DECODE"]
    )


def test_unscaled_fp8_store_fails_with_the_kv_message():
    failed = run_kit(StoresUnscaledFp8, "fp8_kv-float8_e4m3fn-DECODE", "mode-DECODE")
    assert set(failed) == {"fp8_kv-float8_e4m3fn-DECODE", "graph-fp8_kv-float8_e4m3fn-DECODE"}, failed
    assert "not written to their slots" in failed["fp8_kv-float8_e4m3fn-DECODE"]


def test_undeclared_fp8_is_refused_at_construction():
    plan = make_plan(NoFp8, device="cpu", quick=True)
    outcomes = run_plan(plan, select=("float8",))
    assert [o.check_id for o in outcomes] == ["refuse-kv_dtype-float8_e4m3fn"]
    assert not outcomes[0].failed and "IncompatibleBackendError" in outcomes[0].message
    assert "KV dtype float8_e4m3fn not in" in outcomes[0].message
