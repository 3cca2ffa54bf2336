"""GPU checks of the MHA/GQA verify kernel (`pytest -m gpu`): GQA 32/8, head_dim 128, bf16, page 16,
4 and 8 draft tokens, chain (causal) and tree masks, TARGET_VERIFY and DRAFT_EXTEND, against torch_native
on the same batch and against the float64 oracle; the dispatch is checked (the verify kernel ran);
a verify request is batch-invariant in deterministic mode. (CUDA-graph replay vs eager for verify:
GRAPH_CASES in test_triton_gpu.py.)"""

from __future__ import annotations

import pytest
import torch
from triton_determinism_checks import target_rows
from triton_helpers import factory

import attn_core as ac
from attn_core.testing.harness import AttnCase, compare_layer, forward_extras, layer_inputs, make_env, make_layer
from attn_core.testing.reference import relative_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GQA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, device="cuda", num_layers=1, dtype="bfloat16", page_size=16)


@pytest.mark.parametrize("drafts", [4, 8])
@pytest.mark.parametrize("mode,tree", [("TARGET_VERIFY", False), ("TARGET_VERIFY", True), ("DRAFT_EXTEND", False)])
def test_verify_matches_torch_native_on_cuda(drafts, mode, tree, monkeypatch):
    import attn_triton.launchers as tb

    calls = []
    real = tb.verify_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(tb, "verify_attention", counted)
    reqs = [(4000, drafts), (17, drafts), (1000, drafts), (0, drafts), (2047, drafts)]
    case = AttnCase(mode, reqs, custom_mask=tree, sinks=True, return_lse=True, **GQA)
    env = make_env(case)
    layer = make_layer(case, 0)
    inputs = layer_inputs(env, 0, torch.Generator().manual_seed(3))
    outs = {}
    for name in ("triton", "torch_native"):
        backend = factory()(env.ctx) if name == "triton" else ac.create_backend("torch_native", env.ctx)
        env.batch.attn_backend = backend
        backend.init_forward_metadata(env.batch)
        res = layer(inputs["q"], inputs["k"], inputs["v"], env.batch, **forward_extras(case, inputs))
        torch.cuda.synchronize()
        out_err, lse_err = compare_layer(env, layer, inputs, res, env.batch, case.step_requests()[0])
        assert out_err <= 2e-2 and lse_err <= 2e-2, (name, out_err, lse_err)
        outs[name] = res
    assert len(calls) == 1  # the triton run went through the verify kernel
    (o_t, lse_t), (o_n, lse_n) = outs["triton"], outs["torch_native"]
    assert relative_error(o_t, o_n) <= 2e-2
    assert (
        torch.isfinite(lse_t).all() and float((lse_t.float() - lse_n.float()).abs().max()) <= 2e-2
    )  # as the harness's LSE check


@pytest.mark.parametrize("drafts", [4, 8])
def test_verify_batch_invariant_on_cuda(drafts):
    batches = [
        ([(3000, drafts)], 0),
        ([(100, drafts), (3000, drafts), (30000, drafts)], 1),
        ([(5, drafts)] * 40 + [(3000, drafts)], 40),
    ]
    kw = {**GQA, "custom_mask": False}
    kw.pop("device")
    outs = [
        target_rows(factory(), "TARGET_VERIFY", reqs, t, deterministic=True, device="cuda", **kw) for reqs, t in batches
    ]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
