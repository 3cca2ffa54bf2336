"""attn-core's conformance kit on the fa4 backend, its FA4 call served by the float64 emulation of FA4's
documented semantics (`attn_flashattention.testing.emulated_fa4`) on the CPU: every declared mode
(DECODE, EXTEND with prefixes, MIXED, TARGET_VERIFY with tree masks, DRAFT_EXTEND, IDLE, DUMMY_FIRST),
dtype (fp16, bf16), page size (1..64), head dim (64, 128, 256), GQA/MQA, sliding window, logit cap,
sinks, LSE, cross and encoder-decoder self attention, the graph capture/replay path (DECODE,
TARGET_VERIFY), bad inputs and refusals, against the float64 reference with K/V writes checked slot by
slot. What never ran here: FA4 itself (tests/test_gpu.py runs the same kit on a GPU)."""

from __future__ import annotations

from attn_core.testing import ConformanceSuite
from attn_flashattention.testing import emulated_backend_class


class TestConformance(ConformanceSuite):
    backend = emulated_backend_class()
    device = "cpu"
    quick = True
