"""`build_step` lets a backend without custom-mask support verify a chain of drafts: with no `custom_masks`
and such a backend, the TARGET_VERIFY batch carries no mask, and the backend's causal answer over prefix and
drafts is what a chain mask gives. Checked over two steps against a float64 causal reference written here."""

from __future__ import annotations

import dataclasses

import torch

import attn_core as ac
from attn_core.contract.capabilities import Feature

H, HKV, D, PAGE = 4, 2, 16, 4


def _causal_reference(q, k, v, scale):
    """Plain float64 causal attention of the last `len(q)` positions of one sequence `k`/`v` [S, HKV, D]."""
    s, t = k.shape[0], q.shape[0]
    q, k, v = (x.double() for x in (q, k, v))
    k = k.repeat_interleave(H // HKV, dim=1)
    v = v.repeat_interleave(H // HKV, dim=1)
    out = torch.empty(t, H, D, dtype=torch.float64)
    for i in range(t):
        pos = s - t + i
        logits = torch.einsum("hd,khd->hk", q[i], k[: pos + 1]) * scale
        out[i] = torch.einsum("hk,khd->hd", logits.softmax(-1), v[: pos + 1])
    return out.reshape(t, H * D)


def _engine(slots: int, rows: int, width: int):
    """A request pool over an fp32 paged KV pool of `slots` slots and the torch_native backend on it."""
    kv = ac.MHATokenToKVPool(size=slots, page_size=PAGE, dtype=torch.float32, head_num=HKV, head_dim=D, layer_num=1)
    table = ac.ReqToTokenPool(size=rows, max_context_len=width)
    pool = ac.RequestPool(table, ac.PagedTokenAllocator(size=slots, page_size=PAGE), kv)
    ctx = ac.BackendContext(
        device="cpu",
        dtype=torch.float32,
        num_q_heads=H,
        num_kv_heads=HKV,
        head_dim=D,
        page_size=PAGE,
        req_to_token_pool=table,
        token_to_kv_pool=kv,
    )
    return pool, ac.create_backend("torch_native", ctx)


class _NoMaskBackend:
    """What `build_step` reads of a backend: its capabilities, here without CUSTOM_MASK."""

    def __init__(self, backend):
        caps = backend.capabilities
        self.capabilities = dataclasses.replace(caps, features=caps.features - {Feature.CUSTOM_MASK})


def test_a_backend_without_masks_gets_an_unmasked_chain_verify_equal_to_causal():
    torch.manual_seed(0)
    pool, backend = _engine(slots=256, rows=4, width=64)
    layer = ac.AttentionLayer(layer_id=0, num_q_heads=H, num_kv_heads=HKV, head_dim=D)
    a = pool.add()
    keys, values = [], []
    for step, (n, mode) in enumerate([(7, None), (3, "TARGET_VERIFY")]):
        stand_in = _NoMaskBackend(backend) if mode else backend
        batch = ac.build_step(pool, [(a, n)], mode=mode, attn_backend=stand_in)
        if mode:
            assert batch.spec_info.num_draft_tokens == 3 and batch.spec_info.custom_mask is None
        batch.attn_backend = backend
        backend.init_forward_metadata(batch)
        q, k, v = torch.randn(n, H, D), torch.randn(n, HKV, D), torch.randn(n, HKV, D)
        keys.append(k)
        values.append(v)
        out = layer(q, k, v, batch)
        ref = _causal_reference(q, torch.cat(keys), torch.cat(values), layer.scaling)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5, msg=f"step {step}")


def test_a_backend_with_masks_still_gets_the_chain_mask():
    pool, backend = _engine(slots=64, rows=2, width=32)
    a = pool.add()
    ac.build_step(pool, [(a, 5)], attn_backend=backend)
    batch = ac.build_step(pool, [(a, 2)], mode="TARGET_VERIFY", attn_backend=backend)
    assert batch.spec_info.custom_mask.tolist() == ac.chain_verify_mask(5, 2).reshape(-1).tolist()
