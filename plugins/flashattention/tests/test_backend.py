"""The backend around the FA4 call, on the CPU over the emulation: what it refuses at construction and
per step (typed, before any K/V write), what it hands FA4 (metadata built once per step, one call per
layer), verify steps with and without masks and with windows (eager and through the graph path), steps
of the same requests as an engine runs them (alone and as the prefill half of a hybrid), and draft trees
(topk > 1) through `MultiStepDraftBackend`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attn_core as ac
from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.contract.errors import BackendUnavailableError, InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.testing.batch_builder import build_forward_batch
from attn_core.testing.engine_steps import MIXED_STEPS, EngineWorld, compare_over_steps
from attn_core.testing.graphs import graph_case_check
from attn_core.testing.harness import AttnCase, assert_case, make_env
from attn_core.testing.reference import reference_attention, relative_error, tolerance
from attn_core.testing.target import KitTarget
from attn_core.wrappers.multi_step_draft import MultiStepDraftBackend, allocate_draft_slots
from attn_flashattention.backend import FlashAttention4Backend
from attn_flashattention.kernel import load_fa4
from attn_flashattention.testing import emulated_backend_class, emulated_fa4

Backend = emulated_backend_class()
BASE = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", page_size=16)


def _ctx(**kw) -> ac.BackendContext:
    return make_env(AttnCase("DECODE", [(20, 1)], **{**BASE, **kw})).ctx


def test_construction_refuses_what_capabilities_cannot_say():
    with pytest.raises(UnsupportedFeatureError, match="page_size 64 at head_dim 256"):
        Backend(_ctx(head_dim=256, page_size=64))
    with pytest.raises(UnsupportedFeatureError, match="v_head_dim"):
        Backend(_ctx(v_head_dim=32))
    Backend(_ctx(head_dim=256, page_size=32))
    Backend(_ctx(head_dim=128, page_size=64))


def test_without_fa4_the_real_class_is_unavailable_typed():
    """No flash_attn here: loading it is the registry's "unavailable" error, naming what failed."""
    with pytest.raises(BackendUnavailableError, match="flash_attn.cute"):
        load_fa4("fa4")
    cpu_class = type("CpuFa4", (FlashAttention4Backend,), {"capabilities": Backend.capabilities})
    with pytest.raises(BackendUnavailableError, match="fa4"):
        cpu_class(_ctx())


