"""The backend's wiring on the CPU over a stand-in for FlashInfer's wrappers (`fake_flashinfer.py`: plain
float64, FlashInfer's documented mask/window/LSE conventions): every layer gets the key lists, query
layouts and masks it needs, checked by attn-core's harness against its float64 reference. Cases on the
plain paths check the stand-in itself; then the sliding-window KV pool and chunked local attention
(issue 18), over several steps. Public plans only (`lean_replan=False`: the lean re-plan reads FlashInfer's
internals). Skipped where the real flashinfer is importable (the GPU tests run the real thing there).
"""

from __future__ import annotations

import importlib.util

import pytest

from attn_core.testing.harness import AttnCase, assert_case

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is not None, reason="the real flashinfer is installed"
)
# the `factory` fixture (conftest.py): FlashInferBackend over fake_flashinfer.py, allowed on the CPU

BASE = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="float16", device="cpu")

CASES = {
    # the plain paths: the stand-in against the reference
    "plain-extend-prefix": AttnCase("EXTEND", [(0, 9), (13, 5), (6, 1)], page_size=4, return_lse=True, **BASE),
    "plain-decode-window": AttnCase("DECODE", [(20, 1), (0, 1), (7, 1)], sliding_window=5, **BASE),
    "plain-mixed-window-prefix": AttnCase("MIXED", [(20, 1), (9, 6), (0, 5)], page_size=4, sliding_window=4, **BASE),
    # sliding-window KV pool: window layers (even) from the window pool, full layers (odd) as usual
    "window_pool-decode": AttnCase(
        "DECODE",
        [(30, 1), (0, 1), (9, 1)],
        sliding_window=6,
        window_even_layers_only=True,
        window_pool=True,
        steps=((0,), (1, 2)),
        **BASE,
    ),
    "window_pool-extend-page4": AttnCase(
        "EXTEND",
        [(25, 7), (0, 11), (5, 1), (12, 0)],
        page_size=4,
        sliding_window=5,
        window_even_layers_only=True,
        window_pool=True,
        return_lse=True,
        steps=((0, 2), (1, 3)),
        **BASE,
    ),
    "window_pool-mixed": AttnCase(
        "MIXED", [(21, 1), (4, 9), (0, 3)], sliding_window=7, window_pool=True, logit_cap=5.0, **BASE
    ),
    "window_pool-verify-causal": AttnCase(
        "TARGET_VERIFY", [(17, 3), (2, 3)], page_size=4, sliding_window=4, window_pool=True, custom_mask=False, **BASE
    ),
    # chunked local attention: chunk on and off the page size, interleaved with full layers
    "chunked_local-extend-page4-on": AttnCase(
        "EXTEND",
        [(0, 13), (9, 10), (6, 0), (3, 1)],
        page_size=4,
        attention_chunk_size=8,
        return_lse=True,
        steps=((0, 2), (1, 3)),
        **BASE,
    ),
    "chunked_local-extend-page4-off": AttnCase(
        "EXTEND", [(0, 13), (9, 10), (3, 1)], page_size=4, attention_chunk_size=5, chunk_even_layers_only=True, **BASE
    ),
    "chunked_local-decode-page4": AttnCase(
        "DECODE",
        [(16, 1), (0, 1), (22, 1), (7, 1)],
        page_size=4,
        attention_chunk_size=8,
        steps=((0, 1), (2, 3)),
        **BASE,
    ),
    "chunked_local-decode-off": AttnCase(
        "DECODE", [(16, 1), (0, 1), (22, 1)], page_size=4, attention_chunk_size=3, **BASE
    ),
    "chunked_local-mixed": AttnCase(
        "MIXED", [(20, 1), (5, 9), (0, 4)], attention_chunk_size=4, chunk_even_layers_only=True, logit_cap=5.0, **BASE
    ),
    "chunked_local-verify-causal": AttnCase(
        "TARGET_VERIFY", [(14, 3), (1, 3)], page_size=2, attention_chunk_size=4, custom_mask=False, **BASE
    ),
    "chunked_local-hnd-page4": AttnCase(
        "EXTEND", [(0, 13), (9, 10), (3, 1)], page_size=4, attention_chunk_size=8, kv_layout="HND", **BASE
    ),
    "chunked_local-encoder": AttnCase("EXTEND", [(9, 5, 3), (0, 4, 6)], page_size=4, attention_chunk_size=4, **BASE),
}


