"""DeepSeek's prefill on TRT-LLM's ragged kernel, on CPU: the routing, layouts, argument packing, LSE
conversion and workspace sizing against plain loops and worked examples, and the whole path (plan,
attn-core's chunk loop and LSE merges) over several steps of the same requests against the float64
reference, with a fake kernel that computes FlashInfer's documented semantics in float64 (including the
base-2 LSE) in place of the vendor call."""

from __future__ import annotations

import math
import random

import pytest
import torch

import attn_core as ac
from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.testing.reference import reference_attention, relative_error, tolerance
from attn_trtllm_mla.args import Scales
from attn_trtllm_mla.ragged import (
    COUNTER_BYTES,
    check_workspace,
    natural_lse,
    plan_ragged_prefill,
    ragged_kwargs,
    ragged_layout,
    uses_ragged_kernel,
    workspace_bytes_needed,
)

CPU = torch.device("cpu")
LN2 = math.log(2.0)


# ---- pure helpers --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kernel", "qk", "v", "want"),
    [
        ("trtllm-gen", 192, 128, True),
        ("trtllm-gen", 128, 128, True),
        ("trtllm-gen", 192, 64, False),
        ("trtllm-gen", 576, 512, False),
        (None, 192, 128, False),
    ],
)
def test_uses_ragged_kernel(kernel, qk, v, want):
    assert uses_ragged_kernel(kernel, qk, v) is want


def test_layout_worked_example():
    lay = ragged_layout(torch.tensor([3, 2]), torch.tensor([4, 0]), False, CPU)
    assert (
        lay.cu_seqlens_q.tolist() == [0, 3, 5]
        and lay.cu_seqlens_kv.tolist() == [0, 4, 4]
        and lay.kv_lens.tolist() == [4, 0]
    )
    assert all(t.dtype == torch.int32 for t in (lay.cu_seqlens_q, lay.cu_seqlens_kv, lay.kv_lens))
    assert (lay.max_q_len, lay.max_kv_len, lay.num_q_tokens, lay.num_kv_tokens, lay.batch_size) == (3, 4, 5, 4, 2)
    assert lay.has_keys.tolist() == [True, True, True, False, False] and not lay.causal
    own = ragged_layout(torch.tensor([3, 2]), torch.tensor([3, 2]), True, CPU)
    assert own.has_keys is None and own.causal and own.cu_seqlens_kv.tolist() == [0, 3, 5]


@pytest.mark.parametrize("seed", range(10))
def test_layout_matches_a_plain_loop(seed):
    rng = random.Random(seed)
    bs = rng.randint(1, 7)
    ql = [rng.randint(1, 40) for _ in range(bs)]
    kl = [rng.choice([0, rng.randint(1, 50)]) for _ in range(bs)]
    lay = ragged_layout(torch.tensor(ql, dtype=torch.int32), torch.tensor(kl, dtype=torch.int32), False, CPU)
    cq, ck = [0], [0]
    for a, b in zip(ql, kl):
        cq.append(cq[-1] + a)
        ck.append(ck[-1] + b)
    assert lay.cu_seqlens_q.tolist() == cq and lay.cu_seqlens_kv.tolist() == ck and lay.kv_lens.tolist() == kl
    assert (lay.max_q_len, lay.max_kv_len, lay.num_q_tokens, lay.num_kv_tokens) == (max(ql), max(kl), cq[-1], ck[-1])
    keys = [b > 0 for a, b in zip(ql, kl) for _ in range(a)]
    assert (lay.has_keys is None) == all(keys) and (lay.has_keys is None or lay.has_keys.tolist() == keys)


def test_layout_refuses_mismatched_lengths():
    with pytest.raises(InvalidArgumentError, match="kv_lens"):
        ragged_layout(torch.tensor([1, 2]), torch.tensor([1]), False, CPU)


