"""Plan once per step, run thin: `build_forward_metadata` decides every layer path of the step (a
`plans.StepPlan`); a layer call only picks its path (the same object for every layer of a kind) and runs
it. Checked here: the path each kind of step and layer gets (against the kernel-routing rules of
docs/design.md §2), that the paths are made once per step (not per layer call), that the path a layer
took is what attn-core's debug switch reports (`attn_core.contract.debug_paths`), and that every output still
matches the float64 oracle."""

from __future__ import annotations

import pytest
import torch
from triton_helpers import SMALL_SPLITS, factory, requires_interpreter

from attn_core.contract import debug_paths
from attn_core.contract.layer import AttentionLayer
from attn_core.testing.harness import AttnCase, assert_case, layer_inputs, make_env, make_layer
from attn_triton.mixed import MixedPath
from attn_triton.plans import CascadePath, DecodePath, ExtendPath, MLAPath

pytestmark = requires_interpreter

MLA = dict(arch="mla", kv_lora_rank=32, qk_rope_head_dim=8, num_kv_heads=1, num_q_heads=4)

#: (case, the plain layers' path class, its `path` string)
STEPS = {
    "decode": (AttnCase("DECODE", [(9, 1), (30, 1)]), DecodePath, "decode"),
    "verify": (AttnCase("TARGET_VERIFY", [(9, 4), (30, 4)], custom_mask=True), ExtendPath, "verify (q_len 4)"),
    "draft-extend-ragged": (AttnCase("DRAFT_EXTEND", [(9, 2), (30, 3)]), ExtendPath, "extend"),
    "extend": (AttnCase("EXTEND", [(9, 5), (0, 7)]), ExtendPath, "extend"),
    "mixed": (AttnCase("MIXED", [(9, 5), (30, 1)]), MixedPath, "extend+decode (mixed split)"),
    "mla-decode": (AttnCase("DECODE", [(9, 1), (30, 1)], **MLA), MLAPath, "mla-decode"),
    "mla-verify": (
        AttnCase("TARGET_VERIFY", [(9, 3), (30, 3)], custom_mask=False, **MLA),
        MLAPath,
        "mla-verify (q_len 3)",
    ),
    "mla-extend": (AttnCase("EXTEND", [(9, 3), (30, 2)], **MLA), ExtendPath, "extend"),
}


@pytest.mark.parametrize("name", list(STEPS))
def test_each_step_gets_its_path_once_and_the_layers_report_it(name):
    case, kind, path = STEPS[name]
    env = make_env(case)
    backend = factory(split_policy=SMALL_SPLITS)(env.ctx)
    env.batch.attn_backend = backend
    backend.init_forward_metadata(env.batch)
    plan = backend.forward_metadata
    layers = [make_layer(case, i) for i in range(2)]
    assert isinstance(plan.plain, kind) and plan.path == path
    assert all(plan.path_for(layer) is plan.plain for layer in layers)  # made at build time, not per call
    gen = torch.Generator().manual_seed(0)
    with debug_paths.recording() as calls:
        for layer in layers:
            x = layer_inputs(env, layer.layer_id, gen)
            backend.forward(x["q"], x["k"], x["v"], layer, env.batch)
    assert [c.path for c in calls] == [path, path] and {c.backend for c in calls} == {"triton"}


@pytest.mark.parametrize("name", list(STEPS))
def test_outputs_still_match_the_oracle(name):
    assert_case(factory(split_policy=SMALL_SPLITS), STEPS[name][0])


def test_cross_cascade_and_local_layers_have_their_own_paths():
    """Per-layer kinds in one step: cross-attention layers (encoder keys, non-causal), a cascade step's
    plain layers (suffix + prefix pass) next to its window layers (unsplit), chunked local layers."""
    env = make_env(AttnCase("EXTEND", [(6, 3, 5), (2, 4, 3)], cross_attention=True))
    backend = factory()(env.ctx)
    backend.init_forward_metadata(env.batch)
    plan = backend.forward_metadata
    assert plan.describe(make_layer(env.case, 0)) == "extend" and plan.cross is not None

    env = make_env(AttnCase("DECODE", [(20, 1), (20, 1)], cascade_prefix=16, sliding_window=5))
    backend = factory()(env.ctx)
    backend.init_forward_metadata(env.batch)
    plan = backend.forward_metadata
    assert isinstance(plan.cascade, CascadePath) and plan.cascade.path == "cascade: decode + extend prefix"
    windowed = make_layer(env.case, 0)
    assert plan.path_for(windowed) is plan.plain  # a window layer runs unsplit
    full = AttentionLayer(1, windowed.num_q_heads, windowed.num_kv_heads, windowed.head_dim)
    assert plan.path_for(full) is plan.cascade and plan.path_for(full, sinks=torch.zeros(4)) is plan.plain

    env = make_env(AttnCase("EXTEND", [(9, 5), (0, 7)], attention_chunk_size=4))
    backend = factory()(env.ctx)
    backend.init_forward_metadata(env.batch)
    plan = backend.forward_metadata
    local = make_layer(env.case, 0)
    assert local.attention_chunk_size == 4 and plan.path_for(local) is plan.local and plan.local.path == "extend"
