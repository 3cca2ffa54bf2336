"""The emulated operators themselves: each against a float64 reference written here from the definition
(dense per-sequence softmax attention), on random shapes, and the documented edge cases (block size
limits, sparse_mode meanings, TND vs BSND, host-side lengths, the compressed mask)."""

from __future__ import annotations

import random

import pytest
import torch
from attn_ascend.testing import emulated_ops as ops
from attn_ascend.testing.emulated_torch_npu import emulated_torch_npu

TOL = 2e-2  # fp16/bf16 outputs


def ref64(q, k, v, visible, scale):
    """float64 attention of one sequence: q [Sq, N, D], k/v [Skv, Nkv, *], visible [Sq, Skv]."""
    g = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(g, 1)
    v = v.double().repeat_interleave(g, 1)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    for i in range(q.shape[0]):
        js = [j for j in range(k.shape[0]) if visible[i][j]]
        if not js:
            continue
        s = torch.einsum("nd,jnd->nj", q[i].double(), k[js]) * scale
        p = torch.softmax(s, -1)
        out[i] = torch.einsum("nj,jnd->nd", p, v[js])
    return out


def rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-12))


def paged(seqs, block, heads, dim, dtype, gen):
    """Random K (and V) per sequence scattered into a paged cache; returns caches, block table, dense K/V."""
    pages_each = [-(-n // block) for n in seqs]
    total = sum(pages_each) + 2
    kc = torch.full((total, block, heads, dim), float("nan"), dtype=dtype)
    vc = torch.full((total, block, heads, dim), float("nan"), dtype=dtype)
    perm = torch.randperm(total - 1, generator=gen) + 1
    table = torch.zeros(len(seqs), max(pages_each + [1]), dtype=torch.int32)
    dense = []
    cur = 0
    for b, n in enumerate(seqs):
        pg = perm[cur : cur + pages_each[b]]
        cur += pages_each[b]
        table[b, : len(pg)] = pg.to(torch.int32)
        k = torch.randn(n, heads, dim, generator=gen).to(dtype)
        v = torch.randn(n, heads, dim, generator=gen).to(dtype)
        for t in range(n):
            kc[pg[t // block], t % block] = k[t]
            vc[pg[t // block], t % block] = v[t]
        dense.append((k, v))
    return kc, vc, table, dense


@pytest.mark.parametrize("seed", range(4))
def test_paged_attention_random(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    block = rng.choice([16, 32, 128])
    hkv = rng.choice([1, 2])
    hq = hkv * rng.choice([1, 4])
    dtype = rng.choice([torch.float16, torch.bfloat16])
    seqs = [rng.randint(1, 3 * block) for _ in range(rng.randint(1, 4))]
    kc, vc, table, dense = paged(seqs, block, hkv, 32, dtype, gen)
    q = torch.randn(len(seqs), hq, 32, generator=gen).to(dtype)
    out = torch.full((len(seqs), hq, 32), float("nan"), dtype=dtype)
    ops._npu_paged_attention(
        query=q,
        key_cache=kc,
        value_cache=vc,
        num_kv_heads=hkv,
        num_heads=hq,
        scale_value=0.3,
        block_table=table,
        context_lens=torch.tensor(seqs, dtype=torch.int32),
        out=out,
    )
    for i, (k, v) in enumerate(dense):
        want = ref64(q[i : i + 1], k, v, [[True] * seqs[i]], 0.3)
        assert rel(out[i : i + 1], want) < TOL


def test_paged_attention_mla_uses_the_first_channels_as_value():
    gen = torch.Generator().manual_seed(0)
    kc, _, table, dense = paged([20, 5], 16, 1, 48, torch.float16, gen)
    q = torch.randn(2, 4, 48, generator=gen).to(torch.float16)
    out = torch.empty(2, 4, 40, dtype=torch.float16)
    ops._npu_paged_attention_mla(
        query=q,
        key_cache=kc,
        num_kv_heads=1,
        num_heads=4,
        scale_value=0.2,
        block_table=table,
        context_lens=torch.tensor([20, 5], dtype=torch.int32),
        mla_vheadsize=40,
        out=out,
    )
    for i, (k, _) in enumerate(dense):
        want = ref64(q[i : i + 1], k, k[..., :40], [[True] * k.shape[0]], 0.2)
        assert rel(out[i : i + 1], want) < TOL


@pytest.mark.parametrize("block", [8, 24, 144, 256])
def test_paged_attention_refuses_block_sizes_outside_16_to_128(block):
    kc = torch.zeros(2, block, 1, 16, dtype=torch.float16)
    with pytest.raises(ops.EmulatedOpError, match="block size"):
        ops._npu_paged_attention(
            query=torch.zeros(1, 1, 16, dtype=torch.float16),
            key_cache=kc,
            value_cache=kc,
            num_kv_heads=1,
            num_heads=1,
            scale_value=1.0,
            block_table=torch.zeros(1, 1, dtype=torch.int32),
            context_lens=torch.ones(1, dtype=torch.int32),
            out=torch.zeros(1, 1, 16, dtype=torch.float16),
        )


def test_paged_attention_wants_host_int32_lengths():
    kc = torch.zeros(2, 16, 1, 16, dtype=torch.float16)
    q = torch.zeros(1, 1, 16, dtype=torch.float16)
    args = dict(
        query=q,
        key_cache=kc,
        value_cache=kc,
        num_kv_heads=1,
        num_heads=1,
        scale_value=1.0,
        block_table=torch.zeros(1, 1, dtype=torch.int32),
        out=torch.zeros_like(q),
    )
    with pytest.raises(ops.EmulatedOpError, match="int32"):
        ops._npu_paged_attention(context_lens=torch.ones(1, dtype=torch.int64), **args)
    with pytest.raises(ops.EmulatedOpError, match="block_table must be int32"):
        ops._npu_paged_attention(
            context_lens=torch.ones(1, dtype=torch.int32),
            **{**args, "block_table": torch.zeros(1, 1, dtype=torch.int64)},
        )


def test_reshape_and_cache_writes_exactly_the_slots():
    kc = torch.full((3, 16, 2, 8), float("nan"))
    vc = torch.full((3, 16, 2, 4), float("nan"))
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 4)
    slots = torch.tensor([37, 16, 5], dtype=torch.int32)
    ops._npu_reshape_and_cache(k, v, kc, vc, slots)
    assert torch.equal(kc[2, 5], k[0]) and torch.equal(kc[1, 0], k[1]) and torch.equal(vc[0, 5], v[2])
    assert int((~kc.isnan()).reshape(48, -1).all(-1).sum()) == 3
    with pytest.raises(ops.EmulatedOpError, match="out of range"):
        ops._npu_reshape_and_cache(k, v, kc, vc, torch.tensor([48, 0, 1], dtype=torch.int32))


def test_visible_sparse_modes():
    """[FA-sparse]: 2 = causal from the top left, 3 = from the bottom right, 4 = band around the
    bottom-right diagonal, 0 = band from the top left (pre/next tokens) plus the given mask."""
    t, f = True, False
    assert ops._visible(2, 4, 3, 0, 0, None).tolist() == [[t, t, t, f], [t, t, t, t]]
    assert ops._visible(2, 4, 2, 0, 0, None).tolist() == [[t, f, f, f], [t, t, f, f]]
    assert ops._visible(2, 4, 4, 1, 0, None).tolist() == [[f, t, t, f], [f, f, t, t]]
    assert ops._visible(2, 3, 0, 2**31 - 1, 2**31 - 1, None).all()
    assert ops._visible(2, 3, 0, 0, 1, None).tolist() == [[t, t, f], [f, t, t]]
    m = torch.tensor([[f, t, f], [t, f, f]])
    assert ops._visible(2, 3, 1, 0, 0, m).tolist() == [[t, f, t], [f, t, t]]
    with pytest.raises(ops.EmulatedOpError):
        ops._visible(2, 3, 1, 0, 0, None)
    with pytest.raises(ops.EmulatedOpError):
        ops._visible(2, 3, 5, 0, 0, None)


FIA = emulated_torch_npu("7.0.0").npu_fused_infer_attention_score


def _causal_br(sq, skv):
    return [[j <= i + skv - sq for j in range(skv)] for i in range(sq)]


@pytest.mark.parametrize("seed", range(4))
def test_fia_tnd_paged_causal_random(seed):
    """TND queries (cumulative lengths) over paged K/V (per-sequence lengths), sparse_mode 3, GQA."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    block, hkv = rng.choice([16, 64]), rng.choice([1, 2])
    hq, d = hkv * rng.choice([1, 2]), 32
    qlens = [rng.randint(1, 9) for _ in range(rng.randint(1, 4))]
    seqs = [n + rng.randint(0, 2 * block) for n in qlens]
    kc, vc, table, dense = paged(seqs, block, hkv, d, torch.float16, gen)
    q = torch.randn(sum(qlens), hq, d, generator=gen).to(torch.float16)
    cum = [sum(qlens[: i + 1]) for i in range(len(qlens))]
    out, lse = FIA(
        q,
        kc.flatten(2),
        vc.flatten(2),
        num_heads=hq,
        num_key_value_heads=hkv,
        input_layout="TND",
        block_table=table,
        block_size=block,
        actual_seq_lengths=cum,
        actual_seq_lengths_kv=seqs,
        atten_mask=ops.compressed_causal_mask(),
        sparse_mode=3,
        scale=0.25,
    )
    assert lse.numel() == 0
    a = 0
    for i, (k, v) in enumerate(dense):
        want = ref64(q[a : cum[i]], k, v, _causal_br(qlens[i], seqs[i]), 0.25)
        assert rel(out[a : cum[i]], want) < TOL
        a = cum[i]


def test_fia_rope_adds_the_rope_scores():
    """MLA form: scores = q.k + q_rope.k_rope, values from `value` (the latent)."""
    gen = torch.Generator().manual_seed(3)
    kc, _, table, dense = paged([21, 7], 16, 1, 40, torch.bfloat16, gen)
    latent, rope = kc[..., :32], kc[..., 32:]
    q = torch.randn(5, 4, 40, generator=gen).to(torch.bfloat16)
    out, _ = FIA(
        q[..., :32].contiguous(),
        latent.flatten(2),
        latent.flatten(2),
        query_rope=q[..., 32:].contiguous(),
        key_rope=rope.flatten(2),
        num_heads=4,
        num_key_value_heads=1,
        input_layout="TND",
        block_table=table,
        block_size=16,
        actual_seq_lengths=[3, 5],
        actual_seq_lengths_kv=[21, 7],
        atten_mask=ops.compressed_causal_mask(),
        sparse_mode=3,
        scale=0.2,
    )
    for (a, b, n), (k, _) in zip([(0, 3, 21), (3, 5, 7)], dense):
        want = ref64(q[a:b], k, k[..., :32], _causal_br(b - a, n), 0.2)
        assert rel(out[a:b], want) < TOL


def test_fia_tnd_equals_bsnd_and_bsh():
    """The same equal-length batch in TND (cumulative lengths), BSND and BSH (dense K/V) gives the same output."""
    gen = torch.Generator().manual_seed(5)
    b, s, skv, n, d = 2, 3, 5, 2, 16
    q = torch.randn(b, s, n, d, generator=gen).half()
    k = torch.randn(b, skv, n, d, generator=gen).half()
    v = torch.randn(b, skv, n, d, generator=gen).half()
    mask = ops.compressed_causal_mask()
    bsnd, _ = FIA(q, k, v, num_heads=n, input_layout="BSND", atten_mask=mask, sparse_mode=3, scale=0.5)
    bsh, _ = FIA(
        q.flatten(2),
        k.flatten(2),
        v.flatten(2),
        num_heads=n,
        input_layout="BSH",
        atten_mask=mask,
        sparse_mode=3,
        scale=0.5,
    )
    tnd, _ = FIA(
        q.flatten(0, 1),
        k.flatten(0, 1),
        v.flatten(0, 1),
        num_heads=n,
        input_layout="TND",
        actual_seq_lengths=[3, 6],
        actual_seq_lengths_kv=[5, 10],
        atten_mask=mask,
        sparse_mode=3,
        scale=0.5,
    )
    assert torch.equal(bsnd.flatten(2), bsh)
    assert torch.equal(bsnd.flatten(0, 1), tnd)
    for i in range(b):
        assert rel(bsnd[i], ref64(q[i], k[i], v[i], _causal_br(s, skv), 0.5)) < TOL
    bnsd, lse = FIA(
        q.transpose(1, 2).contiguous(),
        k.transpose(1, 2).contiguous(),
        v.transpose(1, 2).contiguous(),
        num_heads=n,
        input_layout="BNSD",
        softmax_lse_flag=True,
        scale=0.5,
    )
    assert tuple(lse.shape) == (b, n, s, 1)
    assert rel(bnsd.transpose(1, 2)[0], ref64(q[0], k[0], v[0], [[True] * skv] * s, 0.5)) < TOL


def test_fia_out_variant_and_release_keywords():
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 2, 16, generator=gen).half() for _ in range(3))
    want, _ = FIA(q, k, v, num_heads=2, input_layout="BSND", scale=0.5)
    out = torch.full_like(want, float("nan"))
    FIA.out(q, k, v, num_heads=2, input_layout="BSND", scale=0.5, workspace=None, out=[out, torch.empty(1)])
    assert torch.equal(out, want)
    old = emulated_torch_npu("6.0.0").npu_fused_infer_attention_score
    assert torch.equal(old(q, k, v, num_heads=2, input_layout="BSND", scale_value=0.5)[0], want)
    with pytest.raises(TypeError):
        old(q, k, v, num_heads=2, input_layout="BSND", scale=0.5)
    with pytest.raises(TypeError):
        old(q, k, v, num_heads=2, input_layout="BSND", scale_value=0.5, query_rope=q, key_rope=k)


def test_fia_documented_limits():
    q = torch.zeros(2, 1, 16, dtype=torch.float16)
    kc = torch.zeros(2, 8, 16, dtype=torch.float16)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ops.EmulatedOpError, match="block size"):  # paged blocks: multiples of 16
        FIA(
            q,
            kc,
            kc,
            num_heads=1,
            input_layout="TND",
            block_table=table,
            block_size=8,
            actual_seq_lengths=[2],
            actual_seq_lengths_kv=[2],
        )
    kc16 = torch.zeros(2, 16, 16, dtype=torch.float16)
    kw = dict(num_heads=1, input_layout="TND", block_table=table, block_size=16, actual_seq_lengths_kv=[2])
    with pytest.raises(ops.EmulatedOpError, match="cumulative"):  # TND query lengths are cumulative
        two = {**kw, "block_table": torch.zeros(2, 1, dtype=torch.int32), "actual_seq_lengths_kv": [2, 2]}
        FIA(torch.zeros(3, 1, 16, dtype=torch.float16), kc16, kc16, actual_seq_lengths=[2, 1], **two)
    with pytest.raises(ops.EmulatedOpError, match="2048x2048"):  # causal modes take the compressed mask
        FIA(
            q,
            kc16,
            kc16,
            actual_seq_lengths=[2],
            sparse_mode=3,
            atten_mask=torch.ones(2, 2, dtype=torch.bool).triu(1),
            **kw,
        )
    wrong = ops.compressed_causal_mask()
    wrong[5, 9] = False
    with pytest.raises(ops.EmulatedOpError, match="not the compressed causal mask"):
        FIA(q, kc16, kc16, actual_seq_lengths=[2], sparse_mode=3, atten_mask=wrong, **kw)
    with pytest.raises(ops.EmulatedOpError, match="contiguous"):
        FIA(torch.zeros(2, 1, 32, dtype=torch.float16)[..., ::2], kc16, kc16, actual_seq_lengths=[2], **kw)
    with pytest.raises(ops.EmulatedOpError, match="host"):  # lengths live on the host
        ops._check_host_lengths("x", torch.zeros(1, dtype=torch.int32, device="meta"), 1)


def test_fully_masked_rows_give_zero():
    """sparse_mode 3 with more queries than keys: the first rows see nothing and come back 0."""
    q = torch.randn(3, 1, 16).half()
    k = torch.randn(1, 1, 16).half()
    out, lse = FIA(
        q,
        k,
        k,
        num_heads=1,
        input_layout="TND",
        actual_seq_lengths=[3],
        actual_seq_lengths_kv=[1],
        atten_mask=ops.compressed_causal_mask(),
        sparse_mode=3,
        softmax_lse_flag=True,
    )
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.isinf(lse[:2]).all()
    assert rel(out[2:], k.double()) < TOL