def test_workspace_sizes():
    assert workspace_bytes_needed(1000, 128) == 8388608 + 1024000
    assert workspace_bytes_needed(1, 1) == COUNTER_BYTES + 16  # statistics rounded up to 16 bytes
    check_workspace(1000, 128, torch.zeros(workspace_bytes_needed(1000, 128), dtype=torch.uint8))
    with pytest.raises(InvalidArgumentError, match="at most 999 new tokens"):
        check_workspace(1000, 128, torch.zeros(workspace_bytes_needed(999, 128), dtype=torch.uint8))


def test_natural_lse_worked_example_and_base():
    got = natural_lse(torch.tensor([[1.0, -2.0], [3.0, 0.5]]), torch.tensor([True, False]))
    assert torch.allclose(got[0], torch.tensor([LN2, -2 * LN2])) and torch.isneginf(got[1]).all()
    s = torch.randn(6, 3, 9, dtype=torch.float64)  # scores of 6 queries, 3 heads, 9 keys
    base2 = torch.log2(torch.exp(s).sum(-1)).float()
    assert torch.allclose(natural_lse(base2, None).double(), torch.logsumexp(s, -1), atol=1e-5)


def _qkv(tq, tk, h=4, d=192, dv=128, dtype=torch.bfloat16):
    return torch.randn(tq, h, d).to(dtype), torch.randn(tk, h, d).to(dtype), torch.randn(tk, h, dv).to(dtype)


def test_ragged_kwargs_worked_example():
    lay = ragged_layout(torch.tensor([3, 2]), torch.tensor([4, 0]), False, CPU)
    q, k, v = _qkv(5, 4, h=16)
    ws = torch.zeros(workspace_bytes_needed(5, 16), dtype=torch.uint8)
    kw = ragged_kwargs(q, k, v, lay, Scales(0.07, 1.0), ws)
    assert (
        kw["query"].data_ptr() == q.data_ptr()
        and kw["key"].data_ptr() == k.data_ptr()
        and kw["value"].data_ptr() == v.data_ptr()
    )
    assert (
        kw["seq_lens"].tolist() == [4, 0]
        and kw["cum_seq_lens_q"].tolist() == [0, 3, 5]
        and kw["cum_seq_lens_kv"].tolist() == [0, 4, 4]
    )
    assert (kw["max_q_len"], kw["max_kv_len"], kw["batch_size"], kw["is_causal"]) == (3, 4, 2, False)
    assert (kw["bmm1_scale"], kw["bmm2_scale"], kw["window_left"], kw["return_lse"]) == (0.07, 1.0, -1, True)
    assert kw["workspace_buffer"] is ws
    nc = torch.randn(5, 16, 400).to(torch.bfloat16)[..., :192]  # a non-contiguous q is made contiguous
    assert ragged_kwargs(nc, k, v, lay, Scales(0.07, 1.0), ws)["query"].is_contiguous()


def test_ragged_kwargs_refuse_bad_inputs():
    lay = ragged_layout(torch.tensor([3, 2]), torch.tensor([4, 0]), False, CPU)
    q, k, v = _qkv(5, 4)
    ws = torch.zeros(workspace_bytes_needed(5, 4), dtype=torch.uint8)
    sc = Scales(1.0, 1.0)
    with pytest.raises(InvalidArgumentError, match="5 query rows"):
        ragged_kwargs(q[:4], k, v, lay, sc, ws)
    with pytest.raises(InvalidArgumentError, match="4 key rows"):
        ragged_kwargs(q, k[:3], v[:3], lay, sc, ws)
    with pytest.raises(InvalidArgumentError, match="4 heads"):
        ragged_kwargs(q, k[:, :2], v[:, :2], lay, sc, ws)
    with pytest.raises(InvalidArgumentError, match="head dims"):
        ragged_kwargs(q, k, v[..., :64], lay, sc, ws)
    with pytest.raises(InvalidArgumentError, match="tokens, heads, head_dim"):
        ragged_kwargs(q.flatten(1), k, v, lay, sc, ws)
    with pytest.raises(UnsupportedFeatureError, match="bfloat16"):
        ragged_kwargs(q.half(), k.half(), v.half(), lay, sc, ws)
    with pytest.raises(InvalidArgumentError, match="workspace"):
        ragged_kwargs(q, k, v, lay, sc, ws[:-16])


