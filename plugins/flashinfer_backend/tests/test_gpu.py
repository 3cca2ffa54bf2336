"""The FlashInfer backend on a CUDA GPU against the float64 reference: attn-core's conformance kit (every
declared capability, CUDA-graph capture/replay, bad inputs, refusals), random batches at page sizes 1 and
16 at realistic head counts, and graph replay at page size 16. Every test skips cleanly without CUDA or
without flashinfer-python.
"""

from __future__ import annotations

import random

import pytest
import torch

from attn_core.contract.capabilities import CudaGraphLevel
from attn_core.contract.forward_mode import ForwardMode
from attn_core.testing import ConformanceSuite
from attn_core.testing.compose import compose_requests
from attn_core.testing.graphs import graph_case_check
from attn_core.testing.harness import AttnCase, assert_case
from attn_core.testing.profile import profile_for
from attn_flashinfer.spec import SPEC

pytestmark = pytest.mark.gpu
REASON = SPEC.probe()
requires_gpu = pytest.mark.skipif(REASON is not None, reason=f"flashinfer backend cannot run here: {REASON}")


class TestConformanceOnCuda(ConformanceSuite):
    """attn-core's conformance kit on cuda at the quick sizes (skipped, with the probe's reason, where the
    backend cannot run)."""

    backend = "flashinfer"
    device = "cuda"
    quick = True


def _factory():
    from attn_flashinfer.backend import FlashInferBackend

    return FlashInferBackend


RANDOM_MODES = (
    ForwardMode.EXTEND,
    ForwardMode.DECODE,
    ForwardMode.MIXED,
    ForwardMode.TARGET_VERIFY,
    ForwardMode.DRAFT_EXTEND,
)


@requires_gpu
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", RANDOM_MODES, ids=[m.name for m in RANDOM_MODES])
def test_random_batches(mode, page_size, seed):
    """Random compositions (prefills, prefix hits, one-token rows, long requests) with GQA 32/8, bf16;
    seed 1 asks for the LSE, seed 2 adds a sliding window and a logit cap. The requests run as two
    steps on one backend, so the second step's wrappers are re-planned lean (replan.py)."""
    rng = random.Random(f"fi-{mode.name}-{page_size}-{seed}")
    reqs = compose_requests(rng.randint, mode, profile_for("cuda", True))
    extra = {1: dict(return_lse=True), 2: dict(sliding_window=rng.randint(1, 300), logit_cap=20.0)}.get(seed, {})
    cuts = [c for c in range(1, len(reqs)) if any(e for _, e in reqs[:c]) and any(e for _, e in reqs[c:])]
    cut = rng.choice(cuts) if cuts else 0  # each step keeps some new tokens
    steps = ((*range(cut),), (*range(cut, len(reqs)),)) if cut else ()
    case = AttnCase(
        mode,
        reqs,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        page_size=page_size,
        device="cuda",
        seed=seed,
        steps=steps,
        **extra,
    )
    assert_case(_factory(), case)


OTHER_LAYOUTS = {  # dtype, head dim, layer settings beyond the bf16 / head_dim 128 of the cases above
    "fp16-128": dict(dtype="float16", head_dim=128),
    "bf16-64": dict(dtype="bfloat16", head_dim=64),
    "bf16-256-window-cap": dict(dtype="bfloat16", head_dim=256, sliding_window=97, logit_cap=20.0),
}


@requires_gpu
@pytest.mark.parametrize(
    "mode", (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY), ids=lambda m: m.name
)
@pytest.mark.parametrize("layout", list(OTHER_LAYOUTS))
def test_random_batches_other_dtypes_and_head_dims(layout, mode):
    """fp16 and head dims 64 / 256 on random compositions at page size 16, GQA 16/4, LSE returned."""
    rng = random.Random(f"fi-{layout}-{mode.name}")
    reqs = compose_requests(rng.randint, mode, profile_for("cuda", True))
    case = AttnCase(
        mode,
        reqs,
        num_q_heads=16,
        num_kv_heads=4,
        page_size=16,
        device="cuda",
        return_lse=True,
        **OTHER_LAYOUTS[layout],
    )
    assert_case(_factory(), case)


