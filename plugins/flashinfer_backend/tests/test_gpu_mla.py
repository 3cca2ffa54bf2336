"""The FlashInfer MLA backend (`flashinfer_mla`) and DeepSeek's prefill path on a CUDA GPU against the
float64 reference: attn-core's conformance kit (every declared capability, CUDA graphs, bad inputs,
refusals), random DeepSeek-sized batches over two steps, the multi-step draft wrapper (eager and CUDA
graphs), lean re-plans against FlashInfer's own plan, and chunked-prefix prefill. Every test skips
cleanly without CUDA or without flashinfer-python.
"""

from __future__ import annotations

import random

import pytest
import torch

from attn_core.contract.forward_mode import ForwardMode
from attn_core.testing import ConformanceSuite
from attn_core.testing.compose import compose_requests
from attn_core.testing.harness import AttnCase, assert_case
from attn_core.testing.profile import profile_for
from attn_flashinfer.mla_spec import SPEC

pytestmark = pytest.mark.gpu
REASON = SPEC.probe()
requires_gpu = pytest.mark.skipif(REASON is not None, reason=f"flashinfer_mla backend cannot run here: {REASON}")
MLA = dict(arch="mla", kv_lora_rank=512, qk_rope_head_dim=64, head_dim=576, num_kv_heads=1, custom_mask=False)


def _lean_mla_reason():
    """Why the lean MLA path (`replan.mla` / `mla_run`, the device work list) is not tested with the
    installed FlashInfer (its profile says its MLA wrapper keeps the plan elsewhere), or None."""
    from importlib import metadata

    from attn_flashinfer import replan

    try:
        version = metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        return None  # requires_gpu skips first
    return (
        None if replan.mla_verified(version) else f"flashinfer-python {version}: MLA runs through the public plan only"
    )


requires_lean_mla = pytest.mark.skipif(_lean_mla_reason() is not None, reason=str(_lean_mla_reason()))


class TestConformanceOnCuda(ConformanceSuite):
    """attn-core's conformance kit on cuda at the quick sizes (skipped, with the probe's reason, where the
    backend cannot run)."""

    backend = "flashinfer_mla"
    device = "cuda"
    quick = True


def _factory(**options):
    from attn_flashinfer.mla_backend import FlashInferMLABackend

    return lambda ctx: FlashInferMLABackend(ctx, **options)


RANDOM_MODES = (
    ForwardMode.EXTEND,
    ForwardMode.DECODE,
    ForwardMode.MIXED,
    ForwardMode.TARGET_VERIFY,
    ForwardMode.DRAFT_EXTEND,
)


@requires_gpu
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("mode", RANDOM_MODES, ids=[m.name for m in RANDOM_MODES])
def test_random_deepseek_batches_in_two_steps(mode, page_size):
    """128 heads, 512 + 64 latent, bf16: random compositions run as two steps on one backend (the second
    step's wrapper re-planned lean), the LSE asked for at page size 64."""
    rng = random.Random(f"mla-{mode.name}-{page_size}")
    reqs = compose_requests(rng.randint, mode, profile_for("cuda", True))
    cuts = [c for c in range(1, len(reqs)) if any(e for _, e in reqs[:c]) and any(e for _, e in reqs[c:])]
    cut = rng.choice(cuts) if cuts else 0
    steps = ((*range(cut),), (*range(cut, len(reqs)),)) if cut else ()
    case = AttnCase(
        mode,
        reqs,
        num_q_heads=128,
        dtype="bfloat16",
        page_size=page_size,
        device="cuda",
        seed=page_size,
        steps=steps,
        return_lse=page_size == 64,
        **MLA,
    )
    assert_case(_factory(), case)


@requires_gpu
@requires_lean_mla
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND])
def test_lean_replans_match_flashinfers_own_plan(mode):
    """The same steps through a lean and a lean_replan=False backend: identical outputs (both against the
    reference too)."""
    e = 1 if mode.is_decode() else 4
    reqs = [(300, e), (17, e), (1000, e), (64, e), (5, e)]
    case = AttnCase(
        mode, reqs, num_q_heads=16, dtype="bfloat16", page_size=16, device="cuda", steps=((0, 1), (2,), (3, 4)), **MLA
    )
    lean = assert_case(_factory(lean_replan=True), case)
    public = assert_case(_factory(lean_replan=False), case)
    assert [lr.out_error for lr in lean.layers] == [lr.out_error for lr in public.layers]


