"""The GPU verify tests' parametrization (test_triton_verify_gpu.py: GQA 32/8, head_dim 128, page 16, sinks,
the LSE, 4 and 8 drafts, chain and tree masks, TARGET_VERIFY and DRAFT_EXTEND) under the interpreter with
shorter prefixes, through the public API, against the float64 reference, with every load and store of every
kernel of the step (the Triton step check CUDA runs at the default validation, the K/V write, the verify kernel)
inside its tensors (`interp_bounds.strict_bounds`): what a GPU traps as an illegal memory access."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from interp_bounds import strict_bounds
from triton_helpers import factory, requires_interpreter

from attn_core.testing.device_path import accelerator_checks
from attn_core.testing.harness import AttnCase, compare_layer, forward_extras, layer_inputs, make_env, make_layer

pytestmark = requires_interpreter

GQA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, device="cpu", num_layers=1, dtype="float32", page_size=16)


@pytest.mark.parametrize("drafts", [4, 8])
@pytest.mark.parametrize("mode,tree", [("TARGET_VERIFY", False), ("TARGET_VERIFY", True), ("DRAFT_EXTEND", False)])
def test_verify_gpu_shapes_stay_in_bounds(drafts, mode, tree):
    reqs = [(40, drafts), (17, drafts), (33, drafts), (0, drafts), (47, drafts)]
    case = AttnCase(mode, reqs, custom_mask=tree, sinks=True, return_lse=True, **GQA)
    env = make_env(case)
    env.ctx = dataclasses.replace(env.ctx, validation="basic")  # the default an engine gets
    layer = make_layer(case, 0)
    inputs = layer_inputs(env, 0, torch.Generator().manual_seed(3))
    backend = factory()(env.ctx)
    env.batch.attn_backend = backend
    with accelerator_checks("triton"), strict_bounds():  # the default validation's path on CUDA
        backend.init_forward_metadata(env.batch)
        res = layer(inputs["q"], inputs["k"], inputs["v"], env.batch, **forward_extras(case, inputs))
    out_err, lse_err = compare_layer(env, layer, inputs, res, env.batch, case.step_requests()[0])
    assert out_err <= 1e-5 and lse_err <= 1e-5, (out_err, lse_err)
