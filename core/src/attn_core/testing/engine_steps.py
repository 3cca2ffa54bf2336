"""Several engine steps of the same requests through the public engine API (`RequestPool` / `build_step`),
run on two or more backends (or one backend under two options) side by side and checked step by step
against a plain float64 causal attention, as an engine would drive them: requests arriving, decoding,
mixing with prefill chunks, leaving. MHA/GQA self-attention, K/V in one dtype, CPU or CUDA.

    worlds = [EngineWorld(lambda ctx, s=s: create_backend("triton", ctx, mixed_split=s), page_size=16,
                          dtype=torch.float16) for s in (True, False)]
    seen = compare_over_steps(worlds, MIXED_STEPS, seed=0, tol=2e-2)
    # seen[i] == (mode name of model step i, None, None); an AssertionError names the first mismatch
"""

from __future__ import annotations

import math
from typing import Callable, Sequence, Union

import torch

import attn_core as ac

#: one schedule: each entry a step `[(request name, new tokens)]` (new names join), or "free NAME";
#: EXTEND, MIXED decode-first, interleaved and chunk-first, DECODE, MIXED after a request left
MIXED_STEPS: list[Union[str, list[tuple[str, int]]]] = [
    [("a", 9)],
    [("a", 1), ("b", 12)],
    [("b", 1), ("c", 5), ("a", 1)],
    [("c", 7), ("a", 1), ("b", 1)],
    [("a", 1), ("b", 1), ("c", 1)],
    "free a",
    [("d", 4), ("c", 1), ("e", 6), ("b", 1)],
]


class EngineWorld:
    """One engine's state: NaN-poisoned K/V pools (`slots` tokens, `num_layers` layers), a `RequestPool`
    over them, and the backend `make_backend(ctx)` builds for a context with validation "full" and
    forward modes extend / decode / mixed. Requests are named by the steps' work lists."""

    def __init__(
        self,
        make_backend: Callable[[ac.BackendContext], ac.AttentionBackend],
        *,
        page_size: int,
        dtype: torch.dtype,
        num_q_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int = 16,
        num_layers: int = 2,
        slots: int = 256,
        device: str = "cpu",
    ):
        self.kv = ac.MHATokenToKVPool(
            size=slots,
            page_size=page_size,
            dtype=dtype,
            head_num=num_kv_heads,
            head_dim=head_dim,
            layer_num=num_layers,
            device=device,
        )
        for lid in range(num_layers):
            self.kv.get_key_buffer(lid).fill_(float("nan"))
            self.kv.get_value_buffer(lid).fill_(float("nan"))
        self.rows = ac.ReqToTokenPool(size=8, max_context_len=64, device=device)
        self.requests = ac.RequestPool(self.rows, ac.PagedTokenAllocator(slots, page_size), self.kv)
        ctx = ac.BackendContext(
            device=torch.device(device),
            dtype=dtype,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            max_batch_size=8,
            max_context_len=64,
            req_to_token_pool=self.rows,
            token_to_kv_pool=self.kv,
            forward_modes={"extend", "decode", "mixed"},
            validation="full",
        )
        self.dtype, self.num_layers = dtype, num_layers
        self.shape = (num_q_heads, num_kv_heads, head_dim)
        self.backend = make_backend(ctx)
        self.layers = [ac.AttentionLayer(i, num_q_heads, num_kv_heads, head_dim) for i in range(num_layers)]
        self.by_name: dict[str, ac.Request] = {}

    def step(
        self, work: Sequence[tuple[str, int]], qkv: Sequence[tuple[torch.Tensor, ...]]
    ) -> tuple[ac.ForwardMode, list[torch.Tensor]]:
        """One step: `work` [(name, new_tokens)], `qkv` per layer (q `[T, Hq, D]`, k / v `[T, Hkv, D]`) →
        (the step's mode, per layer output `[T, Hq * D]` as float64). Fails if the backend flagged a fault."""
        for name, _ in work:
            if name not in self.by_name:
                self.by_name[name] = self.requests.add()
        batch = ac.build_step(self.requests, [(self.by_name[n], t) for n, t in work], attn_backend=self.backend)
        self.backend.init_forward_metadata(batch)
        outs = [layer(q, k, v, batch).double() for layer, (q, k, v) in zip(self.layers, qkv)]
        fault = self.backend.poll_device_fault()
        assert fault is None, fault
        return batch.forward_mode, outs

    def free(self, name: str) -> None:
        self.requests.free(self.by_name.pop(name))

    def same_kv(self, other: EngineWorld) -> bool:
        """The same K/V in the same slots of every layer, NaN where nothing was written."""
        return all(
            torch.equal(getattr(self.kv, get)(lid).nan_to_num(7.0), getattr(other.kv, get)(lid).nan_to_num(7.0))
            for lid in range(self.num_layers)
            for get in ("get_key_buffer", "get_value_buffer")
        )


