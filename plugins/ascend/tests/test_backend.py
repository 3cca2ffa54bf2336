"""The backend around the operator calls: keyword choice by the installed release, metadata (block
tables from each page's first slot, host lengths), graph buffers, and typed errors before any K/V write."""

from __future__ import annotations

import pytest
import torch
from attn_ascend.metadata import host_metadata
from attn_ascend.npu_ops import FiaKeywords, argument_names
from attn_ascend.testing.emulated_torch_npu import emulated_backend_class, emulated_torch_npu, installed

from attn_core.contract.errors import IncompatibleBackendError, InvalidArgumentError, StaleMetadataError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.testing.harness import AttnCase, assert_case, layer_inputs, make_env, make_layer

Backend = emulated_backend_class()
MHA = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)
MLA = dict(
    num_q_heads=4, head_dim=576, arch="mla", kv_lora_rank=512, qk_rope_head_dim=64, dtype="bfloat16", page_size=16
)


def test_pure_helpers_examples():
    assert host_metadata([7, 4, 9], [3, 0, 2]) == ([0, 2], [7, 9], [3, 5])


def test_keywords_follow_the_installed_release():
    assert FiaKeywords.from_names(
        argument_names(emulated_torch_npu("6.0.0"), "npu_fused_infer_attention_score")
    ) == FiaKeywords("scale_value", False)
    assert FiaKeywords.from_names(
        argument_names(emulated_torch_npu("7.0.0"), "npu_fused_infer_attention_score")
    ) == FiaKeywords("scale", True)
    assert FiaKeywords.from_names(frozenset()) == FiaKeywords("scale", True)


@pytest.mark.parametrize("mode", ["EXTEND", "TARGET_VERIFY"])
def test_release_6_runs_mha_with_scale_value(mode):
    """Under the 6.0.0 operator (which rejects `scale=`), the backend passes `scale_value` and is right."""
    with installed("6.0.0"):
        backend = None

        def factory(ctx):
            nonlocal backend
            backend = Backend(ctx)
            return backend

        assert_case(factory, AttnCase(mode, [(20, 3), (5, 3)], custom_mask=False, **MHA))
        assert backend.ops.fia.scale == "scale_value"


def test_release_6_refuses_mla():
    with installed("6.0.0"):
        env = make_env(AttnCase("DECODE", [(3, 1)], **MLA))
        with pytest.raises(IncompatibleBackendError, match="7.0.0"):
            Backend(env.ctx)


def test_metadata_block_tables_and_host_lengths():
    env = make_env(AttnCase("EXTEND", [(40, 3), (7, 0), (0, 20)], **MHA))
    backend = Backend(env.ctx)
    meta = backend.build_forward_metadata(env.batch)
    assert meta.seq_lens == [43, 20] and meta.q_cumsum == [3, 23]  # the request without new tokens is dropped
    assert meta.seq_lens_cpu.device.type == "cpu" and meta.seq_lens_cpu.dtype == torch.int32
    r2t = env.req_to_token_pool.req_to_token
    rows = env.batch.req_pool_indices.tolist()
    for t, (row, n) in enumerate(zip([rows[0], rows[2]], [43, 20])):
        firsts = r2t[row, :n:16].tolist()
        assert meta.block_tables[t, : len(firsts)].tolist() == [s // 16 for s in firsts]
    assert meta.block_tables.dtype == torch.int32


def _forward(backend, env, layer, **change):
    inputs = layer_inputs(env, 0, torch.Generator().manual_seed(0))
    inputs.update(change)
    return backend.forward(inputs["q"], inputs["k"], inputs["v"], layer, env.batch)


def test_fp8_style_scales_are_refused_before_the_kv_write():
    env = make_env(AttnCase("DECODE", [(20, 1), (3, 1)], **MHA))
    backend = Backend(env.ctx)
    backend.init_forward_metadata(env.batch)
    before = env.kv_pool.get_key_buffer(0).clone()
    layer = make_layer(env.case, 0)
    layer.k_scale = 0.5
    with pytest.raises(InvalidArgumentError, match="k_scale"):
        _forward(backend, env, layer)
    assert torch.equal(before.nan_to_num(7.0), env.kv_pool.get_key_buffer(0).nan_to_num(7.0))


def test_metadata_of_another_batch_is_refused():
    env = make_env(AttnCase("DECODE", [(20, 1), (3, 1)], steps=((0,), (1,)), **MHA))
    backend = Backend(env.ctx)
    big = make_env(AttnCase("DECODE", [(20, 1), (3, 1), (4, 1)], **MHA))
    backend.init_forward_metadata(big.batch)
    with pytest.raises(StaleMetadataError):
        _forward(backend, env, make_layer(env.case, 0))


def test_graph_replay_needs_state_and_a_captured_size():
    env = make_env(AttnCase("DECODE", [(20, 1), (3, 1)], **MHA))
    backend = Backend(env.ctx)
    b = env.batch
    args = (2, b.req_pool_indices, b.seq_lens, b.seq_lens_sum, None, ForwardMode.DECODE, None, b.seq_lens_cpu)
    with pytest.raises(InvalidArgumentError, match="init_cuda_graph_state"):
        backend.init_forward_metadata_replay_cuda_graph(*args)
    backend.init_cuda_graph_state(4, 4)
    with pytest.raises(InvalidArgumentError, match="captured"):
        backend.init_forward_metadata_replay_cuda_graph(*args)
    backend.init_forward_metadata_capture_cuda_graph(
        2, 2, b.req_pool_indices, b.seq_lens, None, ForwardMode.DECODE, None
    )
    tables = backend.graph_block_tables
    tables.fill_(-1)
    backend.init_forward_metadata_replay_cuda_graph(*args)
    meta = backend.forward_metadata
    assert meta.graph_mode and meta.block_tables.data_ptr() == tables.data_ptr()  # the persistent buffer
    assert meta.seq_lens == [21, 4] and (tables[:2, 2:] == 0).all() and (tables[2:] == -1).all()


def test_mla_decode_graph_path_matches_eager():
    """MLA decode in graph mode goes through the fused-infer operator (BSND, query_rope/key_rope),
    eager through the paged MLA operator: same answer on the same step."""
    case = AttnCase("DECODE", [(40, 1), (3, 1)], **MLA)
    env = make_env(case)
    backend = Backend(env.ctx)
    layer = make_layer(case, 0)
    inputs = layer_inputs(env, 0, torch.Generator().manual_seed(1))
    backend.init_forward_metadata(env.batch)
    eager = backend.forward(inputs["q"], inputs["k"], None, layer, env.batch)
    b = env.batch
    backend.init_cuda_graph_state(2, 2)
    backend.init_forward_metadata_capture_cuda_graph(
        2, 2, b.req_pool_indices, b.seq_lens, None, ForwardMode.DECODE, None
    )
    backend.init_forward_metadata_replay_cuda_graph(
        2, b.req_pool_indices, b.seq_lens, b.seq_lens_sum, None, ForwardMode.DECODE, None, None
    )
    graph = backend.forward(inputs["q"], inputs["k"], None, layer, env.batch)
    assert (graph.float() - eager.float()).abs().max() < 2e-2