# ---- the whole path with a float64 fake of the kernel ----------------------------------------------
class FakeRaggedKernel:
    """FlashInfer 0.6.6's documented `trtllm_ragged_attention_deepseek` in float64: per request b, queries
    cum_seq_lens_q[b]..[b+1] over keys cum_seq_lens_kv[b]..[b+1] (seq_lens[b] of them), scores
    bmm1_scale·q·k, causal bottom-right aligned, output bmm2_scale·softmax·V in q's dtype, LSE in base 2.
    A request without keys gets NaN output and a finite garbage LSE (what the real kernel writes there
    is not documented). Records the calls."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append(kw)
        q, k, v = kw["query"], kw["key"], kw["value"]
        cu_q, cu_k, seq = kw["cum_seq_lens_q"], kw["cum_seq_lens_kv"], kw["seq_lens"]
        assert all(t.dtype == torch.int32 for t in (cu_q, cu_k, seq)) and q.is_contiguous()
        assert kw["return_lse"] and kw["window_left"] == -1 and not kw["workspace_buffer"][:COUNTER_BYTES].any()
        cu_q, cu_k, seq = cu_q.tolist(), cu_k.tolist(), seq.tolist()
        bs = kw["batch_size"]
        assert len(seq) == bs and len(cu_q) == len(cu_k) == bs + 1 and cu_q[-1] == q.shape[0] and cu_k[-1] == k.shape[0]
        T, H, _ = q.shape
        out = torch.full((T, H, v.shape[2]), float("nan"), dtype=q.dtype)
        lse = torch.full((T, H), 3.0, dtype=torch.float32)
        for b in range(bs):
            nq, nk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
            assert nk == seq[b] and nq <= kw["max_q_len"] and nk <= kw["max_kv_len"]
            if nk == 0:
                continue
            qb = q[cu_q[b] : cu_q[b + 1]].double()
            kb, vb = k[cu_k[b] : cu_k[b + 1]].double(), v[cu_k[b] : cu_k[b + 1]].double()
            s = torch.einsum("qhd,khd->hqk", qb, kb) * kw["bmm1_scale"]
            if kw["is_causal"]:
                later = torch.arange(nk)[None, :] > torch.arange(nq)[:, None] + (nk - nq)
                s = s.masked_fill(later, float("-inf"))
            m = s.amax(-1, keepdim=True)
            p = torch.exp(s - m)
            d = p.sum(-1, keepdim=True)
            out[cu_q[b] : cu_q[b + 1]] = (torch.einsum("hqk,khd->qhd", p / d, vb) * kw["bmm2_scale"]).to(q.dtype)
            lse[cu_q[b] : cu_q[b + 1]] = ((m + torch.log(d)).squeeze(-1) / LN2).T.float()
        return out, lse


def test_fake_kernel_against_the_reference():
    """The fake itself: one causal request against attn-core's float64 reference (LSE in base 2)."""
    lay = ragged_layout(torch.tensor([7]), torch.tensor([7]), True, CPU)
    q, k, v = _qkv(7, 7)
    o, lse = FakeRaggedKernel()(
        ragged_kwargs(q, k, v, lay, Scales(0.1, 1.0), torch.zeros(COUNTER_BYTES + 4096, dtype=torch.uint8))
    )
    ref, ref_lse = reference_attention(q, k, v, q_positions=torch.arange(7), scale=0.1)
    assert relative_error(o, ref) <= tolerance(torch.bfloat16)
    assert torch.allclose(lse.double() * LN2, ref_lse, atol=1e-4)


PAGE = 32
H = 4


def _setup(rows=8, slots=2048, max_len=512):
    return ac.RequestPool(ac.ReqToTokenPool(rows, max_len), ac.PagedTokenAllocator(slots, PAGE))


