"""Two-batch overlap: running child A then child B at every layer and concatenating equals running the
whole batch (and the float64 reference) for random decode, extend (with a request cut in two), mixed,
draft-extend and verify batches; the splitter's fields on a worked example; typed errors."""

from __future__ import annotations

import random

import pytest
import torch

from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.batching.tbo_split import TboSplit, compute_tbo_split, split_batch, split_forward_batch
from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.engine.graph_runner import CudaGraphRunner
from attn_core.memory import MHATokenToKVPool
from attn_core.testing.batch_builder import RequestShape
from attn_core.testing.harness import AttnCase, layer_inputs, make_env, make_layer, reference_for_layer
from attn_core.testing.reference import relative_error, tolerance
from attn_core.wrappers.tbo import TboAttnBackend


def _tbo(ctx, allow_cut=True):
    # three objects with different settings: the children chunk their score tensors differently
    return TboAttnBackend(
        TorchNativeBackend(ctx),
        [TorchNativeBackend(ctx, max_score_bytes=512), TorchNativeBackend(ctx, max_score_bytes=4096)],
        allow_cut=allow_cut,
    )


def _random_case(seed: int) -> AttnCase:
    rng = random.Random(seed)
    mode = [
        ForwardMode.DECODE,
        ForwardMode.EXTEND,
        ForwardMode.TARGET_VERIFY,
        ForwardMode.MIXED,
        ForwardMode.DRAFT_EXTEND,
    ][seed % 5]
    bs = rng.randint(2, 5)
    if mode is ForwardMode.DECODE:
        reqs = [RequestShape(rng.randint(0, 40), 1) for _ in range(bs)]
    elif mode is ForwardMode.TARGET_VERIFY:
        d = rng.randint(1, 5)
        reqs = [RequestShape(rng.randint(0, 30), d) for _ in range(bs)]
    else:
        reqs = [RequestShape(rng.choice([0, rng.randint(1, 30)]), rng.randint(0, 13)) for _ in range(bs)]
        if mode is ForwardMode.MIXED:
            reqs.append(RequestShape(rng.randint(1, 20), 1))
        if sum(r.extend_len for r in reqs) < 2:
            reqs[0] = RequestShape(reqs[0].prefix_len, 5)
    cross = mode is not ForwardMode.TARGET_VERIFY and rng.random() < 0.2
    if cross:
        reqs = [RequestShape(r.prefix_len, r.extend_len, rng.randint(1, 6)) for r in reqs]
    return AttnCase(
        mode=mode,
        requests=tuple(reqs),
        num_q_heads=4,
        num_kv_heads=rng.choice([1, 2]),
        head_dim=16,
        page_size=rng.choice([1, 4, 16]),
        sliding_window=None if cross else rng.choice([None, rng.randint(1, 12)]),
        sinks=rng.random() < 0.3,
        return_lse=rng.random() < 0.5,
        cross_attention=cross,
        seed=seed,
    )


def _run_whole_and_split(case: AttnCase, allow_cut: bool = True):
    """Per layer: (output of the whole batch on the primary, concatenated output of the children,
    float64 reference); also the KV pools after both runs. Returns the split too."""
    env = make_env(case)
    tbo = _tbo(env.ctx, allow_cut)
    b = env.batch
    b.attn_backend = tbo
    tbo.init_forward_metadata(b)
    assert tbo.child_batches is not None
    child_a, child_b = tbo.child_batches
    t = child_a.num_tokens
    enc_a = 0 if child_a.encoder_out_cache_loc is None else child_a.encoder_out_cache_loc.shape[0]
    gen = torch.Generator().manual_seed(case.seed + 1)
    pool = env.kv_pool
    results = []
    kv_whole, kv_split = [], []
    for lid in range(case.num_layers):
        layer = make_layer(case, lid)
        x = layer_inputs(env, lid, gen)
        extras = {"sinks": x["sinks"]} if x["sinks"] is not None else {}
        if case.return_lse:
            extras["return_lse"] = True
        before = [pool.get_key_buffer(lid).clone(), pool.get_value_buffer(lid).clone()]
        whole = layer(x["q"], x["k"], x["v"], b, **extras)
        kv_whole.append([pool.get_key_buffer(lid).clone(), pool.get_value_buffer(lid).clone()])
        pool.get_key_buffer(lid).copy_(before[0])
        pool.get_value_buffer(lid).copy_(before[1])
        kv_rows = (slice(0, enc_a), slice(enc_a, None)) if case.cross_attention else (slice(0, t), slice(t, None))
        parts = []
        for child, q_rows, kv in zip((child_a, child_b), (slice(0, t), slice(t, None)), kv_rows):
            k = None if x["k"] is None else x["k"][kv]
            v = None if x["v"] is None else x["v"][kv]
            if k is not None and k.shape[0] == 0 and case.cross_attention:
                k = v = None
            parts.append(
                layer(x["q"][q_rows], k, v, child, save_kv_cache=k is not None or not case.cross_attention, **extras)
            )
        kv_split.append([pool.get_key_buffer(lid).clone(), pool.get_value_buffer(lid).clone()])
        if case.return_lse:
            split = (torch.cat([parts[0][0], parts[1][0]]), torch.cat([parts[0][1], parts[1][1]]))
        else:
            split = torch.cat(parts)
        results.append((whole, split, reference_for_layer(env, layer, x)))
    return results, kv_whole, kv_split, (child_a, child_b)


