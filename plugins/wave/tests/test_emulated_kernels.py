"""The emulated Wave kernels themselves: each against a float64 reference written here from the
definition, on random shapes, and the documented edge cases: decode splits (including splits the first
phase leaves unwritten), the two decode template forms, extend's causal and custom-mask variants and
their exclusivity, compiled shapes, max_extend_len."""

from __future__ import annotations

import math
import random

import pytest
import torch
from attn_wave.plans import empty_splits
from attn_wave.testing import emulated_kernels as ek

TOL = 2e-2


def ref64(q, k, v, visible, scale):
    """float64 attention of one sequence: q [Sq, H, D], k/v [Sk, Hkv, *], visible [Sq][Sk]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    for i in range(q.shape[0]):
        js = [j for j in range(k.shape[0]) if visible[i][j]]
        s = torch.einsum("hd,jhd->hj", q[i].double(), k[js]) * scale
        out[i] = torch.einsum("hj,jhd->hd", torch.softmax(s, -1), v[js])
    return out


def rel(a, b):
    return float((a.double() - b).norm() / b.norm())


def decode_setup(lens, hq, hkv, d, gen, dtype=torch.float16):
    slots = sum(lens) + 5
    kb = torch.randn(slots, hkv, d, generator=gen).to(dtype)
    vb = torch.randn(slots, hkv, d, generator=gen).to(dtype)
    ids = (torch.randperm(slots - 1, generator=gen)[: sum(lens)] + 1).to(torch.int32)
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    return q, kb, vb, indptr, ids


def run_decode(q, kb, vb, indptr, ids, u, form="full", scale=None, fill=(0.0, float("-inf")), dtype=torch.float16):
    shape = ek.paged_decode_attention_shape(q.shape[1], kb.shape[1], q.shape[2], vb.shape[2], 32, q.shape[0])
    kw = (
        dict(input_dtype=q.dtype, output_dtype=dtype, layer_scaling=scale)
        if form == "full"
        else dict(input_dtype=q.dtype)
    )
    p0, p1, *_ = ek.make_decode_template(form)(shape, None, u, **kw)
    ls, ms = ek.get_paged_decode_intermediate_arrays_shapes(shape, u)
    logits, logits_max = torch.full(ls, fill[0]), torch.full(ms, fill[1])
    out = torch.empty(q.shape[0], q.shape[1], vb.shape[2], dtype=dtype)
    p0(q, kb, vb, indptr, ids, logits, logits_max)
    p1(logits, logits_max, indptr, out)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_decode_phases_random(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    hkv = rng.choice([1, 2])
    hq, u = hkv * rng.choice([1, 4]), rng.choice([1, 3, 8])
    lens = [rng.choice([1, 9, rng.randint(1, 200)]) for _ in range(rng.randint(1, 4))]
    q, kb, vb, indptr, ids = decode_setup(lens, hq, hkv, 32, gen)
    out = run_decode(q, kb, vb, indptr, ids, u, scale=0.3)
    for b in range(len(lens)):
        idx = ids[int(indptr[b]) : int(indptr[b + 1])].long()
        assert rel(out[b : b + 1], ref64(q[b : b + 1], kb[idx], vb[idx], [[True] * lens[b]], 0.3)) < TOL


def test_unwritten_splits_are_read_by_the_merge():
    """9 keys in 8 splits of 2: splits 5..7 stay unwritten and are merged anyway, so NaN in the buffers
    reaches the output; 0 / -inf there is harmless. 16 keys fill every split."""
    assert empty_splits(9, 8) == [5, 6, 7] and empty_splits(16, 8) == [] and empty_splits(3, 8) == []
    gen = torch.Generator().manual_seed(0)
    q, kb, vb, indptr, ids = decode_setup([9], 2, 2, 16, gen)
    assert run_decode(q, kb, vb, indptr, ids, 8, fill=(float("nan"),) * 2).isnan().all()
    assert not run_decode(q, kb, vb, indptr, ids, 8).isnan().any()
    q, kb, vb, indptr, ids = decode_setup([16], 2, 2, 16, gen)
    assert not run_decode(q, kb, vb, indptr, ids, 8, fill=(float("nan"),) * 2).isnan().any()


def test_minimal_decode_template_writes_float16_at_the_default_scale():
    gen = torch.Generator().manual_seed(1)
    q, kb, vb, indptr, ids = decode_setup([20], 2, 1, 64, gen)
    out = run_decode(q, kb, vb, indptr, ids, 4, form="minimal")
    idx = ids.long()
    assert out.dtype == torch.float16 and rel(out, ref64(q, kb[idx], vb[idx], [[True] * 20], 1 / 8)) < TOL
    with pytest.raises(ek.EmulatedOpError, match="out must be"):
        run_decode(q.bfloat16(), kb.bfloat16(), vb.bfloat16(), indptr, ids, 4, form="minimal", dtype=torch.bfloat16)


def extend_setup(qlens, prefixes, hq, hkv, d, gen, mask=False):
    slots = sum(prefixes) + 4
    kc = torch.randn(slots, hkv, d, generator=gen).half()
    vc = torch.randn(slots, hkv, d, generator=gen).half()
    ids = (torch.randperm(slots - 1, generator=gen)[: sum(prefixes)] + 1).to(torch.int32)
    t = sum(qlens)
    q, k, v = (torch.randn(t, h, d, generator=gen).half() for h in (hq, hkv, hkv))
    qo = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    kv = torch.tensor([0, *torch.tensor(prefixes).cumsum(0).tolist()], dtype=torch.int32)
    masks = [torch.rand(n, p + n, generator=gen) < 0.6 for n, p in zip(qlens, prefixes)] if mask else None
    for m in masks or []:
        m[:, 0] = True  # every query sees at least one key
    return q, k, v, kc, vc, qo, kv, ids, masks


def extend_kernel(q, k, v, kc, vc, masked, scale=0.25):
    shape = ek.AttentionShape(q.shape[1], k.shape[1], q.shape[2], v.shape[2])
    return ek.get_extend_attention_kernel(
        shape,
        None,
        q.shape,
        k.shape,
        v.shape,
        kc.shape,
        vc.shape,
        q.shape,
        input_dtype=q.dtype,
        output_dtype=q.dtype,
        is_causal=not masked,
        layer_scaling=scale,
        use_custom_mask=masked,
    )[0]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_extend_random(seed, masked):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    qlens = [rng.randint(1, 12) for _ in range(rng.randint(1, 4))]
    prefixes = [rng.choice([0, rng.randint(1, 40)]) for _ in qlens]
    q, k, v, kc, vc, qo, kv, ids, masks = extend_setup(qlens, prefixes, 4, 2, 32, gen, masked)
    out = torch.full_like(q, float("nan"))
    kernel = extend_kernel(q, k, v, kc, vc, masked)
    if masked:
        flat = torch.cat([m.reshape(-1) for m in masks]).to(torch.int8)
        offs = torch.tensor([0, *torch.tensor([m.numel() for m in masks]).cumsum(0).tolist()[:-1]], dtype=torch.int32)
        kernel(q, k, v, kc, vc, qo, kv, ids, flat, offs, max(qlens), out)
    else:
        kernel(q, k, v, kc, vc, qo, kv, ids, max(qlens), out)
    for s, (n, p) in enumerate(zip(qlens, prefixes)):
        rows, idx = slice(int(qo[s]), int(qo[s + 1])), ids[int(kv[s]) : int(kv[s + 1])].long()
        keys, vals = torch.cat([kc[idx], k[rows]]), torch.cat([vc[idx], v[rows]])
        vis = masks[s].tolist() if masked else [[j < p or j - p <= i for j in range(p + n)] for i in range(n)]
        assert rel(out[rows], ref64(q[rows], keys, vals, vis, 0.25)) < TOL


def test_extend_rules():
    gen = torch.Generator().manual_seed(2)
    q, k, v, kc, vc, qo, kv, ids, _ = extend_setup([5, 2], [3, 0], 2, 2, 16, gen)
    shape = ek.AttentionShape(2, 2, 16, 16)
    with pytest.raises(ek.EmulatedOpError, match="Cannot have both"):
        ek.get_extend_attention_kernel(
            shape, None, q.shape, k.shape, v.shape, kc.shape, vc.shape, q.shape, is_causal=True, use_custom_mask=True
        )
    kernel = extend_kernel(q, k, v, kc, vc, False)
    with pytest.raises(ek.EmulatedOpError, match="max_extend_len"):
        kernel(q, k, v, kc, vc, qo, kv, ids, 4, torch.empty_like(q))
    with pytest.raises(ek.EmulatedOpError, match="compiled"):
        kernel(q[:, :1], k, v, kc, vc, qo, kv, ids, 5, torch.empty_like(q))
    with pytest.raises(ek.EmulatedOpError, match="int32"):
        kernel(q, k, v, kc, vc, qo.long(), kv, ids, 5, torch.empty_like(q))
    assert math.isclose(ek.LOG2E, 1 / math.log(2), rel_tol=1e-9)
