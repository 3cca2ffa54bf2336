"""The MLA backend's host wiring on the CPU over the stand-in's MLA wrapper (`fake_flashinfer.py`: plain
float64, FlashInfer 0.6.6's MLA conventions down to the internals the lean path calls): the key lists,
query layouts (cached per batch size and draft count, or the step's own), reused host page offsets and
plans each step hands the wrapper, lean (`replan.mla` / `replan.mla_run`) and public, checked by
attn-core's harness against its float64 reference over several steps of one backend; then CUDA-graph
capture and replays (their metadata only: nothing is captured on the CPU) against eager steps of the same
batches. Skipped where the real flashinfer is importable (test_gpu_mla.py runs the real thing there).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from attn_core.testing.harness import AttnCase, assert_case

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is not None, reason="the real flashinfer is installed"
)
# the `mla_factory` fixture (conftest.py): FlashInferMLABackend over fake_flashinfer.py's MLA wrapper, on the CPU

MLA = dict(
    arch="mla",
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    head_dim=576,
    num_kv_heads=1,
    num_q_heads=4,
    dtype="float16",
    device="cpu",
)

CASES = {
    # steps of different batch sizes and query counts on one backend: uniform layouts from the cache,
    # the page offsets into the reused host arrays of each batch size
    "decode": AttnCase(
        "DECODE",
        [(40, 1), (0, 1), (17, 1), (90, 1), (3, 1), (64, 1)],
        page_size=16,
        steps=((0, 1), (2, 3, 4), (5,)),
        **MLA,
    ),
    "verify-uniform": AttnCase(
        "TARGET_VERIFY",
        [(33, 3), (5, 3), (60, 3), (16, 3), (0, 3)],
        page_size=16,
        custom_mask=False,
        return_lse=True,
        steps=((0, 1), (2,), (3, 4)),
        **MLA,
    ),
    "draft-extend-ragged": AttnCase(
        "DRAFT_EXTEND", [(20, 1), (7, 3), (31, 2), (9, 2)], page_size=1, steps=((0, 1), (2, 3)), **MLA
    ),
    "extend-prefix": AttnCase(
        "EXTEND", [(0, 9), (13, 5), (6, 1)], page_size=16, return_lse=True, steps=((0, 1), (2,)), **MLA
    ),
    "mixed": AttnCase("MIXED", [(21, 1), (4, 9), (0, 3)], page_size=1, **MLA),
}


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "public"])
@pytest.mark.parametrize("name", list(CASES))
def test_steps_match_the_reference(mla_factory, name, lean):
    assert_case(lambda ctx: mla_factory(ctx, lean_replan=lean), CASES[name])


def _world(max_len: int, rows: int, slots: int, page_size: int = 16, heads: int = 4):
    """One engine's pools (random latents) and context; `batch(mode, reqs)` builds a step on them."""
    from attn_core.contract.context import BackendContext
    from attn_core.memory import MLATokenToKVPool, PagedTokenAllocator, ReqToTokenPool
    from attn_core.testing.batch_builder import build_forward_batch

    pool = MLATokenToKVPool(slots, page_size, torch.float16, 512, 64, 1, "cpu")
    pool.kv_buffer[0].normal_()
    r2t, alloc = ReqToTokenPool(rows, max_len, "cpu"), PagedTokenAllocator(slots, page_size, "cpu")
    ctx = BackendContext(
        device="cpu",
        dtype=torch.float16,
        num_q_heads=heads,
        num_kv_heads=1,
        head_dim=576,
        attention_arch="mla",
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        page_size=page_size,
        max_batch_size=rows,
        max_context_len=max_len,
        req_to_token_pool=r2t,
        token_to_kv_pool=pool,
    )

    def batch(mode, reqs):
        b = build_forward_batch(mode, reqs, req_to_token_pool=r2t, allocator=alloc, token_to_kv_pool=pool)
        if b.spec_info is not None:
            b.spec_info.custom_mask = b.spec_info.mask_indptr = None
        return b

    return ctx, alloc, batch


@pytest.mark.parametrize("mode", ["DECODE", "TARGET_VERIFY"])
def test_graph_replays_match_eager_steps(mla_factory, mode):
    """Capture one batch size, replay it for batches of other lengths (and the cached query layout the
    graph inputs hand in) on the same pools: each replay's output equals an eager backend's on the same
    batch; the graph wrapper had one public plan (capture), its replays lean re-plans."""
    from attn_core.contract.layer import AttentionLayer
    from attn_core.testing.batch_builder import release_forward_batch

    e = 1 if mode == "DECODE" else 3
    layer = AttentionLayer(0, 4, 1, 576, scaling=192**-0.5, v_head_dim=512)
    ctx, alloc, new_batch = _world(max_len=128, rows=3, slots=16 * 30)
    eager, graph_backend = mla_factory(ctx), mla_factory(ctx)
    for step, lens in enumerate([(50, 3, 20), (70, 35, 5), (18, 64, 100)]):
        batch = new_batch(mode, [(n, e) for n in lens])
        T = batch.num_tokens
        g = torch.Generator().manual_seed(step)
        q, k = torch.randn(T, 4, 576, generator=g).half(), torch.randn(T, 1, 576, generator=g).half()
        batch.attn_backend = eager
        eager.init_forward_metadata(batch)
        want = layer(q, k, None, batch)
        batch.attn_backend = graph_backend
        if step == 0:
            graph_backend.init_forward_metadata(batch)
            layer(q, k, None, batch)  # the layer's scaling, met eagerly before capture
            graph_backend.init_cuda_graph_state(3, 3 * e)
            graph_backend.init_forward_metadata_capture_cuda_graph(
                3, T, batch.req_pool_indices, batch.seq_lens, None, batch.forward_mode, None
            )
        graph_backend.init_forward_metadata_replay_cuda_graph(
            3,
            batch.req_pool_indices,
            batch.seq_lens,
            batch.seq_lens_sum,
            None,
            batch.forward_mode,
            None,
            batch.seq_lens_cpu,
        )
        got = layer(q, k, None, batch)
        assert not got.isnan().any() and torch.equal(got, want), (
            f"step {step}: graph replay differs from the eager step"
        )
        (w,) = graph_backend.forward_metadata.wrappers.values()
        assert w._use_cuda_graph and w.public_plans == 1
        release_forward_batch(batch, alloc)


