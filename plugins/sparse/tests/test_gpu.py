"""GPU (`pytest -m gpu`): both backends' sparse regimes on cuda at realistic sizes (16 q / 4 KV heads,
head_dim 128, bf16 and fp16, page size 16, thousands of keys), over engine steps of the same requests
(chunked prefills, top-k and dense decodes, a MIXED step, requests leaving) eagerly and then through real
CUDA graphs (`CudaGraphRunner`, captured for 1, 2, 4, 8 requests), each step against the float64
references, pools NaN-poisoned, every K/V (and label) write checked."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from sparse_engine import SparseEngine, dc_reference, ds_reference, variants

from attn_sparse.double_sparsity.backend import DoubleSparsityBackend
from attn_sparse.dual_chunk.backend import DualChunkBackend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU = dict(page_size=16, num_q_heads=16, num_kv_heads=4, head_dim=128, slots=16384, max_context_len=4096, device="cuda")


def run(engine: SparseEngine, schedule, reference, graph_steps, **kw) -> None:
    for work in schedule:
        if isinstance(work, str):
            engine.free(work.split()[1])
        else:
            engine.step(work, reference, **kw)
    runner = engine.graph_runner([1, 2, 4, 8], variants=bool(kw.get("variants")))
    for work in graph_steps:
        engine.step(work, reference, runner=runner, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_double_sparsity_steps_and_graphs_on_cuda(dtype):
    """heavy_token_num 256, threshold 1024, 16 heavy channels: a (2200 keys) and c (1300) go top-k, b (700)
    stays dense; heavy channels of q and k are small integers (exact approximate scores, ties broken by
    position), the other channels random normal."""
    gen = torch.Generator().manual_seed(0)
    chans = torch.stack([torch.stack([torch.randperm(128, generator=gen)[:16] for _ in range(4)]) for _ in range(2)])
    margins: list = []
    make = partial(DoubleSparsityBackend, heavy_token_num=256, sparse_decode_threshold=1024)
    engine = SparseEngine(
        make, dtype=dtype, heavy_channels=chans, cuda_graph=1, seed=1, integer_heavy_channels=True, **GPU
    )
    schedule = [
        [("a", 1100), ("b", 700)],
        [("a", 1100), ("c", 1300)],
        [("a", 1), ("b", 1), ("c", 1)],
        [("c", 1), ("a", 1), ("b", 1)],
        [("a", 1), ("b", 1), ("d", 300)],
    ]
    graph_steps = [
        [("a", 1), ("b", 1), ("c", 1)],
        [("b", 1), ("a", 1)],
        [("a", 1), ("d", 1), ("c", 1), ("b", 1)],
        [("c", 1)],
    ]
    run(engine, schedule, ds_reference(256, 1024, chans, margins), graph_steps)
    assert engine.modes[:5] == ["EXTEND", "EXTEND", "DECODE", "DECODE", "MIXED"]
    finite = torch.cat(margins)
    assert int(torch.isfinite(finite).sum()) == 2 * 16 * (2 + 2 + 2 + 1 + 2 + 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dual_chunk_steps_and_graphs_on_cuda(dtype):
    """chunk_len 1024 (chunk_size 1152, local_size 128): a 3100-token prompt in 512-token chunks crossing
    chunk boundaries (four chunks), a request in its first chunk, decodes and MIXED, then graphs."""
    make = partial(DualChunkBackend, chunk_size=1152, local_size=128)
    engine = SparseEngine(make, dtype=dtype, cuda_graph=1, seed=2, **GPU)
    schedule = (
        [[("a", 512), ("b", 500)]]
        + [[("a", 512)]] * 5
        + [[("a", 28), ("b", 1)], [("a", 1), ("b", 1)], [("b", 1), ("a", 1)]]
    )
    graph_steps = [[("a", 1), ("b", 1)], [("b", 1)], [("a", 1), ("b", 1)]]
    run(engine, schedule, dc_reference(1024), graph_steps, variants=True, extras=variants)
    assert len(engine.history[("a", 0)][0]) == 3100 + 2 + 2