def _assert_same(results, kv_whole, kv_split, case):
    tol = tolerance(getattr(torch, case.dtype))
    for whole, split, (ref_o, ref_lse) in results:
        if case.return_lse:
            (whole, whole_lse), (split, split_lse) = whole, split
            torch.testing.assert_close(split_lse, whole_lse, rtol=1e-5, atol=1e-5)
            fin = torch.isfinite(ref_lse)
            assert torch.equal(torch.isfinite(split_lse), fin)
            assert (split_lse.double()[fin] - ref_lse[fin]).abs().max() <= 1e-4
        assert relative_error(split, whole.double()) <= tol
        assert relative_error(split.reshape(ref_o.shape), ref_o) <= tol
    for (kw, vw), (ks, vs) in zip(kv_whole, kv_split):
        assert torch.equal(torch.nan_to_num(kw, nan=7.0), torch.nan_to_num(ks, nan=7.0))
        assert torch.equal(torch.nan_to_num(vw, nan=7.0), torch.nan_to_num(vs, nan=7.0))


@pytest.mark.parametrize("seed", range(30))
def test_children_concatenated_equal_whole_batch(seed):
    case = _random_case(seed)
    results, kv_whole, kv_split, _ = _run_whole_and_split(case)
    _assert_same(results, kv_whole, kv_split, case)


def test_extend_cut_is_exercised_and_balances_tokens():
    case = AttnCase(ForwardMode.EXTEND, ((4, 2), (0, 6), (10, 3)), page_size=4, sliding_window=3, return_lse=True)
    results, kv_whole, kv_split, (a, b) = _run_whole_and_split(case)
    _assert_same(results, kv_whole, kv_split, case)
    assert (a.num_tokens, b.num_tokens) == (6, 5)
    rows = case.requests
    assert a.seq_lens_cpu.tolist() == [6, 4] and b.seq_lens_cpu.tolist() == [6, 13]
    assert a.extend_prefix_lens_cpu.tolist() == [4, 0] and a.extend_seq_lens_cpu.tolist() == [2, 4]
    assert b.extend_prefix_lens_cpu.tolist() == [4, 10] and b.extend_seq_lens_cpu.tolist() == [2, 3]
    assert b.extend_prefix_lens.tolist() == [4, 10] and b.extend_seq_lens.tolist() == [2, 3]
    assert a.extend_start_loc.tolist() == [0, 2] and b.extend_start_loc.tolist() == [0, 2]
    assert b.positions.tolist() == [4, 5, 10, 11, 12] and a.positions.tolist() == [4, 5, 0, 1, 2, 3]
    assert a.seq_lens_sum == 10 and b.seq_lens_sum == 19 and len(rows) == 3
    assert a.req_pool_indices[1] == b.req_pool_indices[0]  # the cut request lives in both


def test_without_cut_the_nearer_boundary_is_used():
    assert compute_tbo_split(ForwardMode.EXTEND, [2, 6, 3]) == TboSplit(1, 6, 4)
    assert compute_tbo_split(ForwardMode.EXTEND, [2, 6, 3], allow_cut=False) == TboSplit(2, 8)
    assert compute_tbo_split(ForwardMode.EXTEND, [5, 6, 3], allow_cut=False) == TboSplit(1, 5)
    assert compute_tbo_split(ForwardMode.EXTEND, [3, 3]) == TboSplit(1, 3)
    assert compute_tbo_split(ForwardMode.EXTEND, [0, 9]) == TboSplit(1, 5, 5)
    assert compute_tbo_split(ForwardMode.EXTEND, [0, 9], allow_cut=False) is None
    assert compute_tbo_split(ForwardMode.DECODE, [1] * 5) == TboSplit(3, 3)
    assert compute_tbo_split(ForwardMode.TARGET_VERIFY, [4] * 4) == TboSplit(2, 8)
    assert compute_tbo_split(ForwardMode.DECODE, [1]) is None
    assert compute_tbo_split(ForwardMode.IDLE, []) is None
    case = AttnCase(ForwardMode.EXTEND, ((4, 2), (0, 6), (10, 3)))
    results, kv_whole, kv_split, (a, b) = _run_whole_and_split(case, allow_cut=False)
    _assert_same(results, kv_whole, kv_split, case)
    assert (a.batch_size, b.batch_size, a.num_tokens) == (2, 1, 8)


def test_verify_masks_are_split_per_request():
    case = AttnCase(ForwardMode.TARGET_VERIFY, ((3, 2), (5, 2), (1, 2)))
    env = make_env(case)
    a, b = split_batch(env.batch)
    spec = env.batch.spec_info
    full = spec.custom_mask
    assert torch.equal(torch.cat([a.spec_info.custom_mask, b.spec_info.custom_mask]), full)
    assert a.spec_info.mask_indptr.tolist() == [0, 10, 24] and b.spec_info.mask_indptr.tolist() == [0, 6]
    assert a.spec_info.custom_mask.numel() == 24


