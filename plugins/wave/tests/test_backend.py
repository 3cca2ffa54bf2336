"""The backend around the Wave kernels: its per-step plans (slot lists, prefilled split buffers, masks),
both decode template forms (bf16 refused where the template writes float16 only, q pre-scaled where it
takes no layer_scaling), folded K/V scales, the compile cache and the options it passes."""

from __future__ import annotations

import pytest
import torch
from attn_wave.testing import emulated_wave_lang as ew
from attn_wave.testing.emulated_wave_lang import emulated_backend_class, installed

from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.contract.errors import IncompatibleBackendError
from attn_core.testing.harness import AttnCase, assert_case, layer_inputs, make_env, make_layer

Backend = emulated_backend_class()
MHA = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)


def test_decode_plan_slot_lists_and_prefilled_split_buffers():
    env = make_env(AttnCase("DECODE", [(40, 1), (8, 1)], **MHA))
    backend = Backend(env.ctx)
    backend.init_forward_metadata(env.batch)
    plan = backend.forward_metadata.plan
    assert plan.kv_indptr.tolist() == [0, 41, 50] and plan.kv_indptr.dtype == torch.int32
    rows = env.batch.req_pool_indices.tolist()
    r2t = env.req_to_token_pool.req_to_token
    assert plan.kv_indices.tolist() == r2t[rows[0], :41].tolist() + r2t[rows[1], :9].tolist()
    assert plan.logits.shape == (8, 2, 64, 4) and (plan.logits == 0).all()
    assert plan.logits_max.shape == (8, 2, 4) and (plan.logits_max == float("-inf")).all()


def test_extend_plan_prefixes_and_left_out_requests():
    env = make_env(AttnCase("EXTEND", [(20, 3), (7, 0), (0, 9)], **MHA))
    backend = Backend(env.ctx)
    backend.init_forward_metadata(env.batch)
    plan = backend.forward_metadata.plan
    assert plan.qo_indptr.tolist() == [0, 3, 12] and plan.kv_indptr.tolist() == [0, 20, 20]
    assert plan.max_extend_len == 9 and plan.custom_mask is None
    row = env.batch.req_pool_indices[0]
    assert plan.kv_indices.tolist() == env.req_to_token_pool.req_to_token[row, :20].tolist()


def test_verify_tree_masks_go_to_the_custom_mask_kernel():
    seen = []

    def factory(ctx):
        seen.append(Backend(ctx))
        return seen[-1]

    assert_case(factory, AttnCase("TARGET_VERIFY", [(20, 4), (3, 4)], custom_mask=True, **MHA))
    plan = seen[0].forward_metadata.plan
    assert plan.custom_mask.dtype == torch.int8 and plan.mask_offsets.tolist() == [0, 4 * 24]
    assert_case(factory, AttnCase("TARGET_VERIFY", [(20, 4), (3, 4)], custom_mask=False, **MHA))
    assert seen[1].forward_metadata.plan.custom_mask is None


def test_minimal_decode_template():
    """A template without output_dtype / layer_scaling: fp16 runs right (q scaled by scale * sqrt(D)), a
    bf16 context is refused at construction."""
    with installed("minimal"):
        case = AttnCase("DECODE", [(30, 1), (2, 1)], **MHA)
        assert_case(Backend, case)
        env = make_env(AttnCase("DECODE", [(3, 1)], **{**MHA, "dtype": "bfloat16"}))
        with pytest.raises(IncompatibleBackendError, match="float16 only"):
            Backend(env.ctx)


@pytest.mark.parametrize("mode", ["DECODE", "EXTEND"])
def test_layer_kv_scales_are_folded(mode):
    reqs = [(20, 1), (3, 1)] if mode == "DECODE" else [(20, 3), (0, 5)]
    case = AttnCase(mode, reqs, **MHA)
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


def test_kernels_compile_once_per_shape_with_the_runtime_options():
    ew.COMPILED.clear()
    env = make_env(AttnCase("DECODE", [(20, 1), (3, 1)], **MHA))
    backend = Backend(env.ctx)
    layer = make_layer(env.case, 0)
    for seed in range(3):  # three layers' calls of one step: one compile of the two phases
        inputs = layer_inputs(env, 0, torch.Generator().manual_seed(seed))
        backend.init_forward_metadata(env.batch)
        backend.forward(inputs["q"], inputs["k"], inputs["v"], layer, env.batch, save_kv_cache=False)
    assert len(ew.COMPILED) == 2
    options = [opts for opts, _ in ew.COMPILED]
    assert all(o["wave_runtime"] and o["canonicalize"] and not o["run_bench"] for o in options)
    assert [o["waves_per_eu"] for o in options] == [2, 4]