@pytest.mark.parametrize("name", list(CASES))
def test_layers_get_the_keys_they_need(factory, name):
    assert_case(factory, CASES[name])


@pytest.mark.parametrize(
    "case",
    [
        AttnCase("TARGET_VERIFY", [(5, 3), (9, 3)], sliding_window=4, window_pool=True, **BASE),
        AttnCase("TARGET_VERIFY", [(5, 3), (9, 3)], attention_chunk_size=4, **BASE),
    ],
    ids=["window_pool", "chunked_local"],
)
def test_verify_masks_and_graph_capture_are_refused(factory, case):
    """A tree-masked verify step and a CUDA-graph capture: typed refusals before any plan or KV write;
    a layer whose chunk size is not the context's: a typed error before its KV write."""
    import torch

    from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
    from attn_core.contract.graph_step import CudaGraphStep
    from attn_core.contract.layer import AttentionLayer
    from attn_core.testing.harness import layer_inputs, make_env

    env = make_env(case)
    backend = factory(env.ctx)
    with pytest.raises(UnsupportedFeatureError, match="custom mask"):
        backend.init_forward_metadata(env.batch)
    backend.init_cuda_graph_state(4, 4)
    b = env.batch
    step = CudaGraphStep(
        forward_mode=b.forward_mode.DECODE, bs=2, req_pool_indices=b.req_pool_indices, seq_lens=b.seq_lens, num_tokens=2
    )
    with pytest.raises(UnsupportedFeatureError, match="CUDA graphs"):
        backend.capture_cuda_graph_metadata(step)
    if case.attention_chunk_size is None:
        return
    b.spec_info.custom_mask = b.spec_info.mask_indptr = None
    b.attn_backend = backend
    backend.init_forward_metadata(b)
    other = AttentionLayer(0, 4, 2, 64, attention_chunk_size=8)
    inputs = layer_inputs(env, 0, torch.Generator().manual_seed(0), b, case.step_requests()[0])
    before = env.kv_pool.get_key_buffer(0).clone()
    with pytest.raises(InvalidArgumentError, match="attention_chunk_size"):
        other(inputs["q"], inputs["k"], inputs["v"], b)
    torch.testing.assert_close(env.kv_pool.get_key_buffer(0), before, rtol=0, atol=0, equal_nan=True)  # nothing written


def test_hnd_pool_with_chunks_off_the_pages_is_refused(factory):
    from attn_core.contract.errors import UnsupportedFeatureError
    from attn_core.testing.harness import make_env

    env = make_env(AttnCase("EXTEND", [(0, 13), (9, 10)], page_size=4, attention_chunk_size=5, kv_layout="HND", **BASE))
    with pytest.raises(UnsupportedFeatureError, match="HND at page_size 4"):
        factory(env.ctx).init_forward_metadata(env.batch)


PATHS = {
    "decode": (AttnCase("DECODE", [(20, 1), (7, 1)], **BASE), "decode"),
    "extend-fresh": (AttnCase("EXTEND", [(0, 9), (0, 5)], **BASE), "ragged"),
    "extend-prefix": (AttnCase("EXTEND", [(0, 9), (13, 5)], page_size=4, **BASE), "ragged + paged prefix"),
    "extend-prefix-window": (AttnCase("EXTEND", [(0, 9), (13, 5)], sliding_window=4, **BASE), "paged causal (window)"),
    "verify-chain": (
        AttnCase("TARGET_VERIFY", [(17, 3), (2, 3)], page_size=4, custom_mask=False, **BASE),
        "paged causal",
    ),
    "chunked-local-decode": (
        AttnCase("DECODE", [(20, 1), (7, 1)], attention_chunk_size=8, **BASE),
        "decode (chunked local)",
    ),
}


