"""Non-causal attention and the ragged op of attn-flashinfer on the CPU, over the stand-in for FlashInfer's
wrappers (`fake_flashinfer.py`: plain float64, FlashInfer's documented mask conventions; its ragged wrapper
refuses head dims that are not multiples of 64, as FA2's prefill kernels do): attn-core's kit checks of
encoder-only layers, bidirectional spans and the ragged op (ids `non_causal-*`, `bidirectional_span-*`,
`ragged-*`), so the wiring (which plans each layer gets, the span mask, the head-dim padding) is checked
against the float64 reference. Skipped where the real flashinfer is importable (tests/test_gpu.py runs the
same checks on a GPU there).
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is not None, reason="the real flashinfer is installed"
)

SELECTED = ("non_causal", "bidirectional_span", "ragged")


def _checks(factory):
    from attn_core.testing.kit import make_plan

    plan = make_plan(factory, device="cpu", quick=True)
    return [c for c in plan.checks if any(s in c.id for s in SELECTED)]


def test_noncausal_span_and_ragged_checks(factory):
    """Every selected check of the kit's plan passes (the plan holds them: the backend declares the three)."""
    from attn_core.testing.outcome import execute

    checks = _checks(factory)
    ids = {c.id for c in checks}
    assert {"non_causal-EXTEND", "bidirectional_span-EXTEND", "ragged-head_dim-72", "ragged-dtype-bfloat16"} <= ids
    failed = [o.message for o in map(execute, checks) if o.status != "passed"]
    assert not failed, "\n\n".join(failed)


def test_ragged_pads_head_dims_flashinfer_does_not_serve(factory):
    """At d80 the stand-in's wrapper is planned and run at 128 channels (it refuses 80, as FA2 does), and
    the output is the 80-channel attention."""
    import torch

    from attn_core.contract.ragged import ragged_batch
    from attn_core.testing.ragged_checks import RaggedCase, packed_inputs, reference_ragged
    from attn_core.testing.reference import relative_error

    case = RaggedCase(steps=((5, 9),), num_q_heads=2, num_kv_heads=2, head_dim=80, dtype="float16", device="cpu")
    backend = factory(case.context())
    batch = ragged_batch([5, 9], "cpu")
    backend.init_ragged_metadata(batch)
    q, k, v = packed_inputs(case, 14, torch.Generator().manual_seed(0))
    out = backend.ragged_attention(q, k, v, batch)
    wrapper = backend.ragged_metadata.wrappers[80**-0.5]
    assert wrapper.head_dim == 128
    ref, _ = reference_ragged(q, k, v, (5, 9), 80**-0.5, False)
    assert relative_error(out.reshape(ref.shape), ref) < 2e-2
