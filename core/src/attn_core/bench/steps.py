"""Whole decode steps for host-time benchmarks (`benchmarks/forward_host_cost.py --steps`,
`benchmarks/step_host_ab.py`): one step of `bs` requests over `layers` layers, built from the public API of
an attn-core tree handed in as a module, so the same code builds this tree's step and an older tree's (an
older tree is imported by path or under another name; this module imports no attn_core itself, and a
benchmark may load it by file from this checkout).

Shapes: GQA 32 q / 8 kv heads, head_dim 128, bf16, page size 16, every request `context` tokens (the new one
last). Worked example: `decode_steps(attn_core, lambda ctx: attn_core.create_backend("torch_native", ctx), 1,
2, 64, torch.device("cpu"))` gives {"eager": fn}; on cuda also "graph" (the step through `CudaGraphRunner.run`).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable

import torch

HQ, HKV, D, PAGE, DTYPE = 32, 8, 128, 16, torch.bfloat16


def batch_builder(ac: ModuleType) -> Callable:
    """The tree's `build_forward_batch` (in `attn_core.testing.batch_builder` since 2026-11-28, before that in
    `attn_core.batch_builder`)."""
    for where in (".testing.batch_builder", ".batch_builder"):
        try:
            return importlib.import_module(ac.__name__ + where).build_forward_batch
        except ImportError:
            continue
    raise ImportError(f"{ac.__name__}: no build_forward_batch")


def decode_steps(
    ac: ModuleType, make_backend: Callable[[Any], Any], bs: int, layers: int, context: int, dev: torch.device
) -> dict[str, Callable[[], object]]:
    """One tree's decode step (module doc): {"eager": `init_forward_metadata` then every layer, "graph" (cuda
    only): `CudaGraphRunner.run` of the same batch}. `ac` is the tree's attn_core module, `make_backend(ctx)`
    its backend for the step's `BackendContext`."""
    pages = bs * (-(-context // PAGE)) + 1
    kv_pool = ac.MHATokenToKVPool(pages * PAGE, PAGE, DTYPE, HKV, D, layers, device=dev)
    req_pool = ac.ReqToTokenPool(bs, context + PAGE, device=dev)
    allocator = ac.PagedTokenAllocator(pages * PAGE, PAGE)
    batch = batch_builder(ac)(
        "DECODE", [(context - 1, 1)] * bs, req_to_token_pool=req_pool, allocator=allocator, token_to_kv_pool=kv_pool
    )
    graphs = dev.type == "cuda"
    ctx = ac.BackendContext(
        device=dev,
        dtype=DTYPE,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        page_size=PAGE,
        max_batch_size=bs,
        max_context_len=req_pool.max_context_len,
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
        cuda_graph=ac.CudaGraphLevel.UNIFORM_SINGLE_TOKEN_DECODE if graphs else ac.CudaGraphLevel.NEVER,
    )
    backend = make_backend(ctx)
    batch.attn_backend = backend
    model = [ac.AttentionLayer(i, HQ, HKV, D) for i in range(layers)]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(bs, h, D, generator=gen).to(DTYPE).to(dev) for h in (HQ, HKV, HKV))

    def eager():
        backend.init_forward_metadata(batch)
        for layer in model:
            layer(q, k, v, batch)

    steps: dict[str, Callable[[], object]] = {"eager": eager}
    if graphs:

        def run_layers(b, inputs):
            out = None
            for layer in model:
                out = layer(inputs["q"], inputs["k"], inputs["v"], b)
            return out

        shapes = {"q": ((HQ, D), DTYPE), "k": ((HKV, D), DTYPE), "v": ((HKV, D), DTYPE)}
        runner = ac.CudaGraphRunner(backend, [bs], run_layers, shapes)
        inputs = {"q": q, "k": k, "v": v}
        steps["graph"] = lambda: runner.run(batch, inputs)
    return steps


__all__ = ["batch_builder", "decode_steps"]