@requires_gpu
@pytest.mark.parametrize("cross", [True, False], ids=["cross_attention", "encoder_self"])
@pytest.mark.parametrize("mode", (ForwardMode.EXTEND, ForwardMode.DECODE), ids=lambda m: m.name)
def test_encoder_decoder_batches_in_two_steps(mode, cross):
    """Encoder-decoder requests as two steps on one backend, so the second step re-plans lean: cross
    attention over the encoder tokens (paged at the pool's page size) and decoder self attention
    (indexed per token, behind the encoder tokens)."""
    rng = random.Random(f"fi-enc-{mode.name}-{cross}")
    reqs = [(rng.randint(0, 300), 1 if mode.is_decode() else rng.randint(1, 40), rng.randint(1, 200)) for _ in range(6)]
    case = AttnCase(
        mode,
        reqs,
        num_q_heads=16,
        num_kv_heads=4,
        head_dim=128,
        dtype="bfloat16",
        page_size=16,
        device="cuda",
        cross_attention=cross,
        steps=((0, 1, 2), (3, 4, 5)),
    )
    assert_case(_factory(), case)


WINDOW_POOL_CASES = {  # sliding-window KV pool (issue 18): window layers (even) in the window pool, full layers (odd)
    "decode-page16": dict(
        mode="DECODE", reqs=[(4095, 1), (0, 1), (1000, 1), (511, 1)], page_size=16, sliding_window=512
    ),
    "extend-page16-lse": dict(
        mode="EXTEND", reqs=[(3000, 500), (0, 700), (64, 1)], page_size=16, sliding_window=256, return_lse=True
    ),
    "mixed-page1-cap": dict(
        mode="MIXED", reqs=[(1200, 1), (300, 400), (0, 77)], page_size=1, sliding_window=97, logit_cap=20.0
    ),
    "verify-causal-page16": dict(
        mode="TARGET_VERIFY", reqs=[(900, 6), (5, 6)], page_size=16, sliding_window=64, custom_mask=False
    ),
    "draft_extend-page16": dict(mode="DRAFT_EXTEND", reqs=[(1000, 4), (200, 3)], page_size=16, sliding_window=128),
}


@requires_gpu
@pytest.mark.parametrize("name", list(WINDOW_POOL_CASES))
def test_window_pool_batches_in_two_steps(name):
    """Window layers read as window slots (`window_kv.py`, decode or causal paged prefill over the keys
    inside the window, per token), full layers as usual, over one metadata; released window keys are
    poisoned by the harness; two steps on one backend, so the second re-plans lean."""
    kw = dict(WINDOW_POOL_CASES[name])
    mode, reqs = kw.pop("mode"), kw.pop("reqs")
    steps = ((0,), (*range(1, len(reqs)),))
    case = AttnCase(
        mode,
        reqs,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        device="cuda",
        num_layers=2,
        window_even_layers_only=True,
        window_pool=True,
        steps=steps,
        **kw,
    )
    assert_case(_factory(), case)


CHUNKED_LOCAL_CASES = {  # chunked local attention (issue 18): chunk sizes on and off the page size, interleaved layers
    "extend-page16-chunk200": dict(
        mode="EXTEND", reqs=[(0, 1000), (1500, 513), (700, 0)], page_size=16, attention_chunk_size=200
    ),
    "extend-page16-chunk256-lse": dict(
        mode="EXTEND", reqs=[(300, 700), (0, 77)], page_size=16, attention_chunk_size=256, return_lse=True
    ),
    "decode-page16-chunk1000": dict(
        mode="DECODE", reqs=[(4095, 1), (0, 1), (8191, 1)], page_size=16, attention_chunk_size=1000
    ),
    "decode-page16-chunk512": dict(
        mode="DECODE", reqs=[(4095, 1), (511, 1), (1000, 1)], page_size=16, attention_chunk_size=512
    ),
    "mixed-page1-interleaved": dict(
        mode="MIXED",
        reqs=[(1200, 1), (300, 400), (0, 77)],
        page_size=1,
        attention_chunk_size=256,
        chunk_even_layers_only=True,
    ),
    "verify-causal-page16": dict(
        mode="TARGET_VERIFY", reqs=[(1020, 8), (5, 8)], page_size=16, attention_chunk_size=512, custom_mask=False
    ),
}


