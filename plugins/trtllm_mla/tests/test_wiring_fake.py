"""The backend's wiring on the CPU (`trt_factory`, conftest.py): which steps run TRT-LLM's MLA decode (a
float64 stand-in of its documented semantics) and which its fallback, attn-flashinfer's
`FlashInferMLABackend` over FlashInfer's float64 stand-in; the block tables and key counts each TRT-LLM
step hands the kernel, over several steps of one backend, eager and in CUDA-graph capture / replay
(their metadata calls: nothing is captured on the CPU); and attn-core's conformance kit over the whole.
What this says nothing about: TRT-LLM's kernels themselves (tests/test_gpu.py, on a Blackwell GPU).
"""

from __future__ import annotations

import importlib.util

import pytest

from attn_core.testing.harness import AttnCase, assert_case

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is not None, reason="the real flashinfer is installed"
)

MLA = dict(
    arch="mla",
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    head_dim=576,
    num_kv_heads=1,
    num_q_heads=4,
    dtype="bfloat16",
    device="cpu",
)

#: (case, q_len of each TRT-LLM call it makes per layer and step; empty: the fallback serves it)
CASES = {
    "decode": (
        AttnCase("DECODE", [(40, 1), (0, 1), (90, 1), (3, 1), (64, 1)], page_size=32, steps=((0, 1), (2, 3, 4)), **MLA),
        1,
    ),
    "verify-chain": (
        AttnCase(
            "TARGET_VERIFY", [(33, 3), (5, 3), (60, 3)], page_size=64, custom_mask=False, steps=((0,), (1, 2)), **MLA
        ),
        3,
    ),
    "draft-extend-uniform": (AttnCase("DRAFT_EXTEND", [(20, 2), (7, 2), (31, 2)], page_size=32, **MLA), 2),
    "draft-extend-ragged": (AttnCase("DRAFT_EXTEND", [(20, 1), (7, 3), (31, 2)], page_size=32, **MLA), None),
    "extend-prefix": (AttnCase("EXTEND", [(0, 9), (13, 5), (6, 1)], page_size=32, steps=((0, 1), (2,)), **MLA), None),
    "mixed": (AttnCase("MIXED", [(21, 1), (4, 9), (0, 3)], page_size=64, **MLA), None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_steps_match_the_reference_on_the_right_kernels(trt_factory, name):
    case, q_len = CASES[name]
    trt_factory.calls.clear()
    made = []
    assert_case(lambda ctx: made.append(trt_factory(ctx)) or made[-1], case)
    if q_len is None:
        assert trt_factory.calls == [], "the fallback serves this step"
    else:
        assert trt_factory.calls and set(trt_factory.calls) == {q_len}
    assert all(b.poll_device_fault() is None for b in made)


def test_block_table_refuses_a_slot_outside_the_pool(trt_factory, monkeypatch):
    """A request row whose slot is past the pool (which validation "basic", the default, does not read on a
    GPU; emulated here, where the CPU would validate fully): the TRT-LLM step's table pads it (the kernel
    never reads there) and the backend's poll reports the slot fault."""
    import dataclasses

    import attn_core.contract.backend
    from attn_core.testing.harness import make_env

    monkeypatch.setattr(attn_core.contract.backend, "effective_level", lambda ctx: ctx.validation)

    env = make_env(AttnCase("DECODE", [(40, 1), (5, 1)], page_size=32, **MLA))
    backend = trt_factory(dataclasses.replace(env.ctx, validation="basic"))
    b = env.batch
    row = int(b.req_pool_indices[1])
    saved = env.req_to_token_pool.req_to_token[row, 0].item()
    env.req_to_token_pool.req_to_token[row, 0] = env.ctx.token_to_kv_pool.num_slots + 64
    try:
        backend.init_forward_metadata(b)
        plan = backend.forward_metadata
        assert plan.path == "trtllm-gen MLA decode"
        assert plan.block_table[1].tolist() == [-1] * plan.block_table.shape[1]
        assert "slot" in backend.poll_device_fault()
    finally:
        env.req_to_token_pool.req_to_token[row, 0] = saved


def test_conformance_kit_on_the_stand_ins(trt_factory):
    """Every check attn-core's kit derives from the declared capabilities (modes, page sizes 32 / 64,
    steps, CUDA-graph capture / replay of DECODE and TARGET_VERIFY, bad inputs, refusals) passes over the
    stand-ins, TRT-LLM's path taken by some."""
    from attn_core.testing.kit import make_plan
    from attn_core.testing.outcome import execute

    trt_factory.calls.clear()
    plan = make_plan(trt_factory, device="cpu", quick=True)
    assert plan.unavailable is None, plan.unavailable
    ran = 0
    for check in plan.checks:
        # masked_nonfinite-*: the kernels' arithmetic with Inf/NaN in masked keys, which the stand-ins compute
        # densely (they emulate the APIs, not the kernels); the GPU run checks the real ones (issue 36)
        if plan.skip_reason(check.id) is not None or check.id.startswith("masked_nonfinite"):
            continue
        outcome = execute(check)
        assert outcome.status in ("passed", "skipped"), f"{check.id}: {outcome.message}"
        ran += outcome.status == "passed"
    assert ran >= 10 and trt_factory.calls
    assert any(c.id.startswith("graph-") for c in plan.checks)
