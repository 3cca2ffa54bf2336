"""attn-triton's ragged op under the CPU interpreter, beyond the kit's `ragged-*` checks (test_triton_kit.py):
the head-dim split, the tile config's validation, each head dim of a ViT and every tile shape against the
float64 reference, a device cu_seqlens the host copy does not describe recorded as a fault (and no write
outside the output), and the bidirectional-span launch of the extend kernel against the reference."""

from __future__ import annotations

import pytest
import torch
from triton_helpers import requires_interpreter

import attn_core as ac
from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.ragged import RaggedBatch, ragged_context
from attn_core.testing.harness import AttnCase, assert_case
from attn_core.testing.ragged_checks import RaggedCase, run_ragged_case
from attn_core.testing.target import resolve_target
from attn_triton.kernels.ragged import RaggedConfig, channel_block, ragged_config

pytestmark = requires_interpreter


def test_channel_block():
    assert [channel_block(d) for d in (8, 16, 64, 72, 80, 96, 128, 136, 200, 256)] == [
        16,
        16,
        64,
        128,
        128,
        128,
        128,
        256,
        256,
        256,
    ]


def test_config_validation():
    for kw, field in (
        (dict(block_m=24), "block_m"),
        (dict(block_n=8), "block_n"),
        (dict(lazy_rescale=9), "lazy_rescale"),
    ):
        with pytest.raises(InvalidArgumentError, match=field):
            RaggedConfig(**kw)
    assert ragged_config(80, torch.float16, torch.device("cpu")) == RaggedConfig(16, 16, 1, 1, 0)


@pytest.mark.parametrize("head_dim", [64, 72, 80, 96, 128, 40])
def test_vit_head_dims(head_dim):
    case = RaggedCase(
        steps=((19, 1, 0, 33),), num_q_heads=2, num_kv_heads=1, head_dim=head_dim, dtype="float16", device="cpu"
    )
    run_ragged_case(resolve_target("triton"), case)


@pytest.mark.parametrize("tiles", [(16, 32, 4, 2, 0), (32, 16, 4, 1, 4), (64, 64, 4, 3, 2)])
def test_tiles(tiles):
    bm, bn, w, s, lazy = tiles
    cfg = RaggedConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s, lazy_rescale=lazy)
    for causal in (False, True):
        case = RaggedCase(
            steps=((70, 3, 41),),
            num_q_heads=2,
            num_kv_heads=2,
            head_dim=80,
            dtype="float32",
            device="cpu",
            causal=causal,
            return_lse=True,
        )
        run_ragged_case(resolve_target("triton", options={"ragged_config": cfg}), case)


def test_device_offsets_past_the_rows_are_a_fault():
    backend = ac.create_backend("triton", ragged_context("cpu", torch.float32, 2, 2, 16))
    good = ac.ragged_batch([5, 7], "cpu")
    backend.init_ragged_metadata(good)
    # a batch whose device offsets run past the 12 rows (validation "basic" reads the host copy only)
    bad = RaggedBatch(torch.tensor([0, 5, 40], dtype=torch.int32), good.cu_seqlens_cpu, good.max_seqlen)
    backend.init_ragged_metadata(bad)
    q = torch.randn(12, 2, 16)
    out = backend.ragged_attention(q, q, q, bad)
    assert out.shape == (12, 32)
    assert "query rows" in backend.poll_device_fault()
    backend.init_ragged_metadata(good)
    backend.ragged_attention(q, q, q, good)
    assert backend.poll_device_fault() is None


@pytest.mark.parametrize("mode", ["EXTEND", "MIXED", "DRAFT_EXTEND"])
def test_span_launch(mode):
    """Spans through the extend kernel at tiles smaller than the spans (several key tiles, the span's end in
    a later tile than the block's last row) against the float64 reference."""
    reqs = [(3, 40), (20, 1), (0, 25)] if mode != "DRAFT_EXTEND" else [(30, 3), (2, 4)]
    spans = [(5, 43), (0, 0), (1, 24)] if mode != "DRAFT_EXTEND" else [(29, 33), (0, 6)]
    case = AttnCase(mode, reqs, attn_type="decoder_bidirectional", spans=spans, return_lse=True, head_dim=64)
    from triton_helpers import factory

    assert_case(factory(), case)


#: the GPU's tiles (ragged_config's sm_90 default and benchmarks/ragged_vs_peers.py's sweep), under the interpreter
GPU_TILES = ((128, 64, 8, 3, 0), (128, 64, 8, 3, 4), (128, 128, 8, 3, 4), (64, 64, 4, 3, 0))


@pytest.mark.parametrize("head_dim", [72, 80, 96, 128])
def test_vit_head_dims_on_gpu_tiles_stay_in_bounds(head_dim):
    """The vision-tower test's head dims with the GPU's tiles (causal and not, with the LSE) against the float64
    reference, q / k / v strided views of a NaN-padded buffer, and no load or store outside the tensors
    (`interp_bounds.strict_bounds`). On an H100 the old split head dim (64 + 16 / 64 + 32 channels) gave wrong
    outputs at d80 and an illegal address at d96; the interpreter never showed it, so this pins the padded form."""
    from interp_bounds import strict_bounds

    for tiles in GPU_TILES:
        target = resolve_target("triton", options={"ragged_config": RaggedConfig(*tiles)})
        for causal in (False, True):
            case = RaggedCase(
                steps=((130, 1, 200),),
                num_q_heads=2,
                num_kv_heads=1,
                head_dim=head_dim,
                dtype="float16",
                device="cpu",
                causal=causal,
                return_lse=True,
                num_layers=1,
            )
            with strict_bounds():
                run_ragged_case(target, case)