def test_bad_input_is_refused():
    env = make_env(AttnCase(ForwardMode.DECODE, ((3, 1), (4, 1), (5, 1))))
    ctx = env.ctx
    with pytest.raises(InvalidArgumentError, match="children"):
        TboAttnBackend(TorchNativeBackend(ctx), [TorchNativeBackend(ctx)])
    other = make_env(AttnCase(ForwardMode.DECODE, ((3, 1),), page_size=16)).ctx
    with pytest.raises(InvalidArgumentError, match="page_size"):
        TboAttnBackend(TorchNativeBackend(ctx), [TorchNativeBackend(ctx), TorchNativeBackend(other)])
    fill7 = type("Fill7", (TorchNativeBackend,), {"get_cuda_graph_seq_len_fill_value": lambda self: 7})
    with pytest.raises(InvalidArgumentError, match="fill value"):
        TboAttnBackend(TorchNativeBackend(ctx), [TorchNativeBackend(ctx), fill7(ctx)])
    tbo = _tbo(ctx)
    tbo.init_cuda_graph_state(8, 8)
    b = env.batch
    for bs in (3, 1):
        with pytest.raises(InvalidArgumentError, match="even"):
            tbo.capture_cuda_graph_metadata(
                CudaGraphStep(
                    forward_mode=ForwardMode.DECODE, bs=bs, req_pool_indices=b.req_pool_indices, seq_lens=b.seq_lens
                )
            )
    with pytest.raises(InvalidArgumentError, match="cut_len"):
        split_forward_batch(b, TboSplit(1, 1, 1))
    pool = MHATokenToKVPool(32, 1, torch.float32, 2, 32, 1)
    with pytest.raises(InvalidArgumentError, match="token_to_kv_pool"):
        TboAttnBackend(
            TorchNativeBackend(ctx),
            [TorchNativeBackend(ctx), TorchNativeBackend(type(ctx)(**{**ctx.__dict__, "token_to_kv_pool": pool}))],
        )


def test_unsplittable_batch_leaves_no_children():
    env = make_env(AttnCase(ForwardMode.DECODE, ((3, 1),)))
    tbo = _tbo(env.ctx)
    tbo.init_forward_metadata(env.batch)
    assert tbo.child_batches is None


def _graph_check(case: AttnCase, sizes, device_graphs=None, rtol=1e-5):
    """Through CudaGraphRunner: the TBO backend's capture/replay split the graph arguments, the layers
    run child A then child B on the split static batch; the real rows equal the eager whole batch."""
    env = make_env(case)
    layers = [make_layer(case, i) for i in range(case.num_layers)]
    gen = torch.Generator().manual_seed(3)
    per_layer = [layer_inputs(env, i, gen) for i in range(case.num_layers)]
    inputs = {n: torch.stack([x[n] for x in per_layer], dim=1) for n in ("q", "k", "v")}
    pool = env.kv_pool
    kv0 = [(pool.get_key_buffer(i).clone(), pool.get_value_buffer(i).clone()) for i in range(case.num_layers)]
    eager = TorchNativeBackend(env.ctx)
    env.batch.attn_backend = eager
    eager.init_forward_metadata(env.batch)
    want = torch.stack([layer(x["q"], x["k"], x["v"], env.batch) for layer, x in zip(layers, per_layer)], dim=1)
    for i, (k, v) in enumerate(kv0):
        pool.get_key_buffer(i).copy_(k)
        pool.get_value_buffer(i).copy_(v)
    tbo = _tbo(env.ctx)

    def run_layers(batch, x):
        a, b = split_batch(batch)
        a.attn_backend, b.attn_backend = tbo.children
        t = a.num_tokens
        outs = []
        for i, layer in enumerate(layers):
            parts = [
                layer(x["q"][rows, i], x["k"][rows, i], x["v"][rows, i], child)
                for child, rows in ((a, slice(0, t)), (b, slice(t, None)))
            ]
            outs.append(torch.cat(parts))
        return torch.stack(outs, dim=1)

    nd = case.requests[0].extend_len if case.mode.is_target_verify() else None
    shapes = {n: (tuple(t.shape[1:]), t.dtype) for n, t in inputs.items()}
    runner = CudaGraphRunner(tbo, sizes, run_layers, shapes, num_draft_tokens=nd, use_cuda_graph=device_graphs)
    got = runner.run(env.batch, inputs)
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY])
def test_graph_capture_replay_split_equals_whole(mode):
    d = 1 if mode is ForwardMode.DECODE else 3
    _graph_check(AttnCase(mode, ((7, d), (0, d), (12, d)), page_size=4, sinks=False), [2, 4])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY])
def test_graph_capture_replay_split_equals_whole_on_gpu(mode):
    d = 1 if mode is ForwardMode.DECODE else 3
    case = AttnCase(mode, ((700, d), (0, d), (120, d), (33, d), (5, d)), page_size=16, head_dim=64, device="cuda")
    _graph_check(case, [2, 4, 8])
