"""The backend around the AITER calls: which operator each mode and batch takes, the MLA query pieces,
both documented forms of mla_decode_fwd, the folded K/V scales, MLA head padding, the DECODE graph
buffers, and typed errors before any K/V write."""

from __future__ import annotations

import pytest
import torch
from attn_aiter.testing.emulated_aiter import emulated_backend_class, installed

from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.contract.errors import (
    BackendUnavailableError,
    IncompatibleBackendError,
    InvalidArgumentError,
    UnsupportedFeatureError,
)
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.testing.harness import AttnCase, assert_case, layer_inputs, make_env, make_layer

Backend = emulated_backend_class()
MHA = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)
MLA = dict(
    num_q_heads=4,
    num_kv_heads=1,
    head_dim=576,
    arch="mla",
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    dtype="bfloat16",
    page_size=16,
)


@pytest.mark.parametrize(
    ("mode", "reqs", "arch", "path"),
    [
        ("DECODE", [(20, 1), (3, 1)], MHA, "aiter.paged_attention_ragged"),
        ("EXTEND", [(20, 3), (7, 0), (0, 9)], MHA, "aiter.flash_attn_varlen_func"),
        ("MIXED", [(20, 1), (0, 9)], MHA, "aiter.flash_attn_varlen_func"),
        ("TARGET_VERIFY", [(20, 3), (5, 3)], MHA, "aiter.flash_attn_varlen_func"),
        ("DECODE", [(20, 1), (3, 1)], MLA, "aiter.mla.mla_decode_fwd"),
        ("TARGET_VERIFY", [(20, 4), (5, 4)], MLA, "aiter.mla.mla_decode_fwd"),
        ("TARGET_VERIFY", [(20, 6), (5, 6)], MLA, "aiter.mla.mla_prefill_fwd"),
        ("DRAFT_EXTEND", [(20, 2), (5, 3)], MLA, "aiter.mla.mla_prefill_fwd"),
        ("EXTEND", [(20, 3), (0, 9)], MLA, "aiter.mla.mla_prefill_fwd"),
    ],
)
def test_each_mode_takes_its_operator_and_is_right(mode, reqs, arch, path):
    seen = []

    def factory(ctx):
        backend = Backend(ctx)
        seen.append(backend)
        return backend

    assert_case(factory, AttnCase(mode, reqs, custom_mask=False, **arch))
    assert seen[0].forward_metadata.path == path


def test_mla_prefill_cuts_long_requests_into_pieces():
    """A 300-token prompt behind a 40-token prefix and a short request: pieces of at most 128 queries,
    each over its own causal prefix of keys, right against the float64 reference."""
    seen = []

    def factory(ctx):
        seen.append(Backend(ctx))
        return seen[-1]

    assert_case(factory, AttnCase("EXTEND", [(40, 300), (3, 2)], **MLA))
    plan = seen[0].forward_metadata.plan
    assert plan.kernel == "prefill" and plan.max_seqlen_q == 128
    assert plan.qo_indptr.tolist() == [0, 128, 256, 300, 302]
    assert plan.kv_indptr.diff().tolist() == [40 + 128, 40 + 256, 340, 5]
    assert plan.last_page_lens.tolist() == [1, 1, 1, 1]


def test_earlier_form_of_mla_decode_fwd():
    """Releases whose mla_decode_fwd has no page_size / nhead_kv (sm_scale right after max_seqlen_q)
    get the same answer: the backend passes sm_scale by keyword."""
    with installed("earlier"):
        assert_case(Backend, AttnCase("DECODE", [(30, 1), (2, 1)], **MLA))
        assert_case(Backend, AttnCase("TARGET_VERIFY", [(30, 2), (2, 2)], custom_mask=False, **MLA))


@pytest.mark.parametrize("arch", [MHA, MLA], ids=["mha", "mla"])
@pytest.mark.parametrize("mode", ["DECODE", "EXTEND"])
def test_layer_kv_scales_are_folded(arch, mode):
    """A layer with k_scale 0.5 / v_scale 2 on a 16-bit pool (stored = x / scale, read = stored * scale)
    gives torch_native's answer on the same pool contents."""
    reqs = [(20, 1), (3, 1)] if mode == "DECODE" else [(20, 3), (0, 5)]
    case = AttnCase(mode, reqs, **arch)
    outs = []
    for cls in (Backend, TorchNativeBackend):
        env = make_env(case)
        backend = cls(env.ctx)
        layer = make_layer(case, 0)
        layer.k_scale, layer.v_scale = 0.5, 2.0
        inputs = layer_inputs(env, 0, torch.Generator().manual_seed(3))
        backend.init_forward_metadata(env.batch)
        outs.append(backend.forward(inputs["q"], inputs["k"], inputs["v"], layer, env.batch).float())
    assert (outs[0] - outs[1]).abs().max() / outs[1].abs().max() < 2e-2