@pytest.mark.parametrize("seed", range(4))
def test_chunked_prefill_over_several_steps_matches_reference(seed):
    """Requests prefill their prompts in chunks over three steps (a new request joins at step 2); each
    step plans once with a chunk capacity below the prefixes (several chunks; requests whose prefix
    ends before the last chunk or that have none) and runs two layers; the engine's 'decompression' is
    a lookup of per-slot K/V, whose unused slots hold NaN."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    pool = _setup()
    r2t = pool.req_to_token_pool.req_to_token
    layers = 2
    nslots = pool.allocator.size + PAGE
    k_store = [torch.full((nslots, H, 192), float("nan"), dtype=torch.bfloat16) for _ in range(layers)]
    v_store = [torch.full((nslots, H, 128), float("nan"), dtype=torch.bfloat16) for _ in range(layers)]
    ws = torch.zeros(COUNTER_BYTES + (1 << 16), dtype=torch.uint8)
    reqs = [pool.add() for _ in range(rng.randint(2, 3))]
    scale = 192**-0.5
    chunks_seen = 0
    for step in range(3):
        if step == 1:
            reqs.append(pool.add())
        work = [(r, rng.randint(2, 40)) for r in reqs]
        batch = ac.build_step(pool, work)
        assert batch.forward_mode.is_extend()
        prefix = batch.extend_prefix_lens_cpu.tolist()
        capacity = rng.randint(len(reqs), max(len(reqs), max(prefix) // 2 + 1))
        fake = FakeRaggedKernel()
        plan = plan_ragged_prefill(
            batch, r2t, capacity, num_heads=H, qk_head_dim=192, v_head_dim=128, scaling=scale, workspace=ws, run=fake
        )
        chunks_seen += len(plan.chunk_plan.chunks)
        T = batch.extend_num_tokens
        for layer in range(layers):
            q, k = (torch.randn(T, H, 192, generator=g).to(torch.bfloat16) for _ in range(2))
            v = torch.randn(T, H, 128, generator=g).to(torch.bfloat16)
            asked: list[int] = []

            def prefix_kv(chunk, slots, layer=layer, asked=asked):
                asked.append(chunk.index)
                return k_store[layer][slots], v_store[layer][slots]

            o, lse = plan.attend(q, k, v, prefix_kv, return_lse=True)
            assert asked == list(range(len(plan.chunk_plan.chunks)))
            o = o.view(T, H, 128)
            t0 = 0
            for (req, e), p in zip(work, prefix):
                sl = r2t[req.row, :p].long()
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
                assert (lse[t0 : t0 + e].double() - ref_lse).abs().max() < 1e-4
                t0 += e
            k_store[layer][batch.out_cache_loc.long()] = k  # the engine caches this step's tokens
            v_store[layer][batch.out_cache_loc.long()] = v
        assert len(fake.calls) == layers * (1 + len(plan.chunk_plan.chunks))
        assert fake.calls[0]["is_causal"] and all(
            not c["is_causal"] for c in fake.calls[1 : 1 + len(plan.chunk_plan.chunks)]
        )
    assert chunks_seen >= 2


def test_plan_refuses_other_modes_head_dims_and_small_workspaces():
    pool = _setup()
    a = pool.add()
    ac.build_step(pool, [(a, 5)])
    decode = ac.build_step(pool, [(a, 1)])
    r2t = pool.req_to_token_pool.req_to_token
    ws = torch.zeros(COUNTER_BYTES + 4096, dtype=torch.uint8)
    common = dict(num_heads=H, scaling=0.1, workspace=ws, run=FakeRaggedKernel())
    with pytest.raises(InvalidArgumentError, match="EXTEND"):
        plan_ragged_prefill(decode, r2t, 64, qk_head_dim=192, v_head_dim=128, **common)
    b = pool.add()
    extend = ac.build_step(pool, [(b, 300)])
    with pytest.raises(UnsupportedFeatureError, match="head dims"):
        plan_ragged_prefill(extend, r2t, 64, qk_head_dim=576, v_head_dim=512, **common)
    with pytest.raises(InvalidArgumentError, match="new tokens"):
        plan_ragged_prefill(extend, r2t, 64, qk_head_dim=192, v_head_dim=128, **common)