@pytest.mark.parametrize(
    "mode,heads,drafts",
    [("DECODE", 4, 1), ("TARGET_VERIFY", 4, 3), ("TARGET_VERIFY", 16, 5), ("DRAFT_EXTEND", 16, 2)],
    ids=["decode", "verify", "verify-clusters-of-2", "draft-extend"],
)
def test_device_work_list_steps_equal_flashinfer_planned_steps(mla_factory, mode, heads, drafts):
    """Lean steps with every request's query count equal run on the work list the page-id launch writes
    (`mla_works`), not FlashInfer's scheduler: several steps of one backend, batches of other lengths,
    one with a request long enough to be split into chunks and merged; the stand-in's `run` executes the
    work list as the kernel does (every output row once) and the outputs equal a backend's on
    FlashInfer's public plans. A ragged step (different query counts) goes to FlashInfer's scheduler."""
    from attn_core.contract.layer import AttentionLayer
    from attn_core.testing.batch_builder import release_forward_batch

    layer = AttentionLayer(0, heads, 1, 576, scaling=192**-0.5, v_head_dim=512)
    ctx, alloc, new_batch = _world(max_len=1200, rows=4, slots=16 * 200, heads=heads)
    device, public = mla_factory(ctx), mla_factory(ctx, lean_replan=False)
    steps = [(50, 3, 20), (1100, 35, 5, 9), (18, 64), (77,)]
    for step, lens in enumerate(steps):
        batch = new_batch(mode, [(n, drafts) for n in lens])
        T = batch.num_tokens
        g = torch.Generator().manual_seed(step)
        q, k = torch.randn(T, heads, 576, generator=g).half(), torch.randn(T, 1, 576, generator=g).half()
        outs = []
        for backend in (public, device):
            batch.attn_backend = backend
            backend.init_forward_metadata(batch)
            outs.append(layer(q, k, None, batch))
        assert not outs[1].isnan().any() and torch.equal(outs[1], outs[0]), f"step {step}"
        used = device.forward_metadata.works is not None
        assert used == (step > 0), f"step {step}: the work list serves every lean step after the first plan"
        release_forward_batch(batch, alloc)
    assert device.device_works_off is None and public.device_works_off is not None
    batch = new_batch("DRAFT_EXTEND", [(30, 1), (20, 3)])
    batch.attn_backend = device
    device.init_forward_metadata(batch)
    assert device.forward_metadata.works is None


def _composed(mla_factory):
    """A backend that holds a `FlashInferMLABackend` and hands it every step through the public extension
    point (no subclass): plans from `build_forward_metadata` / `capture_step` / `replay_step`, layers run
    by the plan's `run`, graph state, faults and prefill forwarded (what attn-trtllm-mla relies on)."""
    from attn_core.contract.backend import AttentionBackend

    class Composed(AttentionBackend):
        name = "composed_mla"
        capabilities = mla_factory.capabilities

        def __init__(self, ctx, **options):
            super().__init__(ctx)
            self.fallback = mla_factory(ctx, **options)

        def build_forward_metadata(self, forward_batch):
            return self.fallback.build_forward_metadata(forward_batch)

        def init_cuda_graph_state(self, max_bs, max_num_tokens):
            self.fallback.init_cuda_graph_state(max_bs, max_num_tokens)

        def capture_cuda_graph_metadata(self, step):
            self.bind_graph_metadata(self.fallback.capture_step(step), step)

        def replay_cuda_graph_metadata(self, step):
            self.bind_graph_metadata(self.fallback.replay_step(step), step)

        def poll_device_fault(self):
            return self.fallback.poll_device_fault()

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, return_lse=False):
            return self.forward_metadata.run(q, k, v, layer, forward_batch, save_kv_cache, return_lse)

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, return_lse=False):
            return self.forward_metadata.run(q, k, v, layer, forward_batch, save_kv_cache, return_lse)

    return Composed


@pytest.mark.parametrize("name", ["decode", "verify-uniform", "extend-prefix", "mixed"])
def test_composed_backend_steps_match_the_reference(mla_factory, name):
    """The public extension point, eager: every plan comes from `build_forward_metadata` and runs by
    `MLAStep.run`, over several steps of one composed backend."""
    assert_case(_composed(mla_factory), CASES[name])


def test_composed_backend_passes_the_kit_graph_and_step_checks(mla_factory):
    """The public extension point under CUDA-graph capture / replay (`capture_step` / `replay_step`, the
    kit's graph checks: metadata calls only on the CPU) and the kit's mode and step checks."""
    from attn_core.testing.kit import make_plan
    from attn_core.testing.outcome import execute

    plan = make_plan(_composed(mla_factory), device="cpu", quick=True)
    kinds = ("graph", "mode", "steps")
    checks = [c for c in plan.checks if c.id.split("-")[0] in kinds and plan.skip_reason(c.id) is None]
    assert any(c.id.startswith("graph-") for c in checks), [c.id for c in plan.checks]
    for check in checks:
        outcome = execute(check)
        assert outcome.status == "passed", f"{check.id}: {outcome.message}"
