"""The same requests over several steps, as an engine runs them through attn-core's public engine API:
prefill, decode, MIXED steps with prefill chunks, a request leaving and others joining; aiter (every K/V
written by itself, read back by later steps) beside torch_native, both against a plain float64 causal
attention at every step (`attn_core.testing.engine_steps`). Then MLA: prefill, decode, a long chunked
extend and verify steps of the same requests against the float64 reference over each request's history."""

from __future__ import annotations

import pytest
import torch
from attn_aiter.testing.emulated_aiter import emulated_backend_class

import attn_core as ac
from attn_core.contract.batch import SpecInfo
from attn_core.testing.engine_steps import MIXED_STEPS, EngineWorld, compare_over_steps
from attn_core.testing.reference import reference_attention, relative_error

Backend = emulated_backend_class()


@pytest.mark.parametrize("page_size", [1, 16])
def test_mha_steps_match_torch_native_and_the_reference(page_size):
    worlds = [
        EngineWorld(Backend, page_size=page_size, dtype=torch.float16, head_dim=64),
        EngineWorld(
            lambda ctx: ac.create_backend("torch_native", ctx), page_size=page_size, dtype=torch.float16, head_dim=64
        ),
    ]
    seen = compare_over_steps(worlds, MIXED_STEPS, seed=page_size, tol=2e-2)
    assert [s[0] for s in seen] == ["EXTEND", "MIXED", "MIXED", "MIXED", "DECODE", "MIXED"]


def test_mla_prefill_decode_extend_verify_of_the_same_requests():
    """MLA 512+64, bf16, page 16: requests go through a prefill, decode steps, a 140-token chunk (pieces of
    the prefill kernel), and 3- and 6-token verify steps (the decode and the prefill kernel)."""
    gen = torch.Generator().manual_seed(5)
    dt, hq, rank, rope, page = torch.bfloat16, 16, 512, 64, 16
    kv = ac.MLATokenToKVPool(
        size=64 * page, page_size=page, dtype=dt, kv_lora_rank=rank, qk_rope_head_dim=rope, layer_num=1
    )
    kv.get_key_buffer(0).fill_(float("nan"))
    rows = ac.ReqToTokenPool(size=4, max_context_len=512)
    requests = ac.RequestPool(rows, ac.PagedTokenAllocator(64 * page, page), kv)
    modes = {"extend", "decode", "target_verify"}
    ctx = ac.BackendContext(
        device="cpu",
        dtype=dt,
        num_q_heads=hq,
        num_kv_heads=1,
        head_dim=rank + rope,
        page_size=page,
        max_context_len=512,
        req_to_token_pool=rows,
        token_to_kv_pool=kv,
        attention_arch="mla",
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
        forward_modes=modes,
        validation="full",
    )
    backend = Backend(ctx)
    layer = ac.AttentionLayer(0, hq, 1, rank + rope, scaling=0.07, v_head_dim=rank)
    reqs = [requests.add() for _ in range(3)]
    history = [torch.zeros(0, 1, rank + rope, dtype=dt) for _ in reqs]
    steps = [
        ("extend", [20, 5, 33]),
        ("decode", [1, 1, 1]),
        ("decode", [1, 1, 1]),
        ("extend", [4, 140, 1]),
        ("target_verify", [3, 3, 3]),
        ("target_verify", [6, 6, 6]),
        ("decode", [1, 1, 1]),
    ]
    for mode, new in steps:
        batch = ac.build_step(requests, list(zip(reqs, new)), mode=mode, attn_backend=backend)
        if (
            mode == "target_verify"
        ):  # build_step attaches the chain mask; a backend without custom masks takes the causal chain
            batch.spec_info = SpecInfo(num_draft_tokens=new[0])
        T = sum(new)
        q = torch.randn(T, hq, rank + rope, generator=gen).to(dt)
        k = torch.randn(T, 1, rank + rope, generator=gen).to(dt)
        backend.init_forward_metadata(batch)
        out = layer(q, k, None, batch).reshape(T, hq, rank)
        start = 0
        for r, n in enumerate(new):
            history[r] = torch.cat([history[r], k[start : start + n]])
            total = history[r].shape[0]
            ref, _ = reference_attention(
                q[start : start + n],
                history[r],
                history[r][..., :rank],
                q_positions=torch.arange(total - n, total),
                scale=0.07,
            )
            err = relative_error(out[start : start + n], ref)
            assert err < 2e-2, f"{mode} {new}, request {r}: rel err {err:.3g}"
            start += n
    assert [r.kv_len for r in reqs] == [20 + 2 + 4 + 9 + 1, 5 + 2 + 140 + 9 + 1, 33 + 2 + 1 + 9 + 1]