@requires_gpu
@pytest.mark.parametrize("name", list(CHUNKED_LOCAL_CASES))
def test_chunked_local_batches_in_two_steps(name):
    """Chunked local layers: DECODE from each request's chunk start, other modes as virtual requests
    (`local_kv.py`, causal paged prefill), per page or per token; two steps on one backend (lean re-plans)."""
    kw = dict(CHUNKED_LOCAL_CASES[name])
    mode, reqs = kw.pop("mode"), kw.pop("reqs")
    steps = ((0,), (*range(1, len(reqs)),))
    case = AttnCase(
        mode,
        reqs,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        device="cuda",
        num_layers=2,
        steps=steps,
        **kw,
    )
    assert_case(_factory(), case)


def _graph_case(mode, reqs, **kw):
    return AttnCase(
        mode,
        reqs,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        device="cuda",
        steps=((0, 1, 2), (3,), (4, 5)),
        cuda_graph_level=int(CudaGraphLevel.UNIFORM_BATCH),
        **kw,
    )


FP8_MODES = (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)
FP8_LAYOUTS = {  # fp8 (e4m3) KV caches with per-layer scales (the harness's FP8_SCALES), both q dtypes
    "fp8-bf16": dict(dtype="bfloat16", kv_dtype="float8_e4m3fn"),
    "fp8-fp16-window-cap": dict(dtype="float16", kv_dtype="float8_e4m3fn", sliding_window=97, logit_cap=20.0),
}


