"""trtllm_mla on a Blackwell GPU against the float64 reference: attn-core's conformance kit (every declared
capability, CUDA graphs) and DeepSeek's prefill on TRT-LLM's ragged kernel (its LSE convention
included). Skips everywhere else with the reason, which names the missing architecture (no Blackwell
GPU was available to this project: these tests have never run)."""

from __future__ import annotations

import pytest

from attn_core.testing import ConformanceSuite
from attn_trtllm_mla.spec import SPEC

pytestmark = pytest.mark.gpu
REASON = SPEC.probe()


class TestConformanceOnCuda(ConformanceSuite):
    """attn-core's conformance kit on cuda at the quick sizes (skipped, with the probe's reason: no Blackwell GPU)."""

    backend = "trtllm_mla"
    device = "cuda"
    quick = True


# ---- DeepSeek's prefill on TRT-LLM's ragged kernel (compute capability 10.x) ------------------------
def _ragged_reason():
    needs = "TRT-LLM's ragged prefill needs a Blackwell SM100/SM103 GPU (compute capability 10.x)"
    if REASON is not None:
        return f"{needs}; trtllm_mla cannot run here: {REASON}"
    import torch

    from attn_trtllm_mla.kernel import kernel_for

    cc = torch.cuda.get_device_capability()
    if kernel_for(cc, torch.bfloat16) != "trtllm-gen":
        return f"{needs}, found {cc[0]}.{cc[1]}"
    return None


RAGGED_REASON = _ragged_reason()
requires_ragged = pytest.mark.skipif(RAGGED_REASON is not None, reason=str(RAGGED_REASON))


@requires_ragged
@pytest.mark.parametrize("causal", [True, False])
def test_ragged_kernel_output_and_lse_convention(causal):
    """One direct call per mask against the float64 reference: the output, and the LSE read as base 2
    and token-major `[T, H]` (what `ragged.natural_lse` assumes); a request with no key (non-causal
    pass: a chunk its prefix does not reach) leaves the others intact and is masked to -inf; the
    workspace's semaphores stay zero."""
    import math

    import torch

    from attn_core.testing.reference import reference_attention, relative_error, tolerance
    from attn_trtllm_mla import kernel
    from attn_trtllm_mla.args import fold_scales
    from attn_trtllm_mla.ragged import COUNTER_BYTES, natural_lse, ragged_kwargs, ragged_layout

    g = torch.Generator().manual_seed(1)
    H, scale = 128, 192**-0.5
    q_lens = [37, 1, 130, 64]
    kv_lens = q_lens if causal else [300, 0, 129, 1]
    lay = ragged_layout(torch.tensor(q_lens), torch.tensor(kv_lens), causal, torch.device("cuda"))
    q = torch.randn(sum(q_lens), H, 192, generator=g).to(torch.bfloat16).cuda()
    k = torch.randn(sum(kv_lens), H, 192, generator=g).to(torch.bfloat16).cuda()
    v = torch.randn(sum(kv_lens), H, 128, generator=g).to(torch.bfloat16).cuda()
    ws = kernel.new_workspace(torch.device("cuda"))
    o, lse = kernel.ragged_prefill(ragged_kwargs(q, k, v, lay, fold_scales(scale, None, None), ws))
    assert o.shape == (sum(q_lens), H, 128) and lse.shape == (sum(q_lens), H) and lse.dtype == torch.float32
    raw = lse.clone()
    lse = natural_lse(lse, lay.has_keys)
    t0 = k0 = 0
    for nq, nk in zip(q_lens, kv_lens):
        if nk == 0:
            assert torch.isneginf(lse[t0 : t0 + nq]).all()
        else:
            ref, ref_lse = reference_attention(
                q[t0 : t0 + nq],
                k[k0 : k0 + nk],
                v[k0 : k0 + nk],
                q_positions=torch.arange(nk - nq, nk),
                scale=scale,
                causal=causal,
            )
            assert relative_error(o[t0 : t0 + nq], ref) <= tolerance(torch.bfloat16)
            assert (lse[t0 : t0 + nq].double().cpu() - ref_lse).abs().max() < 2e-2
            assert (
                raw[t0 : t0 + nq].double().cpu() * math.log(2.0) - ref_lse
            ).abs().max() < 2e-2  # base 2, not natural
        t0, k0 = t0 + nq, k0 + nk
    assert not ws[:COUNTER_BYTES].any()


