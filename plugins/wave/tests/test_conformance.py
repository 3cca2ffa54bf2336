"""attn-core's conformance kit on the wave backend, its kernels emulated on the CPU: every declared mode
(DECODE, EXTEND, MIXED, TARGET_VERIFY with tree masks, DRAFT_EXTEND, IDLE, DUMMY_FIRST), dtype (fp16,
bf16), page size (any: 1, 16, 64), head dim (64, 128), GQA layout, bad inputs and refusals, against the
float64 reference with K/V writes checked slot by slot."""

from __future__ import annotations

from attn_wave.testing.emulated_wave_lang import emulated_backend_class

from attn_core.testing import ConformanceSuite


class TestConformance(ConformanceSuite):
    backend = emulated_backend_class()
    device = "cpu"
    quick = True
