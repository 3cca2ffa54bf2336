"""The same requests over several engine steps through attn-core's public engine API: prefill, decode,
MIXED steps, a request leaving and others joining; wave beside torch_native against a float64 causal
attention (`attn_core.testing.engine_steps`); then verify steps with build_step's chain masks and a
draft tree, between decode steps of the same requests."""

from __future__ import annotations

import pytest
import torch
from attn_wave.testing.emulated_wave_lang import emulated_backend_class

import attn_core as ac
from attn_core.testing.engine_steps import MIXED_STEPS, EngineWorld, compare_over_steps
from attn_core.testing.reference import reference_attention, relative_error

Backend = emulated_backend_class()


@pytest.mark.parametrize("page_size", [1, 16])
def test_steps_match_torch_native_and_the_reference(page_size):
    worlds = [
        EngineWorld(Backend, page_size=page_size, dtype=torch.float16, head_dim=64),
        EngineWorld(
            lambda ctx: ac.create_backend("torch_native", ctx), page_size=page_size, dtype=torch.float16, head_dim=64
        ),
    ]
    seen = compare_over_steps(worlds, MIXED_STEPS, seed=page_size, tol=2e-2)
    assert [s[0] for s in seen] == ["EXTEND", "MIXED", "MIXED", "MIXED", "DECODE", "MIXED"]


def test_verify_steps_with_chains_and_a_tree():
    gen = torch.Generator().manual_seed(9)
    dt, hq, hkv, d, page = torch.float16, 4, 2, 64, 16
    kv = ac.MHATokenToKVPool(size=32 * page, page_size=page, dtype=dt, head_num=hkv, head_dim=d, layer_num=1)
    kv.get_key_buffer(0).fill_(float("nan"))
    kv.get_value_buffer(0).fill_(float("nan"))
    rows = ac.ReqToTokenPool(size=4, max_context_len=256)
    requests = ac.RequestPool(rows, ac.PagedTokenAllocator(32 * page, page), kv)
    ctx = ac.BackendContext(
        device="cpu",
        dtype=dt,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=page,
        max_context_len=256,
        req_to_token_pool=rows,
        token_to_kv_pool=kv,
        validation="full",
        forward_modes={"extend", "decode", "target_verify"},
    )
    backend = Backend(ctx)
    layer = ac.AttentionLayer(0, hq, hkv, d, scaling=0.1)
    reqs = [requests.add(), requests.add()]
    hist = [(torch.zeros(0, hkv, d, dtype=dt),) * 2 for _ in reqs]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # drafts 1 and 2 both follow draft 0
    steps = [
        ("extend", [17, 5], None),
        ("decode", [1, 1], None),
        ("target_verify", [3, 3], None),
        ("target_verify", [3, 3], "tree"),
        ("decode", [1, 1], None),
    ]
    for mode, new, masks in steps:
        custom = None
        if masks:
            custom = [torch.cat([torch.ones(3, r.kv_len, dtype=torch.bool), tree], 1) for r in reqs]
        batch = ac.build_step(requests, list(zip(reqs, new)), mode=mode, custom_masks=custom, attn_backend=backend)
        T = sum(new)
        q, k, v = (torch.randn(T, h, d, generator=gen).to(dt) for h in (hq, hkv, hkv))
        backend.init_forward_metadata(batch)
        out = layer(q, k, v, batch).reshape(T, hq, d)
        start = 0
        for r, n in enumerate(new):
            keys, vals = (torch.cat([h, x[start : start + n]]) for h, x in zip(hist[r], (k, v)))
            hist[r] = (keys, vals)
            total = keys.shape[0]
            vis = None
            if custom:
                vis = custom[r]
            ref, _ = reference_attention(
                q[start : start + n], keys, vals, q_positions=torch.arange(total - n, total), scale=0.1, mask=vis
            )
            assert relative_error(out[start : start + n], ref) < 2e-2, (mode, new, r)
            start += n
