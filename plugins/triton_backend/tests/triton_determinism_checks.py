"""Batch-invariance check shared by the CPU and GPU tests: one request with fixed data placed in
several batches (other companions, other positions) must give bitwise-equal output rows."""

from __future__ import annotations

import dataclasses

import torch

from attn_core.testing.harness import AttnCase, layer_inputs, make_env, make_layer


def target_rows(
    factory, mode: str, requests, target: int, *, deterministic: bool, device: str = "cpu", **case_kw
) -> torch.Tensor:
    """Output rows of request `target` of a batch of `requests`; its K/V and q come from a fixed seed."""
    case = AttnCase(mode, requests, device=device, **case_kw)
    env = make_env(case)
    ctx = dataclasses.replace(env.ctx, deterministic=deterministic)
    backend = factory(ctx)
    b = env.batch
    b.attn_backend = backend
    pool, layer = env.kv_pool, make_layer(case, 0)
    r = case.requests[target]
    gen = torch.Generator().manual_seed(1234)
    row = int(b.req_pool_indices[target])
    slots = env.req_to_token_pool.req_to_token[row, : r.prefix_len].long()
    hkv, d, dv = pool.head_num, pool.head_dim, pool.v_head_dim
    dtype = pool.dtype
    pool.get_key_buffer(0)[slots] = torch.randn(r.prefix_len, hkv, d, generator=gen).to(dtype).to(device)
    if case.arch != "mla":
        pool.get_value_buffer(0)[slots] = torch.randn(r.prefix_len, hkv, dv, generator=gen).to(dtype).to(device)
    inputs = layer_inputs(env, 0, torch.Generator().manual_seed(99))
    start = sum(case.requests[i].extend_len for i in range(target))
    rows = slice(start, start + r.extend_len)
    inputs["q"][rows] = (
        torch.randn(r.extend_len, *inputs["q"].shape[1:], generator=gen).to(inputs["q"].dtype).to(device)
    )
    for name in ("k", "v"):
        if inputs[name] is not None:
            x = inputs[name]
            x[rows] = torch.randn(r.extend_len, *x.shape[1:], generator=gen).to(x.dtype).to(device)
    backend.init_forward_metadata(b)
    out = backend.forward(inputs["q"], inputs["k"], inputs["v"], layer, b)
    return out[rows].clone()


#: (requests, index of the target) — the target is (60, 1) for decode and (37, 20) for extend
DECODE_BATCHES = [
    ([(60, 1)], 0),
    ([(5, 1), (60, 1), (200, 1)], 1),
    ([(300, 1), (1, 1), (17, 1), (90, 1), (60, 1)], 4),
]
EXTEND_BATCHES = [
    ([(37, 20)], 0),
    ([(0, 50), (37, 20)], 1),
    ([(37, 20), (3, 1), (100, 7), (0, 2)], 0),
]
