"""attn-core's conformance kit on `trtllm_mha` and `cutlass_mla`, their kernel calls answered by the float64
stand-ins of the documented kernels (`attn_trtllm_mla.testing.blackwell_stand_ins`) on the CPU: every declared
mode, dtype, page size, head dim, GQA layout, sliding window and sinks (trtllm_mha), MLA 512 + 64 at page 128
(cutlass_mla), the graph capture/replay path, bad inputs and refusals, against the float64 reference with K/V
writes checked slot by slot. The plans, block tables, workspaces, scales and graph buffers are the real classes'."""

from __future__ import annotations

from attn_core.testing import ConformanceSuite
from attn_trtllm_mla.cutlass_backend import CutlassMLABackend
from attn_trtllm_mla.mha_backend import TrtllmMHABackend
from attn_trtllm_mla.testing.blackwell_stand_ins import cpu_backend_class, cutlass_mla_vendor, trtllm_mha_vendor


class TestTrtllmMHAConformance(ConformanceSuite):
    backend = cpu_backend_class(TrtllmMHABackend, trtllm_mha_vendor())
    device = "cpu"
    quick = True


class TestCutlassMLAConformance(ConformanceSuite):
    backend = cpu_backend_class(CutlassMLABackend, cutlass_mla_vendor())
    device = "cpu"
    quick = True
