"""GPU (`pytest -m gpu`): attn-core's conformance kit on cuda for both backends in their dense regimes (the
kit's quick cuda profile: 16/4 heads, head_dim 128, prefixes to 512, a 2048-token request, bf16 included,
real CUDA-graph capture and the graph relocation check). The sparse regimes on cuda: test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from attn_core.testing import ConformanceSuite

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class TestDoubleSparsityConformanceCuda(ConformanceSuite):
    backend = "double_sparsity"
    options = {"sparse_decode_threshold": 1 << 30}
    device = "cuda"
    quick = True


class TestDualChunkConformanceCuda(ConformanceSuite):
    backend = "dual_chunk"
    options = {"chunk_size": 1 << 30}
    device = "cuda"
    quick = True
