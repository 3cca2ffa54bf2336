"""GPU suite (`pytest -m gpu`) of issue 40 for attn-flashinfer: the kit's non-causal, bidirectional-span and
ragged checks on CUDA, and the ragged op (FlashInfer's ragged prefill; head dims other than 64 / 128 / 256
zero-padded around it) at a vision tower's size (16 heads, 4 images of 1024-4096 patches) at the ViT head
dims, bf16 and fp16, non-causal, causal and with the LSE, against the float64 reference. Skips without CUDA
or without flashinfer-python."""

from __future__ import annotations

import pytest

from attn_core.testing import ConformanceSuite
from attn_flashinfer.spec import SPEC

pytestmark = pytest.mark.gpu
REASON = SPEC.probe()
requires_gpu = pytest.mark.skipif(REASON is not None, reason=f"flashinfer backend cannot run here: {REASON}")

PREFIXES = ("non_causal", "bidirectional_span", "bad_input-bidirectional", "ragged", "refuse-ragged")


class TestRaggedKitOnCuda(ConformanceSuite):
    """The kit's checks of issue 40 on cuda at the quick sizes (skipped with the probe's reason where the
    backend cannot run)."""

    backend = "flashinfer"
    device = "cuda"
    quick = True
    only = PREFIXES


@requires_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_vision_tower_shape(head_dim, dtype):
    from attn_core.testing.ragged_checks import run_ragged_case, vision_tower_case
    from attn_core.testing.target import resolve_target

    run_ragged_case(resolve_target("flashinfer"), vision_tower_case(head_dim, dtype))


@requires_gpu
@pytest.mark.parametrize("kw", [dict(causal=True), dict(return_lse=True)], ids=["causal", "lse"])
def test_vision_tower_shape_causal_and_lse(kw):
    from attn_core.testing.ragged_checks import run_ragged_case, vision_tower_case
    from attn_core.testing.target import resolve_target

    run_ragged_case(resolve_target("flashinfer"), vision_tower_case(80, "bfloat16", **kw))
