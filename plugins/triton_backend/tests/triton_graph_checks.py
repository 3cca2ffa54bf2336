"""Graph-path checks shared by the CPU and GPU tests: metadata captured for one batch, replayed for
another, must give what eager metadata gives (bitwise, same kernels and splits), also with padding rows."""

from __future__ import annotations

import dataclasses

import torch

from attn_core.testing.harness import AttnCase, forward_extras, layer_inputs, make_env, make_layer
from attn_core.testing.reference import relative_error, tolerance


def _eager(backend_factory, env, batch, layer, inputs):
    backend = backend_factory(env.ctx)
    backend.init_forward_metadata(batch)
    batch.attn_backend = backend
    return backend.forward(inputs["q"], inputs["k"], inputs["v"], layer, batch, **forward_extras(env.case, inputs))


def _padded(batch, pad: int, fill: int):
    """The batch with `pad` padding requests (row 0, seq_len `fill`, K/V to the dummy slot 0)."""
    dev = batch.seq_lens.device
    per = batch.num_tokens // batch.batch_size
    rows = torch.cat([batch.req_pool_indices, torch.zeros(pad, dtype=batch.req_pool_indices.dtype, device=dev)])
    seq = torch.cat([batch.seq_lens, torch.full((pad,), fill, dtype=torch.int32, device=dev)])
    loc = torch.cat([batch.out_cache_loc, torch.zeros(pad * per, dtype=batch.out_cache_loc.dtype, device=dev)])
    out = dataclasses.replace(batch, batch_size=batch.batch_size + pad, req_pool_indices=rows, seq_lens=seq, out_cache_loc=loc)
    out.seq_lens_cpu = seq.cpu()
    out.seq_lens_sum = int(out.seq_lens_cpu.sum())
    if batch.forward_mode.is_extend():
        out.extend_num_tokens = batch.extend_num_tokens + pad * per
        out.extend_seq_lens = torch.full((out.batch_size,), per, dtype=torch.int32, device=dev)
        out.extend_seq_lens_cpu = out.extend_seq_lens.cpu()
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
    graph_batch = _padded(batch, pad, backend.get_cuda_graph_seq_len_fill_value()) if pad else batch
    bs, T = graph_batch.batch_size, graph_batch.num_tokens
    backend.init_cuda_graph_state(bs + 2, T + 2 * (T // bs))
    mode, spec = batch.forward_mode, batch.spec_info
    dev = batch.seq_lens.device
    dummy_rows = torch.zeros(bs, dtype=torch.int64, device=dev)
    dummy_lens = torch.full((bs,), backend.get_cuda_graph_seq_len_fill_value(), dtype=torch.int32, device=dev)
    if mode.is_target_verify():
        dummy_lens += T // bs
    backend.init_forward_metadata_capture_cuda_graph(bs, T, dummy_rows, dummy_lens, None, mode, spec)
    graph_batch.attn_backend = backend
    g_inputs = {name: _pad_rows(inputs[name], T - batch.num_tokens) if name in ("q", "k", "v") else inputs[name] for name in inputs}
    extras = forward_extras(case, inputs)

    def fn():
        return backend.forward(g_inputs["q"], g_inputs["k"], g_inputs["v"], layer, graph_batch, **extras)

    def replay():
        backend.init_forward_metadata_replay_cuda_graph(
            bs, graph_batch.req_pool_indices, graph_batch.seq_lens, graph_batch.seq_lens_sum, None, mode, spec, graph_batch.seq_lens_cpu
        )

    got = (run_graph or (lambda f, r: (r(), f())[1]))(fn, replay)
    got_o, want_o = (got[0], want[0]) if case.return_lse else (got, want)
    n = batch.num_tokens
    if pad:
        assert relative_error(got_o[:n], want_o) <= tolerance(getattr(torch, case.dtype)), "padded graph batch differs from eager"
    else:
        assert torch.equal(got_o[:n], want_o), "graph replay differs from eager"
        if case.return_lse:
            assert torch.equal(got[1][:n], want[1])