def _mla_step(mode, reqs, page_size=16, heads=16, **backend_options):
    """A one-layer MLA world on the GPU (random latents), a batch of `reqs` (chains: no verify mask) with
    its metadata built twice (the second a lean re-plan): (backend, batch, layer, q, k, pool)."""
    from attn_core.contract.context import BackendContext
    from attn_core.contract.layer import AttentionLayer
    from attn_core.memory import MLATokenToKVPool, PagedTokenAllocator, ReqToTokenPool
    from attn_core.testing.batch_builder import build_forward_batch
    from attn_flashinfer.mla_backend import FlashInferMLABackend

    ps = page_size
    size = ps * (sum(-(-(p + x) // ps) for p, x in reqs) + 2)
    max_len = max(p + x for p, x in reqs) + ps
    pool = MLATokenToKVPool(size, ps, torch.bfloat16, 512, 64, 1, "cuda")
    pool.kv_buffer[0].normal_()
    r2t = ReqToTokenPool(len(reqs), max_len, "cuda")
    batch = build_forward_batch(
        mode, reqs, req_to_token_pool=r2t, allocator=PagedTokenAllocator(size, ps, "cuda"), token_to_kv_pool=pool
    )
    if batch.spec_info is not None:
        batch.spec_info.custom_mask = batch.spec_info.mask_indptr = None
    ctx = BackendContext(
        device="cuda",
        dtype=torch.bfloat16,
        num_q_heads=heads,
        num_kv_heads=1,
        head_dim=576,
        attention_arch="mla",
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        page_size=ps,
        max_batch_size=len(reqs),
        max_context_len=max_len,
        req_to_token_pool=r2t,
        token_to_kv_pool=pool,
    )
    backend = FlashInferMLABackend(ctx, **backend_options)
    batch.attn_backend = backend
    layer = AttentionLayer(0, heads, 1, 576, scaling=192**-0.5, v_head_dim=512)
    T = batch.num_tokens
    q = torch.randn(T, heads, 576, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(T, 1, 576, dtype=torch.bfloat16, device="cuda")
    backend.init_forward_metadata(batch)
    layer(q, k, None, batch)  # learns the scaling, stores the new latents
    backend.init_forward_metadata(batch)  # lean re-plan
    return backend, batch, layer, q, k, pool


@requires_gpu
@requires_lean_mla
@pytest.mark.parametrize("mode", ["DECODE", "TARGET_VERIFY"])
def test_lean_run_equals_flashinfers_own_run(mode):
    """`replan.mla_run` (the compiled kernel call alone) against the wrapper's public `run` on the same
    plan and inputs: bitwise the same output and natural-log LSE, for a causal (verify) and a
    non-causal (decode) plan; outputs poisoned first."""
    from attn_flashinfer import mla_plans

    e = 1 if mode == "DECODE" else 4
    backend, batch, layer, q, _, pool = _mla_step(mode, [(300, e), (17, e), (1000, e), (5, e)], lean_replan=True)
    w = backend.forward_metadata.wrappers[float(layer.scaling)]
    ckv, kpe = mla_plans.latent_views(pool.get_key_buffer(0), 16, 512)
    T, heads = q.shape[0], q.shape[1]
    got = []
    for lean in (True, False):
        out = torch.full((T, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((T, heads), float("nan"), dtype=torch.float32, device="cuda")
        mla_plans.run(w, q[..., :512], q[..., 512:], ckv, kpe, out, lse, lean)
        got.append((out, lse))
    assert not got[0][0].isnan().any() and not got[0][1].isnan().any()
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


@requires_gpu
@requires_lean_mla
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("mode", ["DECODE", "TARGET_VERIFY"])
def test_device_work_list_equals_flashinfers_plan(mode, page_size, heads):
    """A lean step runs on the work list its page-id launch wrote (`mla_works`), whose layout FlashInfer's
    own scheduler confirmed (`device_works_off` None); its output and LSE are bitwise those of the same
    wrapper run on FlashInfer's plan of the same batch (the first, public plan), requests long enough to
    be split into chunks and merged included; outputs poisoned first."""
    from attn_flashinfer import mla_plans

    e = 1 if mode == "DECODE" else 4
    reqs = [(300, e), (17, e), (5000, e), (5, e), (900, e)]
    backend, batch, layer, q, _, pool = _mla_step(mode, reqs, page_size=page_size, heads=heads, lean_replan=True)
    step = backend.forward_metadata
    assert backend.device_works_off is None and step.works is not None
    w = step.wrappers[float(layer.scaling)]
    ckv, kpe = mla_plans.latent_views(pool.get_key_buffer(0), page_size, 512)
    T = q.shape[0]
    got = []
    for works in (step.works, None):
        out = torch.full((T, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((T, heads), float("nan"), dtype=torch.float32, device="cuda")
        mla_plans.run(w, q[..., :512], q[..., 512:], ckv, kpe, out, lse, True, works)
        got.append((out, lse))
    assert not got[0][0].isnan().any() and not got[0][1].isnan().any()
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


@requires_gpu
def test_a_table_slot_past_the_pool_is_refused_on_the_device():
    """validation "basic" (no device checks on the host): a req_to_token slot past the KV pool reaches
    the index kernel, which writes the dummy page instead and records the fault; the next poll names
    it (and clears it), the step's output stays finite."""
    backend, batch, layer, q, k, pool = _mla_step("DECODE", [(300, 1), (40, 1)])
    assert backend.poll_device_fault() is None
    row = int(batch.req_pool_indices[0])
    batch.req_to_token_pool.req_to_token[row, 64] = pool.num_slots + 5  # a page start of request 0 (page 4)
    pool.get_key_buffer(0)[: pool.page_size].zero_()  # the dummy page: finite
    backend.init_forward_metadata(batch)
    out = layer(q, k, None, batch)
    fault = backend.poll_device_fault()
    assert fault is not None and "slot" in fault and torch.isfinite(out).all()
    assert backend.poll_device_fault() is None


# ---- the multi-step draft wrapper ------------------------------------------------------------------
DRAFT_LAYERS, DRAFT_HEADS = 2, 16


def _draft_env(lens, page_size, topk, num_steps, seed):
    from attn_core.contract.context import BackendContext
    from attn_core.memory import MLATokenToKVPool, PagedTokenAllocator, ReqToTokenPool
    from attn_core.testing.batch_builder import build_forward_batch
    from attn_core.wrappers.multi_step_draft import allocate_draft_slots

    gen = torch.Generator().manual_seed(seed)
    ps = page_size
    pages = sum(-(-n // ps) + 1 for n in lens) + len(lens) * topk * (-(-(ps + num_steps) // ps)) + 2
    r2t = ReqToTokenPool(len(lens) + 1, max(lens) + 4, "cuda")
    alloc = PagedTokenAllocator(pages * ps, ps, "cuda")
    kv = MLATokenToKVPool(pages * ps, ps, torch.bfloat16, 512, 64, DRAFT_LAYERS, "cuda")
    batch = build_forward_batch(
        "EXTEND", [(n, 0) for n in lens], req_to_token_pool=r2t, allocator=alloc, token_to_kv_pool=kv
    )
    rows = batch.req_pool_indices.tolist()
    cached = []
    for layer in range(DRAFT_LAYERS):
        buf = kv.get_key_buffer(layer)
        buf.fill_(float("nan"))
        per_req = []
        for row, n in zip(rows, lens):
            lat = torch.randn(n, 1, 576, generator=gen).to(torch.bfloat16).cuda()
            buf[r2t.req_to_token[row, :n].long()] = lat
            per_req.append(lat)
        cached.append(per_req)
    loc = allocate_draft_slots(alloc, r2t, rows, lens, topk, num_steps)
    ctx = BackendContext(
        device="cuda",
        dtype=torch.bfloat16,
        num_q_heads=DRAFT_HEADS,
        num_kv_heads=1,
        head_dim=576,
        attention_arch="mla",
        kv_lora_rank=512,
        qk_rope_head_dim=64,
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
    g = torch.Generator().manual_seed(seed)

    def rnd(h):
        return torch.randn(n_rows, h, 576, generator=g).to(torch.bfloat16).cuda()

    return [[(rnd(DRAFT_HEADS), rnd(1)) for _ in range(DRAFT_LAYERS)] for _ in range(num_steps)]


def _draft_layers():
    from attn_core.contract.layer import AttentionLayer

    return [AttentionLayer(i, DRAFT_HEADS, 1, 576, scaling=192**-0.5, v_head_dim=512) for i in range(DRAFT_LAYERS)]


def _run_draft_steps(batches, inputs, pad_rows=None):
    outs = []
    for s, batch in enumerate(batches):
        per_layer = []
        for layer, (q, k) in zip(_draft_layers(), inputs[s]):
            if pad_rows is not None:
                q, k = (torch.cat([x, x.new_zeros((pad_rows - x.shape[0], *x.shape[1:]))]) for x in (q, k))
            per_layer.append(layer(q, k, None, batch))
        outs.append(per_layer)
    return outs


@requires_gpu
def test_multi_step_draft_refuses_draft_trees():
    """topk > 1 needs tree-masked verify, which FlashInfer's MLA kernels cannot do: the wrapper refuses."""
    from attn_core.contract.errors import UnsupportedFeatureError
    from attn_core.wrappers.multi_step_draft import MultiStepDraftBackend
    from attn_flashinfer.mla_backend import FlashInferMLABackend

    ctx, *_ = _draft_env([40, 9], 16, 4, 2, seed=0)
    with pytest.raises(UnsupportedFeatureError, match="topk=4"):
        MultiStepDraftBackend(lambda c, s: FlashInferMLABackend(c), 4, 2, ctx)


@requires_gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("topk", [1])
def test_multi_step_draft_eager_and_graph(topk, page_size):
    """Every draft step (a chain: topk 1) against the float64 reference (eager), then the same round
    through CUDA graphs captured for a larger batch (padded) against the eager outputs."""
    from attn_core.testing.reference import reference_attention, relative_error, tolerance
    from attn_core.wrappers.multi_step_draft import MultiStepDraftBackend
    from attn_flashinfer.mla_backend import FlashInferMLABackend

    lens, S = [500, 16, 131, 7, 64, 33], 3
    ctx, rows, cached, loc = _draft_env(lens, page_size, topk, S, seed=topk * 100 + page_size)
    pool = ctx.token_to_kv_pool
    kv0 = [pool.get_key_buffer(i).clone() for i in range(DRAFT_LAYERS)]
    lens_t = torch.tensor(lens, dtype=torch.int32)
    rows_t = torch.tensor(rows, device="cuda")
    n = len(lens) * topk
    inputs = _draft_inputs(n, S, seed=5)

    def factory(step_ctx, step):
        return FlashInferMLABackend(step_ctx)

    eager = MultiStepDraftBackend(factory, topk, S, ctx)
    want = _run_draft_steps(eager.init_forward_metadata(rows_t, lens_t.cuda(), loc, lens_t), inputs)
    tol = tolerance(torch.bfloat16)
    for s in range(S):
        for li, layer in enumerate(_draft_layers()):
            got = want[s][li].reshape(n, -1, 512)
            for b, L in enumerate(lens):
                for j in range(topk):
                    r = b * topk + j
                    keys = torch.cat([cached[li][b], torch.stack([inputs[t][li][1][r] for t in range(s + 1)])])
                    ref, _ = reference_attention(
                        inputs[s][li][0][r : r + 1],
                        keys,
                        keys[..., :512],
                        q_positions=torch.tensor([L + s]),
                        scale=layer.scaling,
                    )
                    err = relative_error(got[r : r + 1], ref)
                    assert err <= tol, f"step {s} layer {li} request {b} branch {j}: rel err {err:.3g}"

    for i, buf in enumerate(kv0):  # the graph round starts from the same pool
        pool.get_key_buffer(i).copy_(buf)
    capture_bs = 8
    graphed = MultiStepDraftBackend(factory, topk, S, ctx)
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


# ---- DeepSeek's prefill path: ragged new tokens + chunked prefix ---------------------------------
@requires_gpu
@pytest.mark.parametrize(("seed", "H"), [(0, 16), (1, 16), (2, 128)])
def test_chunked_prefix_prefill_matches_reference(seed, H):
    """Random prefixes longer than the chunk capacity (several chunks, requests whose prefix ends
    before the last chunk, a request without prefix), 16 or 128 heads, 192/128, bf16, over two layers;
    the engine's 'decompression' is a lookup of per-slot K/V, and unused slots hold NaN."""
    from attn_core.contract.context import BackendContext
    from attn_core.memory import MLATokenToKVPool, PagedTokenAllocator, ReqToTokenPool
    from attn_core.testing.batch_builder import build_forward_batch
    from attn_core.testing.reference import reference_attention, relative_error, tolerance
    from attn_flashinfer.mla_backend import FlashInferMLABackend

    rng = random.Random(seed)
    ps = 64
    bs = rng.randint(2, 5)
    capacity = rng.choice([256, 512, 1000])
    reqs = [(rng.randint(capacity // bs + 1, 3 * capacity), rng.randint(1, 300)) for _ in range(bs)]
    reqs[rng.randrange(bs)] = (0, rng.randint(1, 200))
    slots = sum(-(-(p + e) // ps) + 1 for p, e in reqs) * ps
    r2t = ReqToTokenPool(bs + 1, max(p + e for p, e in reqs) + 1, "cuda")
    alloc = PagedTokenAllocator(slots, ps, "cuda")
    pool = MLATokenToKVPool(slots, ps, torch.bfloat16, 512, 64, 1, "cuda")
    ctx = BackendContext(
        device="cuda",
        dtype=torch.bfloat16,
        num_q_heads=H,
        num_kv_heads=1,
        head_dim=576,
        attention_arch="mla",
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        page_size=ps,
        max_context_len=r2t.max_context_len,
        req_to_token_pool=r2t,
        token_to_kv_pool=pool,
    )
    backend = FlashInferMLABackend(ctx)
    batch = build_forward_batch("EXTEND", reqs, req_to_token_pool=r2t, allocator=alloc, token_to_kv_pool=pool)
    g = torch.Generator().manual_seed(seed)
    k_all = torch.full((slots, H, 192), float("nan"), dtype=torch.bfloat16)
    v_all = torch.full((slots, H, 128), float("nan"), dtype=torch.bfloat16)
    rows = batch.req_pool_indices.tolist()
    for row, (p, _) in zip(rows, reqs):
        sl = r2t.req_to_token[row, :p].long().cpu()
        k_all[sl] = torch.randn(p, H, 192, generator=g).to(torch.bfloat16)
        v_all[sl] = torch.randn(p, H, 128, generator=g).to(torch.bfloat16)
    k_all, v_all = k_all.cuda(), v_all.cuda()
    T = sum(e for _, e in reqs)
    plan = backend.plan_prefill(batch, capacity, scaling=192**-0.5)
    assert len(plan.chunk_plan.chunks) >= 2
    for layer in range(2):
        q, k = (torch.randn(T, H, 192, generator=g).to(torch.bfloat16).cuda() for _ in range(2))
        v = torch.randn(T, H, 128, generator=g).to(torch.bfloat16).cuda()
        seen: list[int] = []

        def prefix_kv(chunk, chunk_slots, seen=seen):
            seen.append(chunk.index)
            return k_all[chunk_slots], v_all[chunk_slots]

        o, lse = plan.attend(q, k, v, prefix_kv, return_lse=True)
        assert seen == list(range(len(plan.chunk_plan.chunks)))
        o = o.view(T, H, 128)
        t0 = 0
        for row, (p, e) in zip(rows, reqs):
            sl = r2t.req_to_token[row, :p].long()
            keys = torch.cat([k_all[sl], k[t0 : t0 + e]])
            vals = torch.cat([v_all[sl], v[t0 : t0 + e]])
            ref, ref_lse = reference_attention(
                q[t0 : t0 + e], keys, vals, q_positions=torch.arange(p, p + e), scale=192**-0.5
            )
            err = relative_error(o[t0 : t0 + e], ref)
            assert err <= tolerance(torch.bfloat16), f"layer {layer} request ({p}, {e}): rel err {err:.3g}"
            assert (lse[t0 : t0 + e].double().cpu() - ref_lse).abs().max() < 2e-2
            t0 += e
