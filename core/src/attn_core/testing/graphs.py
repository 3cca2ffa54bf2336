"""Capture-path conformance: `init_cuda_graph_state` → capture → replay with padded rows must give what
the eager path gives (and the float64 reference), on CPU tensors too.

On CUDA the layers really run inside a captured `torch.cuda.CUDAGraph`; elsewhere "capture" makes the
same metadata calls and replay runs the layers eagerly on the padded static batch, so the metadata logic
is tested in CI. Padding follows `attn_core.graph_step.graph_padding` (what an engine's graph runner
does): a real batch of bs requests, t new tokens each, runs in the graph captured for the smallest size
B >= bs; rows bs..B-1 get req_pool_index 0, the padding seq_len, KV slot 0 (the reserved dummy) for each
of their tokens, positions seq_len - t + j, zero q/k/v and, for TARGET_VERIFY with masks, an all-True
mask.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from attn_core.batch import ForwardBatch, SpecInfo
from attn_core.forward_mode import ForwardMode
from attn_core.graph_step import CudaGraphStep, GraphPadding, graph_padding, graph_tokens_per_request
from attn_core.testing.harness import AttnCase, CaseEnv, check_kv_writes, compare_layer, layer_inputs, make_env, make_layer
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


def _padded_spec_info(real: Optional[ForwardBatch], bs_pad: int, t: int, seq_cpu: torch.Tensor, with_mask: bool, dev) -> SpecInfo:
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
                raise KitFailure(f"step {step} has {real.batch_size} requests, more than the largest capture {sizes[-1]}")
            pad = graph_padding(mode, real.batch_size, sizes, fill, t)
            size = pad.padded_bs
            where = f"step {step} (bs {real.batch_size} padded to {size}, fill {fill})\n  case: {case.describe()}"
            inputs = [layer_inputs(env, lid, gen, real, requests) for lid in range(case.num_layers)]
            pool = env.kv_pool
            before = [[pool.get_key_buffer(lid).clone(), pool.get_value_buffer(lid).clone()] for lid in range(case.num_layers)]
            real.attn_backend = backend
            backend.init_forward_metadata(real)
            eager = [layer(i["q"], i["k"], i["v"], real) for layer, i in zip(layers, inputs)]
            for bufs, i in zip(static.inputs, inputs):
                for name, buf in bufs.items():
                    if buf is not None:
                        buf.zero_()
                        buf[: i[name].shape[0]].copy_(i[name])
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
