"""The emulated AITER operators themselves: each against a float64 reference written here from the
definition (dense per-sequence softmax attention), on random shapes and paged layouts, and the documented
edge cases (bottom-right causal masks, CSR page lists, workspace and partition bounds, the MLA kernels'
query and head limits, the two forms of mla_decode_fwd)."""

from __future__ import annotations

import inspect
import math
import random

import pytest
import torch
from attn_aiter.testing import emulated_ops as ops

TOL = 2e-2  # fp16/bf16 outputs


def ref64(q, k, v, visible, scale):
    """float64 attention of one sequence: q [Sq, H, D], k/v [Sk, Hkv, *], visible [Sq][Sk] booleans."""
    g = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(g, 1)
    v = v.double().repeat_interleave(g, 1)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    for i in range(q.shape[0]):
        js = [j for j in range(k.shape[0]) if visible[i][j]]
        if js:
            s = torch.einsum("hd,jhd->hj", q[i].double(), k[js]) * scale
            out[i] = torch.einsum("hj,jhd->hd", torch.softmax(s, -1), v[js])
    return out


def rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-12))


def causal_br(sq, sk):
    return [[j <= i + sk - sq for j in range(sk)] for i in range(sq)]


def paged(lens, block, heads, dim, dtype, gen):
    """Random K/V per sequence scattered over shuffled pages of NaN-poisoned NHD caches; returns the
    caches, CSR (indptr, page ids, last page lens) and the dense K/V."""
    npages = [-(-n // block) for n in lens]
    total = sum(npages) + 3
    kc = torch.full((total, block, heads, dim), float("nan"), dtype=dtype)
    vc = torch.full((total, block, heads, dim), float("nan"), dtype=dtype)
    perm = (torch.randperm(total - 1, generator=gen) + 1).tolist()
    ids, dense = [], []
    for n, m in zip(lens, npages):
        pg, perm = perm[:m], perm[m:]
        ids += pg
        k = torch.randn(n, heads, dim, generator=gen).to(dtype)
        v = torch.randn(n, heads, dim, generator=gen).to(dtype)
        for t in range(n):
            kc[pg[t // block], t % block], vc[pg[t // block], t % block] = k[t], v[t]
        dense.append((k, v))
    indptr = torch.tensor([0, *[sum(npages[: i + 1]) for i in range(len(lens))]], dtype=torch.int32)
    last = torch.tensor([n - (m - 1) * block for n, m in zip(lens, npages)], dtype=torch.int32)
    return kc, vc, (indptr, torch.tensor(ids, dtype=torch.int32), last), dense


def pa_call(q, kc, vc, csr, block, parts, scale=0.3, layout="NHD", ws=None, **change):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    ws = (
        torch.empty(ops.pa_workspace_bytes(q.shape[0], q.shape[1], parts, q.shape[2], 2), dtype=torch.uint8)
        if ws is None
        else ws
    )
    one = torch.ones(1)
    args = dict(
        out=out,
        workspace_buffer=ws,
        query=q,
        key_cache=kc,
        value_cache=vc,
        scale=scale,
        kv_indptr=csr[0],
        kv_page_indices=csr[1],
        kv_last_page_lens=csr[2],
        block_size=block,
        max_num_partitions=parts,
        alibi_slopes=None,
        kv_cache_dtype="auto",
        kv_cache_layout=layout,
        logits_soft_cap=0.0,
        k_scale=one,
        v_scale=one,
        fp8_out_scale=None,
    )
    args.update(change)
    ops.paged_attention_ragged(**args)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_paged_attention_ragged_random(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    block, hkv = rng.choice([1, 16, 32]), rng.choice([1, 2])
    hq, dtype = hkv * rng.choice([1, 4]), rng.choice([torch.float16, torch.bfloat16])
    lens = [rng.randint(1, 600) for _ in range(rng.randint(1, 4))]
    kc, vc, csr, dense = paged(lens, block, hkv, 32, dtype, gen)
    q = torch.randn(len(lens), hq, 32, generator=gen).to(dtype)
    layout = rng.choice(["NHD", "HND"])
    if layout == "HND":
        kc, vc = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    out = pa_call(q, kc, vc, csr, block, math.ceil(max(lens) / 256), layout=layout)
    for b, (k, v) in enumerate(dense):
        assert rel(out[b : b + 1], ref64(q[b : b + 1], k, v, [[True] * lens[b]], 0.3)) < TOL


def test_paged_attention_ragged_bounds():
    gen = torch.Generator().manual_seed(0)
    kc, vc, csr, _ = paged([300, 5], 16, 1, 16, torch.float16, gen)
    q = torch.randn(2, 2, 16, generator=gen).half()
    with pytest.raises(ops.EmulatedOpError, match="max_num_partitions"):
        pa_call(q, kc, vc, csr, 16, 1)  # 300 keys need 2 partitions of 256
    with pytest.raises(ops.EmulatedOpError, match="workspace"):
        pa_call(q, kc, vc, csr, 16, 2, ws=torch.empty(100, dtype=torch.uint8))
    with pytest.raises(ops.EmulatedOpError, match="int32"):
        pa_call(q, kc, vc, (csr[0].long(), csr[1], csr[2]), 16, 2)
    with pytest.raises(ops.EmulatedOpError, match=r"kv_last_page_lens\[1\]"):
        pa_call(q, kc, vc, (csr[0], csr[1], torch.tensor([12, 17], dtype=torch.int32)), 16, 2)
    with pytest.raises(ops.EmulatedOpError, match="k_scale"):
        pa_call(q, kc, vc, csr, 16, 2, k_scale=torch.full((1,), 0.5))
    with pytest.raises(ops.EmulatedOpError, match="partition_size"):
        pa_call(q, kc, vc, csr, 16, 2, partition_size=24)


def test_workspace_bytes_formula():
    assert ops.pa_workspace_bytes(2, 4, 3, 64, 2) == 2 * 4 * 3 * 64 * 2 + 2 * 2 * 4 * 3 * 4


@pytest.mark.parametrize("seed", range(4))
def test_flash_attn_varlen_causal_bottom_right(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    hkv = rng.choice([1, 2])
    hq = hkv * rng.choice([1, 3])
    qlens = [rng.randint(1, 9) for _ in range(rng.randint(1, 4))]
    klens = [n + rng.randint(0, 20) for n in qlens]
    q = torch.randn(sum(qlens), hq, 16, generator=gen).half()
    k = torch.randn(sum(klens), hkv, 16, generator=gen).half()
    v = torch.randn(sum(klens), hkv, 24, generator=gen).half()
    cq = torch.tensor([0, *[sum(qlens[: i + 1]) for i in range(len(qlens))]], dtype=torch.int32)
    ck = torch.tensor([0, *[sum(klens[: i + 1]) for i in range(len(klens))]], dtype=torch.int32)
    out = ops.flash_attn_varlen_func(q, k, v, cq, ck, max(qlens), max(klens), softmax_scale=0.4, causal=True)
    assert out.shape == (sum(qlens), hq, 24) and out.dtype == torch.float16
    for b in range(len(qlens)):
        qs, ks = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        assert rel(out[qs], ref64(q[qs], k[ks], v[ks], causal_br(qlens[b], klens[b]), 0.4)) < TOL


def test_flash_attn_varlen_default_scale_and_bounds():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(3, 2, 16, generator=gen).half(), torch.randn(5, 2, 16, generator=gen).half()
    cq, ck = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    out = ops.flash_attn_varlen_func(q, k, k, cq, ck, 3, 5)  # causal=False, scale 1/sqrt(16)
    assert rel(out, ref64(q, k, k, [[True] * 5] * 3, 0.25)) < TOL
    with pytest.raises(ops.EmulatedOpError, match="max_seqlen"):
        ops.flash_attn_varlen_func(q, k, k, cq, ck, 2, 5)
    with pytest.raises(ops.EmulatedOpError, match="end at"):
        ops.flash_attn_varlen_func(q, k, k, cq, torch.tensor([0, 4], dtype=torch.int32), 3, 5)


def mla_case(qlens, klens, heads, page, gen, dv=32, rope=8):
    """Random MLA batch over a paged latent cache [pages, page, 1, dv + rope]; CSR in pages."""
    d = dv + rope
    npages = [-(-n // page) for n in klens]
    total = sum(npages) + 2
    cache = torch.full((total, page, 1, d), float("nan"), dtype=torch.bfloat16)
    perm = (torch.randperm(total - 1, generator=gen) + 1).tolist()
    ids, dense = [], []
    for n, m in zip(klens, npages):
        pg, perm = perm[:m], perm[m:]
        ids += pg
        x = torch.randn(n, 1, d, generator=gen).bfloat16()
        for t in range(n):
            cache[pg[t // page], t % page] = x[t]
        dense.append(x)
    qo = torch.tensor([0, *[sum(qlens[: i + 1]) for i in range(len(qlens))]], dtype=torch.int32)
    kv = torch.tensor([0, *[sum(npages[: i + 1]) for i in range(len(klens))]], dtype=torch.int32)
    last = torch.tensor([n - (m - 1) * page for n, m in zip(klens, npages)], dtype=torch.int32)
    q = torch.randn(sum(qlens), heads, d, generator=gen).bfloat16()
    return q, cache, (qo, kv, torch.tensor(ids, dtype=torch.int32), last), dense


@pytest.mark.parametrize("form", [True, False], ids=["current", "earlier"])
@pytest.mark.parametrize("seed", range(3))
def test_mla_decode_random(form, seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    qn = rng.randint(1, 4)
    qlens = [qn] * rng.randint(1, 4)
    klens = [qn + rng.randint(0, 40) for _ in qlens]
    page = 1 if form else rng.choice([1, 16])
    q, cache, (qo, kv, ids, last), dense = mla_case(qlens, klens, 16, page, gen)
    o = torch.full((q.shape[0], 16, 32), float("nan"), dtype=torch.bfloat16)
    fn = ops.make_mla_decode_fwd(form)
    extra = dict(page_size=page) if form else {}
    fn(q, cache, o, qo, kv, ids, last, qn, sm_scale=0.2, **extra)
    for b, x in enumerate(dense):
        rows = slice(int(qo[b]), int(qo[b + 1]))
        assert rel(o[rows], ref64(q[rows], x, x[..., :32], causal_br(qlens[b], klens[b]), 0.2)) < TOL


def test_mla_forms_place_sm_scale_differently():
    assert list(inspect.signature(ops.make_mla_decode_fwd(True)).parameters)[8:11] == [
        "page_size",
        "nhead_kv",
        "sm_scale",
    ]
    assert list(inspect.signature(ops.make_mla_decode_fwd(False)).parameters)[8] == "sm_scale"


def test_mla_prefill_and_limits():
    gen = torch.Generator().manual_seed(4)
    q, cache, csr, dense = mla_case([150, 3], [200, 3], 32, 1, gen)
    o = torch.full((153, 32, 32), float("nan"), dtype=torch.bfloat16)
    ops.mla_prefill_fwd(q, cache, o, *csr, 150, sm_scale=0.3)
    for b, (lo, hi, lk) in enumerate([(0, 150, 200), (150, 153, 3)]):
        assert rel(o[lo:hi], ref64(q[lo:hi], dense[b], dense[b][..., :32], causal_br(hi - lo, lk), 0.3)) < TOL
    with pytest.raises(ops.EmulatedOpError, match="at most 4"):
        ops.make_mla_decode_fwd(True)(q, cache, o, *csr, 150, sm_scale=0.3)
    q2, cache2, csr2, _ = mla_case([160], [170], 16, 1, gen)
    with pytest.raises(ops.EmulatedOpError, match="at most 159"):
        ops.mla_prefill_fwd(q2, cache2, torch.empty(160, 16, 32, dtype=torch.bfloat16), *csr2, 160)
    q3, cache3, csr3, _ = mla_case([1], [7], 4, 1, gen)
    with pytest.raises(ops.EmulatedOpError, match="query heads"):
        ops.mla_prefill_fwd(q3, cache3, torch.empty(1, 4, 32, dtype=torch.bfloat16), *csr3, 1)
    q4, cache4, csr4, _ = mla_case([5], [3], 16, 1, gen)
    with pytest.raises(ops.EmulatedOpError, match="5 queries for 3 keys"):
        ops.mla_prefill_fwd(q4, cache4, torch.empty(5, 16, 32, dtype=torch.bfloat16), *csr4, 5)
    with pytest.raises(ops.EmulatedOpError, match="logit_cap"):
        ops.mla_prefill_fwd(q3, cache3, torch.empty(1, 4, 32, dtype=torch.bfloat16), *csr3, 1, logit_cap=30.0)


def test_bottom_right_causal_example():
    assert ops.bottom_right_causal(2, 3).tolist() == [[True, True, False], [True, True, True]]
