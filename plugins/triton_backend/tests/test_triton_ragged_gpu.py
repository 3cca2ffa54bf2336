"""GPU suite (`pytest -m gpu`) of issue 40 for attn-triton: the kit's non-causal, bidirectional-span and
ragged checks on CUDA (bf16 included), and the ragged op at a vision tower's size (16 heads, 4 images of
1024-4096 patches) at the ViT head dims 64 / 72 / 80 / 96 / 128, bf16 and fp16, non-causal, causal and with
the LSE, against the float64 reference; the tiles `benchmarks/ragged_vs_peers.py` sweeps, on the d80 shape.
Every case reads q / k / v as strided views of a NaN-padded fused buffer (`ragged_checks.packed_inputs`)."""

from __future__ import annotations

import pytest
import torch

from attn_core.testing import ConformanceSuite
from attn_core.testing.ragged_checks import run_ragged_case, vision_tower_case
from attn_core.testing.target import resolve_target
from attn_triton.kernels.ragged import RaggedConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PREFIXES = ("non_causal", "bidirectional_span", "bad_input-bidirectional", "ragged", "refuse-ragged")
#: the tiles benchmarks/ragged_vs_peers.py times by default (block_m, block_n, warps, stages, lazy)
BENCH_TILES = ((128, 64, 4, 3, 4), (128, 128, 8, 3, 4), (128, 64, 8, 2, 4), (64, 64, 4, 3, 0), (128, 64, 8, 3, 4))


class TestNonCausalAndRaggedKitOnCuda(ConformanceSuite):
    """The kit's checks of issue 40 (`only`), on CUDA."""

    backend = "triton"
    device = "cuda"
    quick = True
    only = PREFIXES


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 72, 80, 96, 128])
def test_vision_tower_shape(head_dim, dtype):
    run_ragged_case(resolve_target("triton"), vision_tower_case(head_dim, dtype))


@pytest.mark.parametrize(
    "kw",
    [dict(causal=True), dict(return_lse=True), dict(causal=True, return_lse=True)],
    ids=["causal", "lse", "causal-lse"],
)
def test_vision_tower_shape_causal_and_lse(kw):
    run_ragged_case(resolve_target("triton"), vision_tower_case(80, "bfloat16", **kw))


@pytest.mark.parametrize("tiles", BENCH_TILES, ids=[",".join(map(str, t)) for t in BENCH_TILES])
def test_benchmark_tiles_are_correct(tiles):
    bm, bn, w, s, lazy = tiles
    cfg = RaggedConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s, lazy_rescale=lazy)
    target = resolve_target("triton", options={"ragged_config": cfg})
    run_ragged_case(target, vision_tower_case(80, "bfloat16", steps=((1024, 3136, 1, 37),), return_lse=True))
