"""GPU checks of the MIXED split (`pytest -m gpu`): realistic sizes with bf16 against the float64 oracle,
and no host-device sync in the split step's metadata or forward (torch's sync debug mode "error")."""

from __future__ import annotations

import pytest
import torch
from triton_helpers import factory

import attn_core as ac
from attn_core.testing.harness import AttnCase, assert_case
from attn_triton.mixed import MixedPath

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GQA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, device="cuda", num_layers=1)

CASES = [
    AttnCase(
        "MIXED",
        [(4095, 1), (1000, 1), (2047, 1), (0, 512), (300, 77)],
        dtype="bfloat16",
        page_size=16,
        return_lse=True,
        **GQA,
    ),
    AttnCase("MIXED", [(0, 300), (4095, 1), (1500, 513), (17, 1), (700, 0)], dtype="bfloat16", page_size=16, **GQA),
    AttnCase(
        "MIXED",
        [(5000, 1), (900, 200), (60, 1)],
        dtype="float32",
        sliding_window=1024,
        logit_cap=30.0,
        sinks=True,
        **GQA,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.describe() for c in CASES])
def test_split_case_on_gpu(case):
    made = []

    def make(ctx):
        made.append(factory(mixed_split=True)(ctx))
        return made[-1]

    assert_case(make, case)
    assert isinstance(made[0].forward_metadata.plain, MixedPath)


@pytest.mark.parametrize(
    "work", [[(0, 1), (1, 1), (2, 64)], [(2, 64), (0, 1), (1, 1)]], ids=["decode-first", "decodes last"]
)
def test_split_step_does_not_sync(work):
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
    backend = factory(mixed_split=True)(ctx)
    layer = ac.AttentionLayer(0, 32, 8, 128)
    reqs = [requests.add() for _ in range(3)]
    prompt = ac.build_step(requests, [(r, 200) for r in reqs], attn_backend=backend)
    backend.init_forward_metadata(prompt)
    layer(*(torch.randn(600, h, 128, device=dev, dtype=torch.bfloat16) for h in (32, 8, 8)), prompt)
    step = ac.build_step(requests, [(reqs[i], n) for i, n in work], attn_backend=backend)
    qkv = [torch.randn(66, h, 128, device=dev, dtype=torch.bfloat16) for h in (32, 8, 8)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.init_forward_metadata(step)
        out = layer(*qkv, step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert isinstance(backend.forward_metadata.plain, MixedPath)
    assert out.shape == (66, 32 * 128) and bool(torch.isfinite(out).all())
    assert backend.poll_device_fault() is None
