"""attn-core's conformance kit on the aiter backend, its operators emulated on the CPU: every declared
mode (DECODE, EXTEND, MIXED, TARGET_VERIFY, DRAFT_EXTEND, IDLE, DUMMY_FIRST), dtype (fp16, bf16), page
size (1, 16, 32), head dim (64, 128), GQA layout, MLA 512+64, the DECODE graph capture/replay path, bad
inputs and refusals, against the float64 reference with K/V writes checked slot by slot."""

from __future__ import annotations

from attn_aiter.testing.emulated_aiter import emulated_backend_class

from attn_core.testing import ConformanceSuite


class TestConformance(ConformanceSuite):
    backend = emulated_backend_class()
    device = "cpu"
    quick = True


class TestConformanceMLA(ConformanceSuite):
    """The same kit with MLA (512 + 64) as the base arch: every mode on the MLA decode and prefill
    kernels, the DECODE graph path and the random batches."""

    backend = emulated_backend_class(archs={"mla"})
    device = "cpu"
    quick = True
