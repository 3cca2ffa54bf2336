"""torch_native against the float64 oracle on random batches, every mode and feature it declares."""

import random

import pytest
import torch

from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import graph_padding
from attn_core.testing.batch_builder import RequestShape
from attn_core.testing.harness import AttnCase, assert_case, layer_inputs, make_env, make_layer

MODES = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND]


def random_case(seed: int, device: str = "cpu", scale: int = 1) -> AttnCase:
    rng = random.Random(seed)
    mode = rng.choice(MODES)
    bs = rng.randint(1, 5)
    long = 30 * scale
    if mode is ForwardMode.DECODE:
        reqs = [RequestShape(rng.choice([0, 1, rng.randint(0, long)]), 1) for _ in range(bs)]
    elif mode is ForwardMode.TARGET_VERIFY:
        d = rng.randint(1, 6)
        reqs = [RequestShape(rng.randint(0, long), d) for _ in range(bs)]
    else:
        reqs = [
            RequestShape(rng.choice([0, rng.randint(0, long)]), rng.choice([1, rng.randint(0, 12 * scale)]))
            for _ in range(bs)
        ]
        if mode is ForwardMode.MIXED:
            reqs.append(RequestShape(rng.randint(1, long), 1))
        if sum(r.extend_len for r in reqs) == 0:
            reqs[0] = RequestShape(reqs[0].prefix_len, 3)
    mla = rng.random() < 0.2
    hkv = rng.choice([1, 2, 4])
    cross = not mla and mode is not ForwardMode.TARGET_VERIFY and rng.random() < 0.15
    if cross:
        reqs = [RequestShape(r.prefix_len, r.extend_len, rng.randint(1, 9)) for r in reqs]
    return AttnCase(
        mode=mode,
        requests=tuple(reqs),
        num_q_heads=hkv * rng.choice([1, 2, 4]) if not mla else rng.choice([1, 4]),
        num_kv_heads=hkv,
        head_dim=rng.choice([16, 32, 64]),
        dtype=rng.choice(["float32", "float32", "bfloat16", "float16"]),
        page_size=rng.choice([1, 1, 16, 64]),
        arch="mla" if mla else "mha",
        kv_lora_rank=32 if mla else 0,
        qk_rope_head_dim=16 if mla else 0,
        sliding_window=rng.choice([None, None, rng.randint(1, 20)]) if not cross else None,
        logit_cap=rng.choice([0.0, 0.0, 3.0]),
        sinks=rng.random() < 0.25,
        cross_attention=cross,
        return_lse=rng.random() < 0.4,
        device=device,
        seed=seed,
    )


@pytest.mark.parametrize("seed", range(40))
def test_random_cases_match_reference(seed):
    assert_case(TorchNativeBackend, random_case(seed))


def test_small_score_budget_chunks_queries_without_changing_results():
    case = AttnCase(ForwardMode.EXTEND, ((5, 17), (0, 9)), sliding_window=6, return_lse=True)
    assert_case(lambda ctx: TorchNativeBackend(ctx, max_score_bytes=1), case)


def test_idle_returns_empty():
    env = make_env(AttnCase(ForwardMode.IDLE, ()))
    backend = TorchNativeBackend(env.ctx)
    env.batch.attn_backend = backend
    backend.init_forward_metadata(env.batch)
    layer = make_layer(env.case, 0)
    out, lse = layer(torch.empty(0, 4, 32), torch.empty(0, 2, 32), torch.empty(0, 2, 32), env.batch, return_lse=True)
    assert out.shape == (0, 4 * 32) and lse.shape == (0, 4)


def _pad(t: torch.Tensor, n: int, value) -> torch.Tensor:
    return torch.cat([t, torch.full((n - t.shape[0], *t.shape[1:]), value, dtype=t.dtype, device=t.device)])


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY])
def test_graph_capture_replay_metadata_equals_eager(mode):
    """Capture for a padded batch size with dummy inputs, replay with the real (padded) batch: the real
    rows equal eager."""
    d = 1 if mode is ForwardMode.DECODE else 3
    case = AttnCase(mode, ((7, d), (0, d), (12, d)), page_size=16, sinks=True)
    env = make_env(case)
    b = env.batch
    layer = make_layer(case, 0)
    inputs = layer_inputs(env, 0, torch.Generator().manual_seed(5))
    eager = TorchNativeBackend(env.ctx)
    b.attn_backend = eager
    eager.init_forward_metadata(b)
    k0, v0 = env.kv_pool.get_key_buffer(0).clone(), env.kv_pool.get_value_buffer(0).clone()
    want = layer(inputs["q"], inputs["k"], inputs["v"], b, sinks=inputs["sinks"])
    env.kv_pool.get_key_buffer(0).copy_(k0)
    env.kv_pool.get_value_buffer(0).copy_(v0)

    graph = TorchNativeBackend(env.ctx)
    cap_bs = 5
    graph.init_cuda_graph_state(cap_bs, cap_bs * d)
    pad = graph_padding(mode, b.batch_size, [cap_bs], graph.get_cuda_graph_seq_len_fill_value(), d)
    spec = b.spec_info
    if spec is not None:  # padding rows get an all-visible mask of their keys
        per_row = d * pad.seq_len
        spec = type(spec)(
            num_draft_tokens=d,
            custom_mask=torch.cat([spec.custom_mask, torch.ones(pad.num_padding * per_row, dtype=torch.bool)]),
            mask_indptr=torch.cat(
                [spec.mask_indptr, spec.mask_indptr[-1] + torch.arange(1, pad.num_padding + 1) * per_row]
            ),
        )
    zeros = torch.zeros(cap_bs, dtype=torch.int64)
    # the SGLang-named entry points (positional, as engines call them)
    graph.init_forward_metadata_capture_cuda_graph(
        cap_bs, pad.num_tokens, zeros, torch.full((cap_bs,), pad.seq_len, dtype=torch.int32), None, mode, spec
    )
    seq = _pad(b.seq_lens, cap_bs, pad.seq_len)
    graph.init_forward_metadata_replay_cuda_graph(
        cap_bs, _pad(b.req_pool_indices, cap_bs, 0), seq, int(seq.sum()), None, mode, spec, seq.cpu()
    )
    b.attn_backend = graph
    padded = type(b)(**{**b.__dict__, "batch_size": cap_bs, "out_cache_loc": _pad(b.out_cache_loc, cap_bs * d, 0)})
    if mode.is_target_verify():
        padded.extend_num_tokens = cap_bs * d
    got = layer(
        _pad(inputs["q"], cap_bs * d, 0.0),
        _pad(inputs["k"], cap_bs * d, 0.0),
        _pad(inputs["v"], cap_bs * d, 0.0),
        padded,
        sinks=inputs["sinks"],
    )
    torch.testing.assert_close(got[: 3 * d], want, rtol=1e-5, atol=1e-6)  # widths differ: not bitwise


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", range(12))
def test_random_cases_on_cuda(seed):
    assert_case(TorchNativeBackend, random_case(seed, device="cuda", scale=20))