class _Spy:
    """The emulation, recording the arguments of every call."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append(kwargs)
        return emulated_fa4.flash_attn_varlen_func(*args, **kwargs)


@pytest.mark.parametrize("mode", ["EXTEND", "DECODE", "MIXED"])
def test_one_call_per_layer_over_one_metadata(mode):
    spy = _Spy()
    cls = type("SpyFa4", (Backend,), {"load_kernel": lambda self: spy})
    reqs = {"EXTEND": [(0, 7), (20, 5), (9, 0)], "DECODE": [(20, 1), (3, 1)], "MIXED": [(20, 1), (0, 9)]}[mode]
    assert_case(cls, AttnCase(mode, reqs, num_layers=3, **BASE))
    assert len(spy.calls) == 3
    first = spy.calls[0]
    for call in spy.calls[1:]:  # every layer reads the step's lists: built once
        for name in ("page_table", "seqused_k", "cu_seqlens_q"):
            assert call[name] is first[name], name
    assert type(first["max_seqlen_q"]) is int and first["causal"] and first["page_table"].dtype == torch.int32
    assert first["max_seqlen_q"] == {"EXTEND": 7, "DECODE": 1, "MIXED": 9}[mode]


@pytest.mark.parametrize("window", [None, 1, 4])
@pytest.mark.parametrize("page_size", [1, 16])
def test_tree_verify_with_windows_and_chain_verify(window, page_size):
    reqs = [(30, 4), (5, 4), (0, 4)]
    kw = {**BASE, "page_size": page_size, "sliding_window": window, "window_even_layers_only": window is not None}
    assert_case(Backend, AttnCase("TARGET_VERIFY", reqs, num_layers=3, return_lse=True, sinks=True, **kw))
    assert_case(Backend, AttnCase("TARGET_VERIFY", reqs, custom_mask=False, logit_cap=1.5, **kw))


@pytest.mark.parametrize("custom_mask", [True, False])
def test_verify_graphs_with_window_layers(custom_mask):
    """Window and full layers in verify graphs: the windowed lists are made in the warm-up run and every
    replay rewrites them."""
    target = KitTarget("fa4", Backend, Backend.capabilities)
    windows = dict(sliding_window=5, window_even_layers_only=True, num_layers=3)
    reqs = [(33, 3), (2, 3), (17, 3)]
    case = AttnCase(
        "TARGET_VERIFY", reqs, custom_mask=custom_mask, steps=((0,), (1, 2)), cuda_graph_level=2, **windows, **BASE
    )
    assert "replays" in graph_case_check(target, case)()


def test_replay_refuses_a_mask_the_capture_had_not():
    env = make_env(AttnCase("TARGET_VERIFY", [(10, 2), (4, 2)], cuda_graph_level=2, **BASE))
    backend = Backend(env.ctx)
    backend.init_cuda_graph_state(2, 4)
    batch = env.batches[0]
    masked = CudaGraphStep.from_batch(batch)
    plain = dataclasses.replace(masked, spec_info=ac.SpecInfo(num_draft_tokens=2))
    backend.capture_cuda_graph_metadata(masked)
    with pytest.raises(InvalidArgumentError, match="custom_mask"):
        backend.replay_cuda_graph_metadata(plain)
    one = CudaGraphStep(ac.ForwardMode.TARGET_VERIFY, 1, batch.req_pool_indices[:1], batch.seq_lens[:1], num_tokens=2)
    with pytest.raises(InvalidArgumentError, match="a batch size captured"):
        backend.replay_cuda_graph_metadata(one)


def test_encoder_decoder_refusals():
    env = make_env(AttnCase("TARGET_VERIFY", [(5, 2, 4)], cuda_graph_level=2, **BASE))
    backend = Backend(env.ctx)
    with pytest.raises(UnsupportedFeatureError, match="encoder-decoder"):
        backend.init_forward_metadata(env.batches[0])
    env = make_env(AttnCase("DECODE", [(5, 1, 4)], cuda_graph_level=2, **BASE))
    backend = Backend(env.ctx)
    backend.init_cuda_graph_state(2, 2)
    with pytest.raises(UnsupportedFeatureError, match="CUDA graphs with encoder-decoder"):
        backend.capture_cuda_graph_metadata(CudaGraphStep.from_batch(env.batches[0]))


@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_steps_alone_and_as_the_prefill_half_of_a_hybrid(page_size):
    """The same requests over several steps (prefill, MIXED, DECODE, a request leaving) on fa4, on
    hybrid(prefill=fa4, decode=torch_native) and on torch_native, against a plain float64 reference."""
    make = [
        lambda ctx: Backend(ctx),
        lambda ctx: ac.HybridAttnBackend(prefill=Backend(ctx), decode=TorchNativeBackend(ctx)),
        lambda ctx: TorchNativeBackend(ctx),
    ]
    worlds = [EngineWorld(m, page_size=page_size, dtype=torch.bfloat16, head_dim=64) for m in make]
    seen = compare_over_steps(worlds, MIXED_STEPS, seed=page_size, tol=2e-2)
    assert {s[0] for s in seen} == {"EXTEND", "MIXED", "DECODE"}


@pytest.mark.parametrize("page_size", [1, 16])
def test_draft_tree_steps_through_multi_step_draft(page_size):
    """topk 2 draft branches (`Feature.SPEC_TOPK_GT1`): every step's output equals the float64 reference
    over the request's cached keys and the branch's draft keys."""
    hq, hkv, d, topk, steps, lens = 4, 2, 64, 2, 3, [5, 16, 23]
    gen = torch.Generator().manual_seed(page_size)
    ps, bs = page_size, len(lens)
    pages = sum(-(-n // ps) + 1 for n in lens) + bs * topk * (-(-(ps + steps) // ps)) + 2
    rows_pool = ac.ReqToTokenPool(bs + 1, max(lens) + 4)
    allocator = ac.PagedTokenAllocator(pages * ps, ps)
    kv = ac.MHATokenToKVPool(pages * ps, ps, torch.bfloat16, hkv, d, 1)
    batch = build_forward_batch(
        "EXTEND", [(n, 0) for n in lens], req_to_token_pool=rows_pool, allocator=allocator, token_to_kv_pool=kv
    )
    rows = batch.req_pool_indices.tolist()
    kv.get_key_buffer(0).fill_(float("nan"))
    kv.get_value_buffer(0).fill_(float("nan"))
    cached = []
    for row, n in zip(rows, lens):
        slots = rows_pool.req_to_token[row, :n].long()
        k, v = (torch.randn(n, hkv, d, generator=gen).to(torch.bfloat16) for _ in range(2))
        kv.get_key_buffer(0)[slots], kv.get_value_buffer(0)[slots] = k, v
        cached.append((k, v))
    loc = allocate_draft_slots(allocator, rows_pool, rows, lens, topk, steps)
    pools = dict(req_to_token_pool=rows_pool, token_to_kv_pool=kv, max_batch_size=bs + 1, max_context_len=max(lens) + 4)
    spec = dict(speculative_num_steps=steps, speculative_topk=topk)
    ctx = ac.BackendContext("cpu", torch.bfloat16, hq, hkv, d, page_size=ps, **pools, **spec)
    wrapper = MultiStepDraftBackend(lambda c, s: Backend(c), topk, steps, ctx)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    batches = wrapper.init_forward_metadata(torch.tensor(rows), lens_t, loc, lens_t)
    layer = ac.AttentionLayer(0, hq, hkv, d, scaling=d**-0.5)
    news = []
    for s, step_batch in enumerate(batches):
        q, k, v = (torch.randn(bs * topk, h, d, generator=gen).to(torch.bfloat16) for h in (hq, hkv, hkv))
        news.append((k, v))
        out = layer(q, k, v, step_batch).view(-1, hq, d)
        for b, n in enumerate(lens):
            for j in range(topk):
                r = b * topk + j
                keys = torch.cat([cached[b][0], torch.stack([news[t][0][r] for t in range(s + 1)])])
                vals = torch.cat([cached[b][1], torch.stack([news[t][1][r] for t in range(s + 1)])])
                ref, _ = reference_attention(
                    q[r : r + 1], keys, vals, q_positions=torch.tensor([n + s]), scale=layer.scaling
                )
                assert relative_error(out[r : r + 1], ref) <= tolerance(torch.bfloat16), (s, b, j)


def test_verify_replay_rewrites_every_window_list_before_the_layers_run():
    """On a GPU the captured kernels read the graph buffers as they are: replay itself must rewrite the
    lists of every window met before capture, not leave them to a layer call (CPU runs layers eagerly)."""
    env = make_env(AttnCase("TARGET_VERIFY", [(10, 2), (4, 2)], cuda_graph_level=2, steps=((0,), (1,)), **BASE))
    backend = Backend(env.ctx)
    backend.init_cuda_graph_state(1, 2)
    first, second = env.batches
    backend.capture_cuda_graph_metadata(CudaGraphStep.from_batch(first))
    window_layer = ac.AttentionLayer(0, 4, 2, 64, sliding_window_size=3)
    q, k = torch.randn(2, 4, 64).bfloat16(), torch.randn(2, 2, 64).bfloat16()
    backend.forward(q, k, k, window_layer, first)  # the warm-up meets window 3
    backend.replay_cuda_graph_metadata(CudaGraphStep.from_batch(second))
    lists = backend.forward_metadata.tree.lists
    assert set(lists) == {None, 3}
    table, counts = backend.forward_metadata.tree.build(3)
    assert torch.equal(lists[3].page_table, table) and torch.equal(lists[3].seqused_k, counts)


def test_debug_paths_name_the_fa4_call():
    from attn_core.contract import debug_paths

    env = make_env(AttnCase("TARGET_VERIFY", [(10, 2)], sliding_window=4, **BASE))
    backend = Backend(env.ctx)
    batch = env.batches[0]
    batch.attn_backend = backend
    backend.init_forward_metadata(batch)
    q, k = torch.randn(2, 4, 64).bfloat16(), torch.randn(2, 2, 64).bfloat16()
    with debug_paths.recording() as calls:
        ac.AttentionLayer(0, 4, 2, 64, sliding_window_size=4)(q, k, k, batch)
    assert (
        calls[0].backend == "fa4"
        and calls[0].path.startswith("FA4 varlen, one sequence per query")
        and "window 4" in calls[0].path
    )