def test_mla_heads_are_padded_to_a_multiple_of_16():
    assert_case(Backend, AttnCase("DECODE", [(20, 1), (3, 1)], **{**MLA, "num_q_heads": 40}))
    env = make_env(AttnCase("DECODE", [(3, 1)], **{**MLA, "num_q_heads": 144}))
    with pytest.raises(IncompatibleBackendError, match="up to 128"):
        Backend(env.ctx)


def test_mha_needs_equal_head_dims():
    env = make_env(AttnCase("DECODE", [(3, 1)], **{**MHA, "v_head_dim": 32}))
    with pytest.raises(IncompatibleBackendError, match="v_head_dim"):
        Backend(env.ctx)


def test_an_aiter_without_the_operators_is_unavailable():
    """PyPI's unrelated `aiter` (async iterators) imports but has none of AITER's operators."""
    with installed() as pkg:
        del pkg.paged_attention_ragged
        env = make_env(AttnCase("DECODE", [(3, 1)], **MHA))
        with pytest.raises(BackendUnavailableError, match="not AMD's AITER.*aiter.paged_attention_ragged"):
            Backend(env.ctx)


@pytest.mark.parametrize("arch", [MHA, MLA], ids=["mha", "mla"])
def test_decode_graph_buffers(arch):
    """Graph state: one set of CSR buffers (and the MHA workspace) for max_bs and max_context_len; capture
    and replay rewrite them in place and point the metadata at them; replay equals eager."""
    case = AttnCase("DECODE", [(40, 1), (3, 1)], **arch)
    env = make_env(case)
    backend = Backend(env.ctx)
    layer = make_layer(case, 0)
    inputs = layer_inputs(env, 0, torch.Generator().manual_seed(1))
    backend.init_forward_metadata(env.batch)
    eager = backend.forward(inputs["q"], inputs["k"], inputs["v"], layer, env.batch)
    b = env.batch
    with pytest.raises(InvalidArgumentError, match="init_cuda_graph_state"):
        backend.init_forward_metadata_capture_cuda_graph(
            2, 2, b.req_pool_indices, b.seq_lens, None, ForwardMode.DECODE, None
        )
    backend.init_cuda_graph_state(4, 4)
    g = backend._graph
    if "workspace" in g:
        parts = -(-env.ctx.max_context_len // 256)
        assert g["partitions"] == parts and g["workspace"].numel() == 4 * 4 * parts * (64 * 2 + 8)
    backend.init_forward_metadata_capture_cuda_graph(
        2, 2, b.req_pool_indices, b.seq_lens, None, ForwardMode.DECODE, None
    )
    g["ids"].fill_(-7)
    backend.init_forward_metadata_replay_cuda_graph(
        2, b.req_pool_indices, b.seq_lens, b.seq_lens_sum, None, ForwardMode.DECODE, None, b.seq_lens_cpu
    )
    plan = backend.forward_metadata.plan
    ids = plan.kv_indices if hasattr(plan, "kv_indices") else plan.page_ids
    assert ids.data_ptr() == g["ids"].data_ptr() and plan.kv_indptr.data_ptr() == g["kv_indptr"].data_ptr()
    graph = backend.forward(inputs["q"], inputs["k"], inputs["v"], layer, env.batch)
    assert torch.equal(graph, eager)
    with pytest.raises(InvalidArgumentError, match="batch size captured"):
        backend.init_forward_metadata_replay_cuda_graph(
            5, *(torch.zeros(5, dtype=torch.int32),) * 2, 5, None, ForwardMode.DECODE, None, None
        )
    with pytest.raises(UnsupportedFeatureError, match="DECODE only"):
        step = CudaGraphStep(
            forward_mode=ForwardMode.TARGET_VERIFY,
            bs=2,
            num_tokens=4,
            req_pool_indices=b.req_pool_indices,
            seq_lens=b.seq_lens,
        )
        backend.capture_cuda_graph_metadata(step)