@requires_gpu
@pytest.mark.parametrize("mode", FP8_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("layout", list(FP8_LAYOUTS))
def test_random_batches_fp8_kv(layout, mode):
    """fp8 caches on random compositions at page size 16, GQA 32/8, d128, two steps (the second step
    re-plans lean), LSE returned: decode and paged prefill read fp8 with k_scale / v_scale, the ragged
    pass sees the new tokens as the cache holds them."""
    rng = random.Random(f"fi-{layout}-{mode.name}")
    reqs = compose_requests(rng.randint, mode, profile_for("cuda", True))
    cut = max(1, len(reqs) // 2)
    steps = ((*range(cut),), (*range(cut, len(reqs)),)) if len(reqs) > 1 else ()
    case = AttnCase(
        mode,
        reqs,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        device="cuda",
        return_lse=True,
        steps=steps,
        **FP8_LAYOUTS[layout],
    )
    assert_case(_factory(), case)


GRAPH_CASES = {
    "decode-page16-window": _graph_case(
        "DECODE", [(700, 1), (1, 1), (33, 1), (0, 1), (2000, 1), (15, 1)], page_size=16, sliding_window=100
    ),
    "decode-page1-logit_cap": _graph_case(
        "DECODE", [(70, 1), (1, 1), (333, 1), (0, 1), (900, 1), (16, 1)], logit_cap=5.0
    ),
    "verify-page16-mask": _graph_case(
        "TARGET_VERIFY", [(500, 4), (3, 4), (64, 4), (1, 4), (1500, 4), (17, 4)], page_size=16
    ),
    "verify-page16-causal": _graph_case(
        "TARGET_VERIFY", [(50, 3), (3, 3), (64, 3), (1, 3), (150, 3), (17, 3)], page_size=16, custom_mask=False
    ),
    "decode-page16-fp8": _graph_case(
        "DECODE", [(700, 1), (1, 1), (33, 1), (0, 1), (2000, 1), (15, 1)], page_size=16, kv_dtype="float8_e4m3fn"
    ),
    "verify-page16-mask-fp8": _graph_case(
        "TARGET_VERIFY", [(500, 4), (3, 4), (64, 4), (1, 4), (1500, 4), (17, 4)], page_size=16, kv_dtype="float8_e4m3fn"
    ),
}


@requires_gpu
@pytest.mark.parametrize("name", list(GRAPH_CASES))
def test_graph_replay_equals_eager_and_reference(name):
    from attn_core.testing.target import resolve_target

    check = graph_case_check(resolve_target(SPEC), GRAPH_CASES[name])
    check()


# ---- attn-core's generic multi-step draft wrapper over this backend ---------------------------------
DRAFT_HEADS, DRAFT_LAYERS = (16, 4), 2


def _draft_env(lens, page_size, topk, num_steps, seed):
    """Pools on the GPU with random cached K/V (NaN in every other slot), the draft slots, a context."""
    from attn_core.contract.context import BackendContext
    from attn_core.memory import MHATokenToKVPool, PagedTokenAllocator, ReqToTokenPool
    from attn_core.testing.batch_builder import build_forward_batch
    from attn_core.wrappers.multi_step_draft import allocate_draft_slots

    hq, hkv = DRAFT_HEADS
    gen = torch.Generator().manual_seed(seed)
    ps = page_size
    pages = sum(-(-n // ps) + 1 for n in lens) + len(lens) * topk * (-(-(ps + num_steps) // ps)) + 2
    r2t = ReqToTokenPool(len(lens) + 1, max(lens) + 4, "cuda")
    alloc = PagedTokenAllocator(pages * ps, ps, "cuda")
    kv = MHATokenToKVPool(pages * ps, ps, torch.bfloat16, hkv, 128, DRAFT_LAYERS, "cuda")
    batch = build_forward_batch(
        "EXTEND", [(n, 0) for n in lens], req_to_token_pool=r2t, allocator=alloc, token_to_kv_pool=kv
    )
    rows = batch.req_pool_indices.tolist()
    cached = []
    for layer in range(DRAFT_LAYERS):
        kb, vb = kv.get_key_buffer(layer), kv.get_value_buffer(layer)
        kb.fill_(float("nan"))
        vb.fill_(float("nan"))
        per_req = []
        for row, n in zip(rows, lens):
            slots = r2t.req_to_token[row, :n].long()
            k, v = (torch.randn(n, hkv, 128, generator=gen).to(torch.bfloat16).cuda() for _ in range(2))
            kb[slots], vb[slots] = k, v
            per_req.append((k, v))
        cached.append(per_req)
    loc = allocate_draft_slots(alloc, r2t, rows, lens, topk, num_steps)
    ctx = BackendContext(
        device="cuda",
        dtype=torch.bfloat16,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=128,
        page_size=ps,
        max_batch_size=8,
        max_context_len=max(lens) + 4,
        req_to_token_pool=r2t,
        token_to_kv_pool=kv,
        speculative_num_steps=num_steps,
        speculative_topk=topk,
    )
    return ctx, rows, cached, loc


def _draft_inputs(n_rows, num_steps, seed):
    hq, hkv = DRAFT_HEADS
    g = torch.Generator().manual_seed(seed)

    def rnd(h):
        return torch.randn(n_rows, h, 128, generator=g).to(torch.bfloat16).cuda()

    return [[(rnd(hq), rnd(hkv), rnd(hkv)) for _ in range(DRAFT_LAYERS)] for _ in range(num_steps)]


def _draft_layers():
    from attn_core.contract.layer import AttentionLayer

    hq, hkv = DRAFT_HEADS
    return [AttentionLayer(i, hq, hkv, 128, scaling=128**-0.5 * 1.2) for i in range(DRAFT_LAYERS)]


def _run_draft_steps(batches, inputs, pad_rows=None):
    outs = []
    for s, batch in enumerate(batches):
        per_layer = []
        for layer, (q, k, v) in zip(_draft_layers(), inputs[s]):
            if pad_rows is not None:
                q, k, v = (torch.cat([x, x.new_zeros((pad_rows - x.shape[0], *x.shape[1:]))]) for x in (q, k, v))
            per_layer.append(layer(q, k, v, batch))
        outs.append(per_layer)
    return outs


@requires_gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("topk", [1, 4])
def test_multi_step_draft_eager_and_graph(topk, page_size):
    """Every draft step of every branch against the float64 reference (eager), then the same round
    through CUDA graphs captured for a larger batch (padded) against the eager outputs."""
    msd = pytest.importorskip(
        "attn_core.wrappers.multi_step_draft", reason="attn-core's multi-step draft wrapper not installed"
    )
    from attn_core.testing.reference import reference_attention, relative_error, tolerance
    from attn_flashinfer.backend import FlashInferBackend

    lens, S = [500, 16, 131, 7, 64, 33], 3
    ctx, rows, cached, loc = _draft_env(lens, page_size, topk, S, seed=topk * 100 + page_size)
    pool = ctx.token_to_kv_pool
    kv0 = [(pool.get_key_buffer(i).clone(), pool.get_value_buffer(i).clone()) for i in range(DRAFT_LAYERS)]
    lens_t = torch.tensor(lens, dtype=torch.int32)
    rows_t = torch.tensor(rows, device="cuda")
    n = len(lens) * topk
    inputs = _draft_inputs(n, S, seed=5)

    def factory(step_ctx, step):
        return FlashInferBackend(step_ctx)

    eager = msd.MultiStepDraftBackend(factory, topk, S, ctx)
    want = _run_draft_steps(eager.init_forward_metadata(rows_t, lens_t.cuda(), loc, lens_t), inputs)
    tol = tolerance(torch.bfloat16)
    for s in range(S):
        for li, layer in enumerate(_draft_layers()):
            got = want[s][li].reshape(n, -1, 128)
            for b, L in enumerate(lens):
                for j in range(topk):
                    r = b * topk + j
                    keys = torch.cat([cached[li][b][0], torch.stack([inputs[t][li][1][r] for t in range(s + 1)])])
                    vals = torch.cat([cached[li][b][1], torch.stack([inputs[t][li][2][r] for t in range(s + 1)])])
                    ref, _ = reference_attention(
                        inputs[s][li][0][r : r + 1], keys, vals, q_positions=torch.tensor([L + s]), scale=layer.scaling
                    )
                    err = relative_error(got[r : r + 1], ref)
                    assert err <= tol, f"step {s} layer {li} request {b} branch {j}: rel err {err:.3g}"

    for i, (k, v) in enumerate(kv0):  # the graph round starts from the same pool
        pool.get_key_buffer(i).copy_(k)
        pool.get_value_buffer(i).copy_(v)
    capture_bs = 8
    graphed = msd.MultiStepDraftBackend(factory, topk, S, ctx)
    graphed.init_draft_graph_state(capture_bs)
    static = _draft_inputs(capture_bs * topk, S, seed=0)
    batches = graphed.capture_draft_graph_metadata(capture_bs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _run_draft_steps(batches, static)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = _run_draft_steps(batches, static)
    graphed.replay_draft_graph_metadata(capture_bs, rows_t, lens_t.cuda(), loc, lens_t)
    for s in range(S):
        for li in range(DRAFT_LAYERS):
            for buf, x in zip(static[s][li], inputs[s][li]):
                buf.zero_()
                buf[:n] = x
    graph.replay()
    for s in range(S):
        for li in range(DRAFT_LAYERS):
            err = relative_error(out_static[s][li][:n], want[s][li].double())
            assert err <= tol, f"graph replay step {s} layer {li}: rel err {err:.3g} vs eager"


# ---- lean re-plans (replan.py) against FlashInfer's own plan ------------------------------------
LEAN_MODES = (
    ForwardMode.DECODE,
    ForwardMode.EXTEND,
    ForwardMode.TARGET_VERIFY,
    ForwardMode.MIXED,
    ForwardMode.DRAFT_EXTEND,
)


def _wrappers_of(step):
    for key, plan in step.plans.items():
        for role in ("decode", "ragged", "paged"):
            w = getattr(plan, role)
            if w is not None:
                yield (key, role), w


def _index_arrays(w) -> list:
    names = (
        "_qo_indptr_buf",
        "_paged_kv_indptr_buf",
        "_paged_kv_indices_buf",
        "_paged_kv_last_page_len_buf",
        "_kv_indptr_buf",
    )
    return [getattr(w, n).cpu() for n in names if getattr(w, n, None) is not None]


@requires_gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_lean_replans_match_flashinfers_own_plan(page_size, monkeypatch):
    """Two backends run the same random sequence of steps of every mode with two layer settings. From
    the second step on the first re-plans its wrappers lean (verify steps with a tree mask go through
    the public plan, and the next unmasked plan of that wrapper is lean again); the second, with
    lean_replan=False, always calls FlashInfer's own plan. At every step each wrapper of the first holds
    the plan info and index arrays of its twin, and the outputs are bitwise equal."""
    from attn_core.contract.context import BackendContext
    from attn_core.contract.layer import AttentionLayer
    from attn_core.memory import MHATokenToKVPool, PagedTokenAllocator, ReqToTokenPool
    from attn_core.testing.batch_builder import build_forward_batch, release_forward_batch
    from attn_flashinfer import replan
    from attn_flashinfer.backend import FlashInferBackend

    lean_calls = []
    schedule = replan._schedule
    monkeypatch.setattr(replan, "_schedule", lambda w, *a: (lean_calls.append(w), schedule(w, *a)))
    hq, hkv, d = 32, 8, 128
    rng = random.Random(page_size)
    max_len, rows = 4200, 20  # the cuda-quick profile: up to 17 requests of up to 4096 tokens
    r2t = ReqToTokenPool(rows, max_len, "cuda")
    alloc = PagedTokenAllocator(page_size * (rows * -(-max_len // page_size) + 2), page_size, "cuda")
    kv = MHATokenToKVPool(alloc.size, page_size, torch.bfloat16, hkv, d, 2, "cuda")
    for i in range(2):
        kv.get_key_buffer(i).normal_()
        kv.get_value_buffer(i).normal_()
    ctx = BackendContext(
        device="cuda",
        dtype=torch.bfloat16,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=page_size,
        max_batch_size=rows,
        max_context_len=max_len,
        req_to_token_pool=r2t,
        token_to_kv_pool=kv,
    )
    layers = [AttentionLayer(0, hq, hkv, d), AttentionLayer(1, hq, hkv, d, sliding_window_size=200, logit_cap=30.0)]
    lean, public = FlashInferBackend(ctx), FlashInferBackend(ctx, lean_replan=False)
    assert lean.planner.lean_replan, "lean re-plans are off for this FlashInfer version: nothing to test"
    modes = (
        [ForwardMode.EXTEND]
        + [rng.choice(LEAN_MODES) for _ in range(9)]
        + [ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND]
    )
    for s, mode in enumerate(modes):
        reqs = compose_requests(rng.randint, mode, profile_for("cuda", True))
        batch = build_forward_batch(mode, reqs, req_to_token_pool=r2t, allocator=alloc, token_to_kv_pool=kv)
        T = batch.num_tokens
        for layer in layers:
            q = torch.randn(T, hq * d, dtype=torch.bfloat16, device="cuda")
            k, v = (torch.randn(T, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            outs = []
            for be in (lean, public):
                if layer.layer_id == 0:
                    be.init_forward_metadata(batch)
                batch.attn_backend = be
                outs.append(layer(q, k, v, batch, save_kv_cache=False))
            assert torch.equal(outs[0], outs[1]), (
                f"step {s} ({mode.name}) layer {layer.layer_id}: lean and public plans differ"
            )
        got, want = dict(_wrappers_of(lean.forward_metadata)), dict(_wrappers_of(public.forward_metadata))
        assert got.keys() == want.keys(), f"step {s}"
        for name, w in got.items():
            assert list(w._plan_info) == list(want[name]._plan_info), f"step {s} ({mode.name}) {name}: plan info"
            for a, b in zip(_index_arrays(w), _index_arrays(want[name]), strict=True):
                assert torch.equal(a, b), f"step {s} ({mode.name}) {name}: index arrays"
            if hasattr(want[name], "_qo_indptr_last"):  # FlashInfer 0.7: the q rows its prefill run checks
                assert w._qo_indptr_last == want[name]._qo_indptr_last, f"step {s} ({mode.name}) {name}: q rows"
        release_forward_batch(batch, alloc)
    assert len(lean_calls) > 10  # the sequence did re-plan lean
    public_wrappers = {id(w) for w in public.planner._eager_wrappers.values()}
    assert not {id(w) for w in lean_calls} & public_wrappers  # lean_replan=False did not
