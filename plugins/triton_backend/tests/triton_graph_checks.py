"""Graph-path checks shared by the CPU and GPU tests: metadata captured for one batch, replayed for
another, must give what eager metadata gives (bitwise, same kernels and splits), also with padding rows."""

from __future__ import annotations

import dataclasses

import torch

from attn_core.contract.graph_step import CudaGraphStep, GraphPadding, graph_padding
from attn_core.testing.harness import AttnCase, forward_extras, layer_inputs, make_env, make_layer
from attn_core.testing.reference import relative_error, tolerance


def _eager(backend_factory, env, batch, layer, inputs):
    backend = backend_factory(env.ctx)
    backend.init_forward_metadata(batch)
    batch.attn_backend = backend
    return backend.forward(inputs["q"], inputs["k"], inputs["v"], layer, batch, **forward_extras(env.case, inputs))


def _padded(batch, pad: GraphPadding):
    """The batch with the padding rows `pad` describes: request row 0, `pad.seq_len` keys, K/V to the
    dummy slot 0 and, for TARGET_VERIFY with masks, an all-visible mask."""
    dev = batch.seq_lens.device
    n, per = pad.num_padding, pad.tokens_per_request
    rows = torch.cat([batch.req_pool_indices, torch.zeros(n, dtype=batch.req_pool_indices.dtype, device=dev)])
    seq = torch.cat([batch.seq_lens, torch.full((n,), pad.seq_len, dtype=batch.seq_lens.dtype, device=dev)])
    loc = torch.cat([batch.out_cache_loc, torch.zeros(n * per, dtype=batch.out_cache_loc.dtype, device=dev)])
    pos = torch.cat(
        [batch.positions, (pad.prefix_len + torch.arange(per, device=dev)).repeat(n).to(batch.positions.dtype)]
    )
    out = dataclasses.replace(
        batch, batch_size=pad.padded_bs, req_pool_indices=rows, seq_lens=seq, out_cache_loc=loc, positions=pos
    )
    out.seq_lens_cpu = seq.cpu()
    out.seq_lens_sum = int(out.seq_lens_cpu.sum())
    if batch.forward_mode.is_extend():
        out.extend_num_tokens = pad.num_tokens
        out.extend_seq_lens_cpu = torch.full((pad.padded_bs,), per, dtype=torch.int32)
        out.extend_seq_lens = out.extend_seq_lens_cpu.to(dev)
        out.extend_prefix_lens_cpu = out.seq_lens_cpu - per
        out.extend_prefix_lens = out.extend_prefix_lens_cpu.to(dev)
        out.extend_start_loc = torch.arange(0, pad.num_tokens, per, dtype=torch.int32, device=dev)
    spec = batch.spec_info
    if spec is not None and spec.custom_mask is not None:
        size = per * pad.seq_len
        out.spec_info = dataclasses.replace(
            spec,
            custom_mask=torch.cat([spec.custom_mask, torch.ones(n * size, dtype=torch.bool, device=dev)]),
            mask_indptr=torch.cat([spec.mask_indptr, spec.mask_indptr[-1] + size * torch.arange(1, n + 1, device=dev)]),
        )
    return out


def _pad_rows(x, n):
    return None if x is None else torch.cat([x, x[:1].expand(n, *x.shape[1:])])


def check_graph_matches_eager(backend_factory, case: AttnCase, pad: int = 0, run_graph=None) -> None:
    """Capture metadata with a dummy batch, replay with the real one (padded by `pad` requests), run the
    layer and compare with eager metadata: bitwise without padding, within tolerance with it.

    `run_graph(fn)` runs the forward closure the way a graph would (default: call it); on CUDA the
    GPU tests pass a function that captures `fn` in a CUDA graph and replays it."""
    env = make_env(case)
    batch = env.batch
    layer = make_layer(case, 0)
    inputs = layer_inputs(env, 0, torch.Generator().manual_seed(case.seed + 7))
    want = _eager(backend_factory, env, batch, layer, inputs)

    backend = backend_factory(env.ctx)
    mode, per = batch.forward_mode, batch.num_tokens // batch.batch_size
    fill = backend.get_cuda_graph_seq_len_fill_value()
    padding = graph_padding(mode, batch.batch_size, [batch.batch_size + pad], fill, per)
    graph_batch = _padded(batch, padding) if pad else batch
    bs, T = padding.padded_bs, padding.num_tokens
    backend.init_cuda_graph_state(bs + 2, T + 2 * per)
    dev = batch.seq_lens.device
    capture = graph_padding(mode, 0, [bs], fill, per)  # captured with padding rows only
    backend.capture_cuda_graph_metadata(
        CudaGraphStep(
            forward_mode=mode,
            bs=bs,
            num_tokens=T,
            req_pool_indices=torch.zeros(bs, dtype=torch.int64, device=dev),
            seq_lens=torch.full((bs,), capture.seq_len, dtype=torch.int32, device=dev),
            spec_info=graph_batch.spec_info,
        )
    )
    graph_batch.attn_backend = backend
    g_inputs = {
        name: _pad_rows(inputs[name], T - batch.num_tokens) if name in ("q", "k", "v") else inputs[name]
        for name in inputs
    }
    extras = forward_extras(case, inputs)

    def fn():
        return backend.forward(g_inputs["q"], g_inputs["k"], g_inputs["v"], layer, graph_batch, **extras)

    def replay():
        backend.replay_cuda_graph_metadata(CudaGraphStep.from_batch(graph_batch))

    got = (run_graph or (lambda f, r: (r(), f())[1]))(fn, replay)
    got_o, want_o = (got[0], want[0]) if case.return_lse else (got, want)
    n = batch.num_tokens
    if pad:
        assert relative_error(got_o[:n], want_o) <= tolerance(getattr(torch, case.dtype)), (
            "padded graph batch differs from eager"
        )
    else:
        assert torch.equal(got_o[:n], want_o), "graph replay differs from eager"
        if case.return_lse:
            assert torch.equal(got[1][:n], want[1])
