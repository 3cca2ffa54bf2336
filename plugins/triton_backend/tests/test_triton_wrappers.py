"""The backend under attn-core's wrappers (interpreter): the CUDA-graph runner (capture/replay
metadata path, batches padded to captured sizes) and the generic multi-step draft wrapper (topk 1
and 4, page sizes 1 and 16, eager and graph paths), against the float64 oracle and eager runs.
The GPU versions of both run in core's test files (`-k triton`) with real CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from triton_helpers import factory as factory_with
from triton_helpers import requires_interpreter, small_split_factory

from attn_core.batching.tbo_split import TboSplit, split_forward_batch
from attn_core.contract.context import BackendContext
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.layer import AttentionLayer
from attn_core.engine.graph_runner import CudaGraphRunner
from attn_core.memory import MHATokenToKVPool, PagedTokenAllocator, ReqToTokenPool
from attn_core.testing.batch_builder import build_forward_batch
from attn_core.testing.harness import AttnCase, layer_inputs, make_env, make_layer, reference_for_layer
from attn_core.testing.reference import reference_attention, relative_error, tolerance
from attn_core.wrappers.multi_step_draft import MultiStepDraftBackend, allocate_draft_slots

pytestmark = requires_interpreter


# ---- graph runner ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "case",
    [
        AttnCase(ForwardMode.DECODE, ((7, 1), (0, 1), (30, 1), (12, 1), (3, 1)), page_size=16),
        AttnCase(ForwardMode.TARGET_VERIFY, ((5, 3), (0, 3), (11, 3)), page_size=4),
    ],
    ids=["decode", "verify"],
)
def test_graph_runner_padded_batches(case):
    env = make_env(case)
    layers = [make_layer(case, i) for i in range(case.num_layers)]
    gen = torch.Generator().manual_seed(5)
    per_layer = [layer_inputs(env, i, gen) for i in range(case.num_layers)]
    inputs = {n: torch.stack([x[n] for x in per_layer], dim=1) for n in ("q", "k", "v")}

    def run_layers(batch, inp):
        return torch.stack(
            [layer(inp["q"][:, i], inp["k"][:, i], inp["v"][:, i], batch) for i, layer in enumerate(layers)], dim=1
        )

    shapes = {n: (tuple(t.shape[1:]), t.dtype) for n, t in inputs.items()}
    nd = case.requests[0].extend_len if case.mode.is_target_verify() else None
    factory = small_split_factory()
    runner = CudaGraphRunner(factory(env.ctx), [2, 4, 8], run_layers, shapes, num_draft_tokens=nd, use_cuda_graph=False)
    b = env.batch
    out = runner.run(b, inputs)  # the whole batch, padded to a captured size, against the oracle
    for i, layer in enumerate(layers):
        ref, _ = reference_for_layer(env, layer, per_layer[i])
        assert relative_error(out[:, i].reshape(ref.shape), ref) <= tolerance(torch.float32)
    per = b.num_tokens // b.batch_size
    eager = factory(env.ctx)
    for n in (1, 2, 3):  # sub-batches padded to 2, 2, 4: same as eager metadata
        sub, _ = split_forward_batch(b, TboSplit(n, n * per))
        sub_inputs = {k: v[: n * per] for k, v in inputs.items()}
        got = runner.run(sub, sub_inputs)
        sub.attn_backend = eager
        eager.init_forward_metadata(sub)
        torch.testing.assert_close(got, run_layers(sub, sub_inputs), rtol=1e-5, atol=1e-5)


# ---- multi-step draft wrapper ------------------------------------------------------------------
HQ, HKV, D, LAYERS = 4, 2, 16, 1


def _draft_env(lens, page_size, topk, steps, max_bs):
    gen = torch.Generator().manual_seed(page_size * 10 + topk)
    ps, bs = page_size, len(lens)
    pages = sum(-(-n // ps) + 1 for n in lens) + bs * topk * (-(-(ps + steps) // ps)) + 2
    r2t = ReqToTokenPool(bs + 1, max(lens) + 4)
    allocator = PagedTokenAllocator(pages * ps, ps)
    kv = MHATokenToKVPool(pages * ps, ps, torch.float32, HKV, D, LAYERS)
    batch = build_forward_batch(
        "EXTEND", [(n, 0) for n in lens], req_to_token_pool=r2t, allocator=allocator, token_to_kv_pool=kv
    )
    rows = batch.req_pool_indices.tolist()
    cached = []
    for layer in range(LAYERS):
        kb, vb = kv.get_key_buffer(layer), kv.get_value_buffer(layer)
        kb.fill_(float("nan"))
        vb.fill_(float("nan"))
        per_req = []
        for row, n in zip(rows, lens):
            slots = r2t.req_to_token[row, :n].long()
            kb[slots], vb[slots] = torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen)
            per_req.append((kb[slots].clone(), vb[slots].clone()))
        cached.append(per_req)
    loc = allocate_draft_slots(allocator, r2t, rows, lens, topk, steps)
    ctx = BackendContext(
        device="cpu",
        dtype=torch.float32,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        page_size=ps,
        max_batch_size=max_bs,
        max_context_len=max(lens) + 4,
        req_to_token_pool=r2t,
        token_to_kv_pool=kv,
        speculative_num_steps=steps,
        speculative_topk=topk,
    )
    return ctx, kv, rows, cached, loc


def _step_inputs(n_rows, steps, seed):
    g = torch.Generator().manual_seed(seed)
    return [
        [tuple(torch.randn(n_rows, h, D, generator=g) for h in (HQ, HKV, HKV)) for _ in range(LAYERS)]
        for _ in range(steps)
    ]


def _run_steps(batches, inputs, layers, pad_to=None):
    outs = []
    for s, batch in enumerate(batches):
        row = []
        for layer, (q, k, v) in zip(layers, inputs[s]):
            if pad_to is not None:
                q, k, v = (torch.cat([x, x.new_zeros((pad_to - x.shape[0], *x.shape[1:]))]) for x in (q, k, v))
            row.append(layer(q, k, v, batch))
        outs.append(row)
    return outs


@pytest.mark.parametrize("topk,page_size", [(1, 16), (4, 16), (4, 1)])
def test_multi_step_draft_eager_and_graph(topk, page_size):
    steps, lens = 2, [5, 16, 0, 23]
    ctx, kv, rows, cached, loc = _draft_env(lens, page_size, topk, steps, max_bs=6)
    factory = factory_with()  # default splits: few interpreter programs for these many rows
    layers = [AttentionLayer(i, HQ, HKV, D, scaling=D**-0.5 * 1.2) for i in range(LAYERS)]
    n_rows = len(lens) * topk
    inputs = _step_inputs(n_rows, steps, seed=7)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    eager = MultiStepDraftBackend(lambda c, s: factory(c), topk, steps, ctx)
    outs = _run_steps(eager.init_forward_metadata(torch.tensor(rows), lens_t, loc, lens_t), inputs, layers)
    for s in range(steps):  # each (request, branch) row: cached keys + its branch's drafts of steps 0..s
        for li, layer in enumerate(layers):
            got = outs[s][li].reshape(-1, HQ, D)
            for b, L in enumerate(lens):
                for j in range(topk):
                    v = b * topk + j
                    keys = torch.cat([cached[li][b][0], torch.stack([inputs[t][li][1][v] for t in range(s + 1)])])
                    vals = torch.cat([cached[li][b][1], torch.stack([inputs[t][li][2][v] for t in range(s + 1)])])
                    q = inputs[s][li][0][v : v + 1]
                    ref, _ = reference_attention(q, keys, vals, q_positions=torch.tensor([L + s]), scale=layer.scaling)
                    assert relative_error(got[v : v + 1], ref) <= tolerance(torch.float32), (s, li, b, j)

    graph = MultiStepDraftBackend(lambda c, s: factory(c), topk, steps, ctx)
    capture_bs = 6
    graph.init_draft_graph_state(capture_bs)
    graph.capture_draft_graph_metadata(capture_bs)
    batches = graph.replay_draft_graph_metadata(capture_bs, torch.tensor(rows), lens_t, loc, lens_t)
    got = _run_steps(batches, inputs, layers, pad_to=capture_bs * topk)
    for s in range(steps):
        for li in range(LAYERS):
            torch.testing.assert_close(got[s][li][:n_rows], outs[s][li], rtol=1e-5, atol=1e-5)


def test_backend_skips_page_aligned_draft_copies():
    env = make_env(AttnCase("DECODE", [(3, 1)]))
    assert small_split_factory()(env.ctx).needs_page_aligned_draft_kv() is False