@requires_ragged
@pytest.mark.parametrize(("seed", "H"), [(0, 16), (1, 128)])
def test_chunked_prefix_prefill_on_ragged_kernel_matches_reference(seed, H):
    """The backend's `plan_prefill` on TRT-LLM's ragged kernel over three steps of the same requests
    (prompts prefilled in chunks, a request joining at step 2), chunk capacities below the prefixes
    (several chunks, requests whose prefix ends before the last chunk or that have none), two layers
    per step, 192/128, bf16; the engine's 'decompression' is a lookup of per-slot K/V (NaN where unused)."""
    import random

    import torch

    import attn_core as ac
    from attn_core.contract.context import BackendContext
    from attn_core.memory import MLATokenToKVPool
    from attn_core.testing.reference import reference_attention, relative_error, tolerance
    from attn_trtllm_mla.backend import TRTLLMMLABackend
    from attn_trtllm_mla.ragged import RaggedPrefillPlan

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    ps, slots, layers, scale = 64, 64 * 400, 2, 192**-0.5
    r2t = ac.ReqToTokenPool(8, 4096, "cuda")
    pool = MLATokenToKVPool(slots, ps, torch.bfloat16, 512, 64, 1, "cuda")
    requests = ac.RequestPool(r2t, ac.PagedTokenAllocator(slots, ps), pool)
    ctx = BackendContext(
        device="cuda",
        dtype=torch.bfloat16,
        num_q_heads=H,
        num_kv_heads=1,
        head_dim=576,
        attention_arch="mla",
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        page_size=ps,
        max_context_len=r2t.max_context_len,
        req_to_token_pool=r2t,
        token_to_kv_pool=pool,
    )
    backend = TRTLLMMLABackend(ctx)
    k_store = [
        torch.full((slots + ps, H, 192), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(layers)
    ]
    v_store = [
        torch.full((slots + ps, H, 128), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(layers)
    ]
    reqs = [requests.add() for _ in range(rng.randint(2, 4))]
    chunks_seen = 0
    for step in range(3):
        if step == 1:
            reqs.append(requests.add())
        work = [(r, rng.randint(2, 700)) for r in reqs]
        batch = ac.build_step(requests, work)
        prefix = batch.extend_prefix_lens_cpu.tolist()
        capacity = rng.randint(len(reqs), max(len(reqs), max(prefix) // 2 + 1))
        plan = backend.plan_prefill(batch, capacity, scaling=scale)
        assert isinstance(plan, RaggedPrefillPlan)
        chunks_seen += len(plan.chunk_plan.chunks)
        T = batch.extend_num_tokens
        for layer in range(layers):
            q, k = (torch.randn(T, H, 192, generator=g).to(torch.bfloat16).cuda() for _ in range(2))
            v = torch.randn(T, H, 128, generator=g).to(torch.bfloat16).cuda()
            o, lse = plan.attend(
                q, k, v, lambda c, s, layer=layer: (k_store[layer][s], v_store[layer][s]), return_lse=True
            )
            o = o.view(T, H, 128)
            t0 = 0
            for (req, e), p in zip(work, prefix):
                sl = r2t.req_to_token[req.row, :p].long()
                keys, vals = (
                    torch.cat([k_store[layer][sl], k[t0 : t0 + e]]),
                    torch.cat([v_store[layer][sl], v[t0 : t0 + e]]),
                )
                ref, ref_lse = reference_attention(
                    q[t0 : t0 + e], keys, vals, q_positions=torch.arange(p, p + e), scale=scale
                )
                err = relative_error(o[t0 : t0 + e], ref)
                assert err <= tolerance(torch.bfloat16), (
                    f"step {step} layer {layer} request ({p}, {e}): rel err {err:.3g}"
                )
                assert (lse[t0 : t0 + e].double().cpu() - ref_lse).abs().max() < 2e-2
                t0 += e
            k_store[layer][batch.out_cache_loc.long()] = k
            v_store[layer][batch.out_cache_loc.long()] = v
    assert chunks_seen >= 2
