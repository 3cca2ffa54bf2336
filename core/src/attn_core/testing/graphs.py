"""Capture-path conformance: `init_cuda_graph_state` → capture → replay with padded rows must give what
the eager path gives (and the float64 reference), on CPU tensors too.

On CUDA the layers really run inside a captured `torch.cuda.CUDAGraph`; elsewhere "capture" makes the
same metadata calls and replay runs the layers eagerly on the padded static batch, so the metadata logic
is tested in CI. Padding follows `attn_core.contract.graph_step.graph_padding` (what an engine's graph runner
does): a real batch of bs requests, t new tokens each, runs in the graph captured for the smallest size
B >= bs; rows bs..B-1 get req_pool_index 0, the padding seq_len, KV slot 0 (the reserved dummy) for each
of their tokens, positions seq_len - t + j, zero q/k/v and, for TARGET_VERIFY with masks, an all-True
mask.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from attn_core.contract.batch import ForwardBatch, SpecInfo
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import CudaGraphStep, GraphPadding, graph_padding, graph_tokens_per_request
from attn_core.testing.harness import (
    AttnCase,
    CaseEnv,
    check_kv_writes,
    compare_layer,
    layer_inputs,
    make_env,
    make_layer,
)
from attn_core.testing.outcome import KitFailure
from attn_core.testing.reference import relative_error, tolerance
from attn_core.testing.target import KitTarget

#: batch sizes captured by the kit's graph check (the steps are chosen so that most need padding)
CAPTURE_SIZES = (1, 2, 4)


class _Static:
    """The persistent buffers a graph reads, sized for the largest capture: batch fields and per-layer
    q/k/v of the new tokens."""

    def __init__(self, env: CaseEnv, t: int, max_bs: int):
        dev, case = env.ctx.device, env.case
        self.t = t
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self.out_cache_loc = torch.zeros(max_bs * t, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs * t, dtype=torch.int64, device=dev)
        gen = torch.Generator().manual_seed(0)
        shapes = layer_inputs(env, 0, gen)  # only for shapes and dtypes
        self.inputs = []
        for _ in range(case.num_layers):
            bufs = {}
            for name in ("q", "k", "v"):
                x = shapes[name]
                bufs[name] = None if x is None else torch.zeros((max_bs * t, *x.shape[1:]), dtype=x.dtype, device=dev)
            self.inputs.append(bufs)

    def load_inputs(self, inputs: list[dict]) -> None:
        """Write each layer's new-token q/k/v (`inputs[layer][name]`, `[T, H, D]`) into the head of its
        buffer and zero the rest (the padding rows)."""
        for bufs, i in zip(self.inputs, inputs):
            for name, buf in bufs.items():
                if buf is not None:
                    buf.zero_()
                    buf[: i[name].shape[0]].copy_(i[name])

    def load(self, env: CaseEnv, mode: ForwardMode, pad: GraphPadding, real: Optional[ForwardBatch]) -> ForwardBatch:
        """Write `real` (None: nothing but padding) into the buffers, padded as `pad` says, and return
        the padded batch viewing them."""
        t = self.t
        bs, bs_pad, n = pad.bs, pad.padded_bs, pad.num_tokens
        seq_cpu = torch.full((bs_pad,), pad.seq_len, dtype=torch.int32)
        rows = torch.zeros(bs_pad, dtype=torch.int64)
        loc = torch.zeros(n, dtype=torch.int64)
        if real is not None:
            seq_cpu[:bs] = real.seq_lens_cpu
            rows[:bs] = real.req_pool_indices.cpu()
            loc[: bs * t] = real.out_cache_loc.cpu()
        pos = ((seq_cpu.to(torch.int64) - t)[:, None] + torch.arange(t)).reshape(-1)
        self.req_pool_indices[:bs_pad].copy_(rows)
        self.seq_lens[:bs_pad].copy_(seq_cpu)
        self.out_cache_loc[:n].copy_(loc)
        self.positions[:n].copy_(pos)
        dev = self.seq_lens.device
        batch = ForwardBatch(
            forward_mode=mode,
            batch_size=bs_pad,
            req_pool_indices=self.req_pool_indices[:bs_pad],
            seq_lens=self.seq_lens[:bs_pad],
            seq_lens_cpu=seq_cpu,
            seq_lens_sum=int(seq_cpu.sum()),
            out_cache_loc=self.out_cache_loc[:n],
            positions=self.positions[:n],
            req_to_token_pool=env.req_to_token_pool,
            token_to_kv_pool=env.kv_pool,
        )
        if mode.is_target_verify():
            ext = torch.full((bs_pad,), t, dtype=torch.int32)
            batch.extend_seq_lens, batch.extend_seq_lens_cpu = ext.to(dev), ext
            batch.extend_prefix_lens_cpu = seq_cpu - t
            batch.extend_prefix_lens = batch.extend_prefix_lens_cpu.to(dev)
            batch.extend_start_loc = torch.arange(0, n, t, dtype=torch.int32, device=dev)
            batch.extend_num_tokens = n
            batch.spec_info = _padded_spec_info(real, bs_pad, t, seq_cpu, env.case.custom_mask, dev)
        return batch


def _padded_spec_info(
    real: Optional[ForwardBatch], bs_pad: int, t: int, seq_cpu: torch.Tensor, with_mask: bool, dev
) -> SpecInfo:
    if not with_mask:
        return SpecInfo(num_draft_tokens=t)
    masks = []
    bs = 0
    if real is not None:
        bs = real.batch_size
        flat, indptr = real.spec_info.custom_mask.cpu(), real.spec_info.mask_indptr.cpu()
        masks = [flat[int(indptr[i]) : int(indptr[i + 1])] for i in range(bs)]
    masks += [torch.ones(t * int(seq_cpu[i]), dtype=torch.bool) for i in range(bs, bs_pad)]
    indptr = torch.zeros(bs_pad + 1, dtype=torch.int64)
    indptr[1:] = torch.tensor([m.numel() for m in masks]).cumsum(0)
    return SpecInfo(num_draft_tokens=t, custom_mask=torch.cat(masks).to(dev), mask_indptr=indptr.to(dev))


def _run_layers(layers, static: _Static, batch: ForwardBatch) -> list[torch.Tensor]:
    n = batch.num_tokens
    outs = []
    for layer, bufs in zip(layers, static.inputs):
        v = None if bufs["v"] is None else bufs["v"][:n]
        outs.append(layer(bufs["q"][:n], bufs["k"][:n], v, batch))
    return outs


def _capture(layers, static: _Static, batch: ForwardBatch, on_cuda: bool):
    """Capture the layers on `batch` in a CUDA graph (None off CUDA); returns (graph, static outputs)."""
    if not on_cuda:
        return None, None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run_layers(layers, static, batch)  # warm-up: padding rows only write the dummy slot 0
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _run_layers(layers, static, batch)
    return graph, outs


def graph_case_check(target: KitTarget, case: AttnCase, capture_sizes: Sequence[int] = CAPTURE_SIZES):
    """A check that runs every step of `case` (DECODE or TARGET_VERIFY) eagerly and then through the
    graph captured for its padded size, comparing both with the reference and with each other."""

    def run() -> str:
        env = make_env(case)
        mode = case.mode
        t = graph_tokens_per_request(mode, case.requests[0].extend_len)
        sizes = sorted(capture_sizes)
        on_cuda = env.ctx.device.type == "cuda"
        backend = target.factory(env.ctx)
        fill = int(backend.get_cuda_graph_seq_len_fill_value())
        backend.init_cuda_graph_state(sizes[-1], sizes[-1] * t)
        static = _Static(env, t, sizes[-1])
        layers = [make_layer(case, lid) for lid in range(case.num_layers)]
        captured = {}
        for size in sizes:  # capture every size first, as an engine does at start-up
            batch = static.load(env, mode, graph_padding(mode, 0, [size], fill, t), None)
            batch.attn_backend = backend
            backend.capture_cuda_graph_metadata(CudaGraphStep.from_batch(batch, with_host_lens=False))
            captured[size] = _capture(layers, static, batch, on_cuda)
        tol = tolerance(getattr(torch, case.dtype))
        gen = torch.Generator().manual_seed(case.seed + 1)
        worst = 0.0
        for step, (real, requests) in enumerate(zip(env.batches, case.step_requests())):
            if real.batch_size > sizes[-1]:
                raise KitFailure(
                    f"step {step} has {real.batch_size} requests, more than the largest capture {sizes[-1]}"
                )
            pad = graph_padding(mode, real.batch_size, sizes, fill, t)
            size = pad.padded_bs
            where = f"step {step} (bs {real.batch_size} padded to {size}, fill {fill})\n  case: {case.describe()}"
            inputs = [layer_inputs(env, lid, gen, real, requests) for lid in range(case.num_layers)]
            pool = env.kv_pool
            before = [
                [pool.get_key_buffer(lid).clone(), pool.get_value_buffer(lid).clone()] for lid in range(case.num_layers)
            ]
            real.attn_backend = backend
            backend.init_forward_metadata(real)
            eager = [layer(i["q"], i["k"], i["v"], real) for layer, i in zip(layers, inputs)]
            static.load_inputs(inputs)
            padded = static.load(env, mode, pad, real)
            padded.attn_backend = backend
            backend.replay_cuda_graph_metadata(CudaGraphStep.from_batch(padded))
            graph, graph_outs = captured[size]
            if graph is not None:
                graph.replay()
                outs = [o.clone() for o in graph_outs]
            else:
                outs = _run_layers(layers, static, padded)
            T = real.num_tokens
            for lid, (layer, out, ref_e) in enumerate(zip(layers, outs, eager)):
                err, _ = compare_layer(env, layer, inputs[lid], out[:T], real, requests)
                vs_eager = relative_error(out[:T], ref_e)
                if err > tol or vs_eager > tol:
                    errs = f"rel err {err:.3g} vs reference, {vs_eager:.3g} vs eager (tol {tol:g})"
                    raise KitFailure(f"graph replay, layer {lid}: {errs} at {where}")
                ok, msg = check_kv_writes(env, layer, before[lid], inputs[lid], real, ignore_slots=(0,))
                if not ok:
                    raise KitFailure(f"graph replay, layer {lid}: {msg} at {where}")
                worst = max(worst, err)
        return f"{len(env.batches)} replays over captures {sizes}, max rel err {worst:.2g}"

    return run


# ---- the graph section of the hostile-batch kit: inputs that move between replays ----------------------
def _device_tensors(obj, device_type: str, path: str = "metadata", depth: int = 0) -> dict[str, int]:
    """path -> data_ptr of every non-empty tensor on `device_type` reachable from `obj` through dataclass
    fields, dicts, lists and tuples (not through arbitrary objects). Example: a dataclass whose field `kv`
    holds a dataclass with a cuda tensor `indptr` gives {"metadata.kv.indptr": <address>}."""
    out: dict[str, int] = {}
    if depth > 6 or obj is None:
        return out
    if isinstance(obj, torch.Tensor):
        return {path: obj.data_ptr()} if obj.device.type == device_type and obj.numel() else {}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    elif isinstance(obj, dict):
        items = [(str(k), v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(obj)]
    else:
        return out
    for name, value in items:
        out.update(_device_tensors(value, device_type, f"{path}.{name}", depth + 1))
    return out


def _swap_rows(env: CaseEnv, batch: ForwardBatch, a: int, b: int) -> None:
    """Requests a and b trade request-table rows (contents moved with them): req_pool_indices change."""
    r2t = env.req_to_token_pool.req_to_token
    ra, rb = int(batch.req_pool_indices[a]), int(batch.req_pool_indices[b])
    r2t[[ra, rb]] = r2t[[rb, ra]].clone()
    batch.req_pool_indices[a], batch.req_pool_indices[b] = rb, ra


def _move_pages(env: CaseEnv, batch: ForwardBatch, r: int) -> None:
    """Request r's keys move to freshly allocated pages (K/V copied in every layer): the page table changes."""
    ps, r2t, pool = env.ctx.page_size, env.req_to_token_pool.req_to_token, env.kv_pool
    row, n = int(batch.req_pool_indices[r]), int(batch.seq_lens_cpu[r])
    fresh = env.allocator.alloc(-(-n // ps) * ps)
    if fresh is None:
        raise KitFailure("graph relocation check: no free pages to move a request to (kit bug)")
    old = r2t[row, :n].to(torch.int64)
    new = fresh[:n].to(old.device)
    for lid in range(env.case.num_layers):
        k, v = pool.get_key_buffer(lid), pool.get_value_buffer(lid)
        for buf in [k] if v.data_ptr() == k.data_ptr() else [k, v]:  # MLA: the value is a view of the latent
            buf[new] = buf[old]
    r2t[row, :n] = new.to(r2t.dtype)
    batch.out_cache_loc[r] = int(new[n - 1])


def _shorten(env: CaseEnv, batch: ForwardBatch, r: int) -> None:
    """Request r attends to one key fewer (its new token one position earlier): seq_lens change."""
    n = int(batch.seq_lens_cpu[r]) - 1
    if n < 1:
        return
    row = int(batch.req_pool_indices[r])
    seq = batch.seq_lens_cpu.clone()
    seq[r] = n
    batch.seq_lens_cpu = seq
    batch.seq_lens = seq.to(batch.seq_lens.device)
    batch.seq_lens_sum -= 1
    batch.out_cache_loc[r] = int(env.req_to_token_pool.req_to_token[row, n - 1])
    batch.positions[r] = n - 1


def _addresses(static: _Static, backend) -> tuple[dict[str, int], dict[str, int]]:
    """The addresses a captured graph reads: the static inputs, and the device tensors of the metadata."""
    dev = static.seq_lens.device.type
    inputs = _device_tensors(
        [static.req_pool_indices, static.seq_lens, static.out_cache_loc, static.inputs], dev, "static"
    )
    return inputs, _device_tensors(backend.forward_metadata, dev)


def graph_relocation_check(target: KitTarget, case: AttnCase):
    """DECODE in one captured graph over replays whose request rows, page table and seq_lens change (the
    silent-corruption class: a replay reading capture-time metadata). Every replay is compared with an
    eager step of another instance on the same batch, and neither the static inputs nor the device
    tensors of the graph's metadata may move between capture and any replay. Meant for CUDA (the kit adds
    it there); elsewhere the replays run the layers eagerly on the static buffers."""

    def run() -> str:
        env = make_env(case)
        mode, bs = case.mode, len(case.requests)
        on_cuda = env.ctx.device.type == "cuda"
        graph_backend, eager_backend = target.factory(env.ctx), target.factory(env.ctx)
        fill = int(graph_backend.get_cuda_graph_seq_len_fill_value())
        graph_backend.init_cuda_graph_state(bs, bs)
        static = _Static(env, 1, bs)
        layers = [make_layer(case, lid) for lid in range(case.num_layers)]
        batch = static.load(env, mode, graph_padding(mode, 0, [bs], fill, 1), None)
        batch.attn_backend = graph_backend
        graph_backend.capture_cuda_graph_metadata(CudaGraphStep.from_batch(batch, with_host_lens=False))
        graph, graph_outs = _capture(layers, static, batch, on_cuda)
        at_capture = _addresses(static, graph_backend)
        real = env.batch
        real.seq_lens = real.seq_lens.clone()  # its own storage: the moves below change the batch
        moves = [("as built", lambda: None), ("rows swapped", lambda: _swap_rows(env, real, 0, bs - 1))]
        shortest = min(range(bs), key=lambda i: int(real.seq_lens_cpu[i]))  # the case's spare pages hold it
        moves += [
            ("pages moved", lambda: _move_pages(env, real, shortest)),
            ("seq_lens shortened", lambda: _shorten(env, real, bs - 1)),
        ]
        tol = tolerance(getattr(torch, case.dtype))
        gen = torch.Generator().manual_seed(case.seed + 3)
        worst = 0.0
        for what, move in moves:
            move()
            inputs = [layer_inputs(env, lid, gen, real) for lid in range(case.num_layers)]
            real.attn_backend = eager_backend
            eager_backend.init_forward_metadata(real)
            eager = [layer(i["q"], i["k"], i["v"], real) for layer, i in zip(layers, inputs)]
            static.load_inputs(inputs)
            padded = static.load(env, mode, graph_padding(mode, bs, [bs], fill, 1), real)
            padded.attn_backend = graph_backend
            graph_backend.replay_cuda_graph_metadata(CudaGraphStep.from_batch(padded))
            if graph is not None:
                graph.replay()
                outs = [o.clone() for o in graph_outs]
            else:
                outs = _run_layers(layers, static, padded)
            for lid, (out, ref) in enumerate(zip(outs, eager)):
                err = relative_error(out[:bs], ref)
                if err > tol:
                    msg = f"graph replay after '{what}', layer {lid}: rel err {err:.3g} vs eager (tol {tol:g})"
                    raise KitFailure(f"{msg}\n  case: {case.describe()}")
                worst = max(worst, err)
            for label, before, now in zip(
                ("graph input", "graph metadata"), at_capture, _addresses(static, graph_backend)
            ):
                moved = sorted(k for k in before if now.get(k) != before[k])
                if moved:
                    raise KitFailure(
                        f"after '{what}': {label} buffers moved since capture: {moved[:4]}\n  case: {case.describe()}"
                    )
        return (
            f"{len(moves)} replays (rows, pages, seq_lens moved) match eager, max rel err {worst:.2g}; no buffer moved"
        )

    return run
