"""GPU checks of attn-flashinfer's MIXED split (`pytest -m gpu`; skip without CUDA or flashinfer-python):
random bf16 MIXED batches at realistic head counts, split, against the float64 oracle (two steps on one
backend, so the second re-plans lean), and no host-device sync in a split step's metadata or forward
(torch's sync debug mode "error", after a warm-up step has made every wrapper's first public plan)."""

from __future__ import annotations

import random

import pytest
import torch

import attn_core as ac
from attn_core.testing.harness import AttnCase, assert_case
from attn_flashinfer.spec import SPEC

pytestmark = pytest.mark.gpu
REASON = SPEC.probe()
requires_gpu = pytest.mark.skipif(REASON is not None, reason=f"flashinfer backend cannot run here: {REASON}")

GQA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, device="cuda", dtype="bfloat16", num_layers=1)


def split_backend(made: list):
    def make(ctx):
        from attn_flashinfer.backend import FlashInferBackend

        made.append(FlashInferBackend(ctx, mixed_split=True))
        return made[-1]

    return make


def random_mixed(seed: int) -> AttnCase:
    """Two steps on one backend (the second re-plans lean), each 2-6 requests: decodes over up to 5000
    cached keys and chunks of 0-600 new tokens after up to 3000, shuffled, at least one decode and one
    chunk of >= 2 tokens; page size 1 or 16, NHD or HND; seed % 3: 1 adds the LSE, 2 a window and a
    logit cap."""
    rng = random.Random(f"fi-mixed-split-{seed}")

    def one_step() -> list:
        n = rng.randint(2, 6)
        reqs = [
            (rng.randint(1, 5000), 1) if rng.random() < 0.6 else (rng.randint(0, 3000), rng.choice([0, 7, 64, 600]))
            for _ in range(n)
        ]
        reqs[0], reqs[1] = (rng.randint(1, 5000), 1), (rng.randint(0, 3000), rng.randint(2, 600))
        rng.shuffle(reqs)
        return reqs

    first, second = one_step(), one_step()
    n = len(first) + len(second)
    extra = {1: dict(return_lse=True), 2: dict(sliding_window=rng.randint(1, 700), logit_cap=20.0)}.get(seed % 3, {})
    return AttnCase(
        "MIXED",
        first + second,
        page_size=rng.choice([1, 16]),
        kv_layout=rng.choice(["NHD", "HND"]),
        seed=seed,
        steps=((*range(len(first)),), (*range(len(first), n),)),
        **GQA,
        **extra,
    )


@requires_gpu
@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_batches_split(seed):
    made = []
    case = random_mixed(seed)
    assert_case(split_backend(made), case)
    assert type(made[0].forward_metadata).__name__ == "SplitStep"  # the second step's


@requires_gpu
@pytest.mark.parametrize(
    "case",
    [
        AttnCase("MIXED", [(4095, 1), (1000, 1), (2047, 1), (0, 512), (300, 77)], page_size=16, return_lse=True, **GQA),
        AttnCase("MIXED", [(0, 300), (4095, 1), (1500, 513), (17, 1), (700, 0)], page_size=16, **GQA),
        AttnCase(
            "MIXED", [(5000, 1), (900, 200), (60, 1)], sliding_window=1024, logit_cap=30.0, return_lse=True, **GQA
        ),
    ],
    ids=["decode-first", "interleaved", "window-cap"],
)
def test_split_case(case):
    made = []
    assert_case(split_backend(made), case)
    assert type(made[0].forward_metadata).__name__ == "SplitStep"


@requires_gpu
@pytest.mark.parametrize(
    "work", [[(0, 1), (1, 1), (2, 64)], [(2, 64), (0, 1), (1, 1)]], ids=["decode-first", "decodes last"]
)
def test_split_step_does_not_sync(work):
    from attn_flashinfer.backend import FlashInferBackend

    dev = torch.device("cuda")
    kv = ac.MHATokenToKVPool(
        size=4096, page_size=16, dtype=torch.bfloat16, head_num=8, head_dim=128, layer_num=1, device=dev
    )
    rows = ac.ReqToTokenPool(size=4, max_context_len=1024, device=dev)
    requests = ac.RequestPool(rows, ac.PagedTokenAllocator(4096, 16), kv)
    ctx = ac.BackendContext(
        device=dev,
        dtype=torch.bfloat16,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        max_batch_size=4,
        max_context_len=1024,
        req_to_token_pool=rows,
        token_to_kv_pool=kv,
        forward_modes={"extend", "decode", "mixed"},
    )
    backend = FlashInferBackend(ctx, mixed_split=True)
    layer = ac.AttentionLayer(0, 32, 8, 128)
    reqs = [requests.add() for _ in range(3)]
    prompt = ac.build_step(requests, [(r, 200) for r in reqs], attn_backend=backend)
    backend.init_forward_metadata(prompt)
    layer(*(torch.randn(600, h, 128, device=dev, dtype=torch.bfloat16) for h in (32, 8, 8)), prompt)

    def split_step():
        step = ac.build_step(requests, [(reqs[i], n) for i, n in work], attn_backend=backend)
        qkv = [torch.randn(66, h, 128, device=dev, dtype=torch.bfloat16) for h in (32, 8, 8)]
        torch.cuda.synchronize()
        return step, qkv

    step, qkv = split_step()  # warm-up: the wrappers' first (public) plans
    backend.init_forward_metadata(step)
    layer(*qkv, step)
    step, qkv = split_step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.init_forward_metadata(step)
        out = layer(*qkv, step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert type(backend.forward_metadata).__name__ == "SplitStep"
    assert out.shape == (66, 32 * 128) and bool(torch.isfinite(out).all())
    assert backend.poll_device_fault() is None
