"""attn-core's conformance kit over both entry points, in their dense regimes, where the kit's dense float64
reference is the backends' definition too: double sparsity with a length threshold no request reaches (a
plain MHA pool, no label cache), dual chunk with a chunk longer than any context (only the intra part).
Their sparse regimes are checked against attn-sparse's own references (test_double_sparsity.py,
test_dual_chunk.py). Quick profile; CPU under the Triton interpreter, cuda on a GPU machine (bf16 skipped
under the interpreter by the kit itself, attn_core.testing.limits)."""

from __future__ import annotations

from attn_core.testing import ConformanceSuite


class TestDoubleSparsityConformance(ConformanceSuite):
    backend = "double_sparsity"
    options = {"sparse_decode_threshold": 1 << 30}
    quick = True


class TestDualChunkConformance(ConformanceSuite):
    backend = "dual_chunk"
    options = {"chunk_size": 1 << 30}
    quick = True
