"""`trtllm_mha` around its kernel calls, on the CPU through the float64 stand-in: the argument helpers' worked
examples, which kernel each mode takes, the block tables, folded k/v scales against torch_native, the graph
buffers, and engine steps beside torch_native against a float64 causal reference."""

from __future__ import annotations

import pytest
import torch

import attn_core as ac
from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.contract.errors import IncompatibleBackendError, InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.testing.engine_steps import MIXED_STEPS, EngineWorld, compare_over_steps
from attn_core.testing.harness import AttnCase, assert_case, layer_inputs, make_env, make_layer
from attn_trtllm_mla import mha_args
from attn_trtllm_mla.mha_backend import TrtllmMHABackend
from attn_trtllm_mla.mha_plans import block_tables, decode_q_len, table_width
from attn_trtllm_mla.testing.blackwell_stand_ins import cpu_backend_class, trtllm_mha_vendor

MHA = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", page_size=16)


def backend_class():
    return cpu_backend_class(TrtllmMHABackend, trtllm_mha_vendor())


def test_argument_helpers():
    assert mha_args.mha_scales(0.125, 0.5, 2.0) == (0.0625, 2.0)
    assert [mha_args.window_left(w) for w in (None, 1, 128)] == [-1, 0, 127]
    view = mha_args.hnd_view(torch.zeros(64, 1, 8), 16)
    assert view.shape == (4, 1, 16, 8) and view.stride() == (128, 128, 8, 1)
    buf = torch.arange(64 * 2 * 8.0).view(64, 2, 8)
    view = mha_args.hnd_view(buf, 16)
    assert view.shape == (4, 2, 16, 8) and torch.equal(view[1, 1, 3], buf[16 + 3, 1])
    assert table_width(70, 32) == 3 and table_width(0, 16) == 1
    assert [
        decode_q_len(True, False, [1, 1]),
        decode_q_len(False, True, [4, 4]),
        decode_q_len(False, True, [4, 2]),
    ] == [1, 4, None]
    with pytest.raises(InvalidArgumentError, match="q"):
        mha_args.decode_kwargs(
            torch.zeros(3, 2, 8),
            None,
            None,
            torch.zeros(2, 1, dtype=torch.int32),
            None,
            max_seq_len=1,
            scales=(1, 1),
            window=-1,
            q_len=1,
            sinks=None,
        )


def test_block_tables_into_a_fixed_buffer():
    r2t = torch.zeros(3, 128, dtype=torch.int32)
    r2t[2, :70] = torch.cat([torch.arange(320, 352), torch.arange(96, 128), torch.arange(640, 646)]).to(torch.int32)
    r2t[0, :5] = torch.arange(32, 37, dtype=torch.int32)
    out = torch.full((4, 4), 9, dtype=torch.int32)
    t = block_tables(r2t, torch.tensor([2, 0]), torch.tensor([70, 5], dtype=torch.int32), 32, 4, out=out)
    assert t.data_ptr() == out.data_ptr() and out.tolist() == [[10, 3, 20, 0], [1, 0, 0, 0], [9] * 4, [9] * 4]


@pytest.mark.parametrize(
    ("mode", "reqs", "kernels"),
    [
        ("DECODE", [(20, 1), (3, 1)], ["decode"]),
        ("TARGET_VERIFY", [(20, 3), (3, 3)], ["decode"]),
        ("EXTEND", [(20, 3), (7, 0), (0, 9)], ["context"]),
        ("MIXED", [(20, 1), (0, 9)], ["context"]),
        ("DRAFT_EXTEND", [(20, 2), (5, 3)], ["context"]),
    ],
)
def test_each_mode_takes_its_kernel(mode, reqs, kernels):
    vendor = trtllm_mha_vendor()
    assert_case(cpu_backend_class(TrtllmMHABackend, vendor), AttnCase(mode, reqs, custom_mask=False, **MHA))
    assert set(vendor.calls) == set(kernels)


@pytest.mark.parametrize("mode", ["DECODE", "EXTEND"])
def test_layer_kv_scales_fold_into_bmm1_and_bmm2(mode):
    reqs = [(20, 1), (3, 1)] if mode == "DECODE" else [(20, 3), (0, 5)]
    case = AttnCase(mode, reqs, **MHA)
    outs = []
    for cls in (backend_class(), TorchNativeBackend):
        env = make_env(case)
        backend = cls(env.ctx)
        layer = make_layer(case, 0)
        layer.k_scale, layer.v_scale = 0.5, 2.0
        inputs = layer_inputs(env, 0, torch.Generator().manual_seed(3))
        backend.init_forward_metadata(env.batch)
        outs.append(backend.forward(inputs["q"], inputs["k"], inputs["v"], layer, env.batch).float())
    assert (outs[0] - outs[1]).abs().max() / outs[1].abs().max() < 2e-2


def test_graph_buffers_and_refusals():
    env = make_env(AttnCase("DECODE", [(40, 1), (3, 1)], **MHA))
    backend = backend_class()(env.ctx)
    b = env.batch
    with pytest.raises(InvalidArgumentError, match="init_cuda_graph_state"):
        backend.init_forward_metadata_capture_cuda_graph(
            2, 2, b.req_pool_indices, b.seq_lens, None, ForwardMode.DECODE, None
        )
    backend.init_cuda_graph_state(4, 16)
    g = backend._graph
    assert g["table"].shape == (4, table_width(env.ctx.max_context_len, 16))
    backend.init_forward_metadata_capture_cuda_graph(
        2, 2, b.req_pool_indices, b.seq_lens, None, ForwardMode.DECODE, None
    )
    g["table"].fill_(-5)
    backend.init_forward_metadata_replay_cuda_graph(
        2, b.req_pool_indices, b.seq_lens, b.seq_lens_sum, None, ForwardMode.DECODE, None, b.seq_lens_cpu
    )
    plan = backend.forward_metadata.plan
    assert plan.block_tables.data_ptr() == g["table"].data_ptr() and plan.max_seq_len == g["table"].shape[1] * 16
    assert (g["table"][2:] == -5).all() and g["seq_lens"][:2].tolist() == b.seq_lens.tolist()
    with pytest.raises(InvalidArgumentError, match="captured"):
        backend.init_forward_metadata_replay_cuda_graph(
            1, b.req_pool_indices[:1], b.seq_lens[:1], 41, None, ForwardMode.DECODE, None, None
        )
    with pytest.raises(UnsupportedFeatureError, match="EXTEND"):
        backend.capture_cuda_graph_metadata(
            CudaGraphStep(
                forward_mode=ForwardMode.EXTEND,
                bs=2,
                num_tokens=4,
                req_pool_indices=b.req_pool_indices,
                seq_lens=b.seq_lens,
            )
        )
    env2 = make_env(AttnCase("DECODE", [(3, 1)], **{**MHA, "v_head_dim": 32}))
    with pytest.raises(IncompatibleBackendError, match="v_head_dim"):
        backend_class()(env2.ctx)


@pytest.mark.parametrize("page_size", [16, 64])
def test_engine_steps_match_torch_native_and_the_reference(page_size):
    worlds = [
        EngineWorld(backend_class(), page_size=page_size, dtype=torch.bfloat16, head_dim=64),
        EngineWorld(
            lambda ctx: ac.create_backend("torch_native", ctx), page_size=page_size, dtype=torch.bfloat16, head_dim=64
        ),
    ]
    seen = compare_over_steps(worlds, MIXED_STEPS, seed=page_size, tol=2e-2)
    assert [s[0] for s in seen] == ["EXTEND", "MIXED", "MIXED", "MIXED", "DECODE", "MIXED"]