@pytest.mark.parametrize("name", list(PATHS))
def test_each_layer_reports_its_plans_path(factory, name):
    """The plan a layer runs is made once per step per layer setting (`Step.plan_of` hands the same
    object to every layer of that setting), and its `path` is what attn-core's debug switch reports."""
    import torch

    from attn_core.contract import debug_paths
    from attn_core.testing.harness import layer_inputs, make_env, make_layer

    case, path = PATHS[name]
    env = make_env(case)
    backend = factory(env.ctx)
    env.batch.attn_backend = backend
    backend.init_forward_metadata(env.batch)
    layers = [make_layer(case, i) for i in range(2)]
    gen = torch.Generator().manual_seed(0)
    with debug_paths.recording() as calls:
        for layer in layers:
            x = layer_inputs(env, layer.layer_id, gen)
            backend.forward(x["q"], x["k"], x["v"], layer, env.batch)
    assert [c.path for c in calls] == [path, path]
    step = backend.forward_metadata
    assert step.plan_of(layers[0]) is step.plan_of(layers[1])


def test_a_split_mixed_layer_reports_both_plans(factory):
    import torch

    from attn_core.contract import debug_paths
    from attn_core.testing.harness import layer_inputs, make_env, make_layer

    env = make_env(AttnCase("MIXED", [(20, 1), (9, 6), (0, 5)], page_size=4, **BASE))
    backend = factory(env.ctx, mixed_split=True)
    env.batch.attn_backend = backend
    backend.init_forward_metadata(env.batch)
    layer = make_layer(env.case, 0)
    x = layer_inputs(env, 0, torch.Generator().manual_seed(0))
    with debug_paths.recording() as calls:
        backend.forward(x["q"], x["k"], x["v"], layer, env.batch)
    assert [c.path for c in calls] == ["decode + ragged + paged prefix (mixed split)"]


@pytest.mark.parametrize("mode", ["EXTEND", "DECODE"])
def test_save_kv_cleans_the_inputs_its_ragged_pass_reads(factory, mode):
    """The engine's pattern (`save_kv`, then `forward(..., save_kv_cache=False)` with the same k / v): where
    the layer's plan reads the new K/V from k and v (the ragged pass of an extend), a token whose V is not
    finite is cleaned there too, in place (K = NaN, V = 0, as the pool stores it); a decode reads the pool
    only, and the inputs are left as given."""
    import math

    import torch

    from attn_core.contract.layer import AttentionLayer
    from attn_core.testing.harness import layer_inputs, make_env

    reqs = [(0, 6), (5, 4)] if mode == "EXTEND" else [(6, 1), (9, 1)]
    env = make_env(AttnCase(mode, reqs, page_size=4, **BASE))
    backend = factory(env.ctx)
    b = env.batch
    b.attn_backend = backend
    backend.init_forward_metadata(b)
    inputs = layer_inputs(env, 0, torch.Generator().manual_seed(0), b, env.case.step_requests()[0])
    k, v = inputs["k"], inputs["v"]
    v[1, 1, 3] = float("inf")
    k0, v0 = k.clone(), v.clone()
    backend.save_kv(k, v, AttentionLayer(0, 4, 2, 64), b)
    if mode == "EXTEND":
        assert torch.isnan(k[1, 1]).all() and (v[1, 1] == 0).all()
        k[1, 1], v[1, 1] = k0[1, 1], v0[1, 1]
    assert torch.equal(k, k0) and torch.equal(v, v0)  # no other row touched (and a decode: none)
    slot = int(b.out_cache_loc[1])
    assert torch.isnan(env.kv_pool.get_key_buffer(0)[slot, 1]).all() and not math.isinf(
        float(env.kv_pool.get_value_buffer(0)[slot, 1].abs().max())
    )