def causal_reference_step(
    history: dict, work: Sequence[tuple[str, int]], qkv: Sequence[tuple[torch.Tensor, ...]]
) -> list[torch.Tensor]:
    """Plain float64 causal attention of one step: every request's keys are its history (in `history`,
    keyed by (name, layer), updated here) plus this step's tokens; softmax scale 1 / sqrt(D). Returns per
    layer `[T, Hq * D]`.

    Example: work [("a", 2)] on an empty history: token 0 of "a" sees key 0, token 1 keys 0..1; the next
    step [("a", 1)] sees the 2 keys kept in `history` and its own."""
    outs = []
    for lid, (q, k, v) in enumerate(qkv):
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        rows, t = [], 0
        for name, n in work:
            hk, hv = history.setdefault((name, lid), (torch.zeros(0, hkv, d, dtype=torch.float64),) * 2)
            hk = torch.cat([hk, k[t : t + n].double().cpu()])
            hv = torch.cat([hv, v[t : t + n].double().cpu()])
            history[(name, lid)] = (hk, hv)
            for i in range(n):
                p = hk.shape[0] - n + i  # the token's position: it sees keys 0..p
                for h in range(hq):
                    g = h // (hq // hkv)
                    s = (hk[: p + 1, g] @ q[t + i, h].double().cpu()) / math.sqrt(d)
                    rows.append(torch.softmax(s, 0) @ hv[: p + 1, g])
            t += n
        outs.append(torch.stack(rows).view(t, hq * d))
    return outs


def compare_over_steps(
    worlds: Sequence[EngineWorld],
    steps: Sequence[Union[str, list[tuple[str, int]]]],
    *,
    seed: int,
    tol: float,
    observe: Callable[[EngineWorld], object] = lambda world: None,
) -> list[tuple]:
    """Run `steps` on every world with the same random q / k / v (seeded), and after each model step check
    that every world's output is within `tol` of `causal_reference_step` and of every other world's (max
    absolute error over the reference's max absolute value) and that all pools hold the same K/V.
    Returns per model step (mode name, observe(world) for each world, right after its step)."""
    gen = torch.Generator().manual_seed(seed)
    first = worlds[0]
    hq, hkv, d = first.shape
    device = first.kv.get_key_buffer(0).device
    history: dict = {}
    seen = []
    for work in steps:
        if isinstance(work, str):
            for world in worlds:
                world.free(work.split()[1])
            continue
        T = sum(n for _, n in work)
        qkv = [
            tuple(torch.randn(T, h, d, generator=gen).to(first.dtype).to(device) for h in (hq, hkv, hkv))
            for _ in range(first.num_layers)
        ]
        results = []
        for world in worlds:
            mode, outs = world.step(work, qkv)
            results.append((mode, outs, observe(world)))
        ref = causal_reference_step(history, work, qkv)
        outs = [[o.cpu() for o in r[1]] for r in results]
        for lid, r in enumerate(ref):
            scale = r.abs().max()
            for i, out in enumerate(outs):
                err = float((out[lid] - r).abs().max() / scale)
                assert err <= tol, f"step {work}, layer {lid}, world {i}: error {err:.3g} against the reference"
                for j in range(i):
                    err = float((out[lid] - outs[j][lid]).abs().max() / scale)
                    assert err <= tol, f"step {work}, layer {lid}: worlds {j} and {i} differ by {err:.3g}"
        for i, world in enumerate(worlds[1:], 1):
            assert first.same_kv(world), f"step {work}: world {i}'s K/V pool differs from world 0's"
        seen.append((results[0][0].name, *(r[2] for r in results)))
    return seen
