"""Pools, batch and inputs of one benchmark row, shared by every backend timed on it."""

from __future__ import annotations

import math

import torch

from attn_core.bench.workloads import BenchModel, Workload
from attn_core.contract.context import BackendContext
from attn_core.contract.layer import AttentionLayer
from attn_core.memory import MHATokenToKVPool, PagedTokenAllocator, ReqToTokenPool
from attn_core.testing.batch_builder import build_forward_batch
from attn_core.testing.reference import reference_attention

#: on GPU, enough layers that one pass over them moves this many KV bytes (so L2 holds no layer's cache)
ROTATE_BYTES = 256 << 20
MAX_LAYERS = 8


class BenchEnv:
    """Random K/V in every slot of `num_layers` layers, a consistent batch, random q/k/v of the step,
    and the new K/V already stored (so the pool holds exactly what the reference reads)."""

    def __init__(self, workload: Workload, model: BenchModel, device: torch.device, seed: int = 0):
        self.workload, self.model, self.device = workload, model, device
        ps = model.page_size
        dtype, kv_dtype = getattr(torch, model.dtype), getattr(torch, model.kv)
        rows = [p + e for p, e in workload.requests]
        pages = sum(-(-n // ps) for n in rows) + 1
        per_layer = pages * ps * model.num_kv_heads * model.head_dim * 2 * kv_dtype.itemsize
        self.num_layers = 1 if device.type != "cuda" else max(1, min(MAX_LAYERS, math.ceil(ROTATE_BYTES / per_layer)))
        self.kv_pool = MHATokenToKVPool(
            pages * ps, ps, kv_dtype, model.num_kv_heads, model.head_dim, self.num_layers, device
        )
        self.req_pool = ReqToTokenPool(len(rows), max(rows) + ps, device)
        self.allocator = PagedTokenAllocator(pages * ps, ps, device)
        self.batch = build_forward_batch(
            workload.mode,
            workload.requests,
            req_to_token_pool=self.req_pool,
            allocator=self.allocator,
            token_to_kv_pool=self.kv_pool,
        )
        gen = torch.Generator(device=device).manual_seed(seed)
        for lid in range(self.num_layers):
            for buf in (self.kv_pool.get_key_buffer(lid), self.kv_pool.get_value_buffer(lid)):
                buf.copy_(torch.randn(buf.shape, generator=gen, device=device, dtype=torch.float32).to(buf.dtype))
        T = self.batch.num_tokens
        hq, hkv, d = model.num_q_heads, model.num_kv_heads, model.head_dim
        self.q = torch.randn((T, hq, d), generator=gen, device=device).to(dtype)
        self.k = torch.randn((T, hkv, d), generator=gen, device=device).to(dtype)
        self.v = torch.randn((T, hkv, d), generator=gen, device=device).to(dtype)
        self.layers = [AttentionLayer(lid, hq, hkv, d) for lid in range(self.num_layers)]
        for layer in self.layers:
            self.kv_pool.set_kv_buffer(layer, self.batch.out_cache_loc, self.k, self.v)
        self.ctx = BackendContext(
            device=device,
            dtype=dtype,
            kv_dtype=kv_dtype,
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
            page_size=ps,
            max_batch_size=len(rows),
            max_context_len=max(rows) + ps,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool,
            forward_modes=frozenset({workload.mode}),
        )

    def reference(self) -> torch.Tensor:
        """float64 output `[T, Hq*D]` of layer 0 (on the CPU)."""
        b, layer = self.batch, self.layers[0]
        k_buf, v_buf = self.kv_pool.get_key_buffer(0), self.kv_pool.get_value_buffer(0)
        outs = []
        start = 0
        for row, (p, e) in zip(b.req_pool_indices.tolist(), self.workload.requests):
            slots = self.req_pool.req_to_token[row, : p + e].long()
            o, _ = reference_attention(
                self.q[start : start + e],
                k_buf[slots],
                v_buf[slots],
                q_positions=torch.arange(p, p + e),
                scale=layer.scaling,
            )
            outs.append(o.reshape(e, -1))
            start += e
        return torch.cat(outs)
