"""The K/V write stores a (token, head) whose value is not finite as K = NaN, V = 0 (`attn_core.ops.kv_write`,
`clean_nonfinite`; docs/design.md §3.2), so masked keys add nothing on any kernel: against plain Python loops
on random rows with random Inf / NaN, through the torch path (pools of every kind, fp8, engine-owned strided
caches) and the one-launch Triton write (`attn_core.ops.kv_write_triton`, under the interpreter here, on a GPU
in `test_kv_write_clean_gpu`), untouched slots poisoned and checked unchanged."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest
import torch

from attn_core.memory import MHATokenToKVPool, MLATokenToKVPool
from attn_core.ops.kv_write import clean_nonfinite, write_kv

HERE = os.path.dirname(os.path.abspath(__file__))
SENTINEL = -7.25  # what every slot holds before a write


def random_rows(gen: random.Random, t: int, h: int, d: int, dtype: torch.dtype, bad: float = 0.3) -> torch.Tensor:
    """`[t, h, d]` random values with Inf, -Inf or NaN in about `bad` of the (token, head) rows."""
    x = torch.randn(t, h, d, generator=torch.Generator().manual_seed(gen.randrange(1 << 30))).to(dtype)
    for i in range(t):
        for j in range(h):
            if gen.random() < bad:
                x[i, j, gen.randrange(d)] = gen.choice([float("inf"), float("-inf"), float("nan")])
    return x


def expected_rows(k: torch.Tensor, v, value_cols: int = 0):
    """The rule written plainly: per (token, head), if any value entry is not finite, K -> NaN and V -> 0 (an
    MLA latent: its value columns -> 0, the others NaN); else both as given. Lists of floats."""
    kk, vv = k.double().tolist(), None if v is None else v.double().tolist()
    for i in range(len(kk)):
        for j in range(len(kk[i])):
            value = vv[i][j] if vv is not None else kk[i][j][:value_cols]
            if any(not math.isfinite(x) for x in value):
                if vv is not None:
                    kk[i][j] = [math.nan] * len(kk[i][j])
                    vv[i][j] = [0.0] * len(vv[i][j])
                else:
                    kk[i][j] = [0.0 if c < value_cols else math.nan for c in range(len(kk[i][j]))]
    return kk, vv


def same(a: torch.Tensor, b) -> bool:
    """Equal as floats, NaN equal to NaN."""
    b = torch.tensor(b, dtype=torch.float64) if not isinstance(b, torch.Tensor) else b.double()
    a = a.double()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_clean_nonfinite_against_loops(seed, dtype):
    gen = random.Random(seed)
    t, h, d, dv = gen.randint(1, 9), gen.randint(1, 4), gen.choice([4, 8, 16]), gen.choice([4, 8])
    k, v = random_rows(gen, t, h, d, dtype, 0.1), random_rows(gen, t, h, dv, dtype)
    want_k, want_v = expected_rows(k, v)
    got_k, got_v = clean_nonfinite(k, v)
    assert same(got_k, want_k) and same(got_v, want_v)
    assert got_k.dtype == dtype and got_v.dtype == dtype
    latent = random_rows(gen, t, 1, d + 4, dtype)
    want, _ = expected_rows(latent, None, d)
    got, none = clean_nonfinite(latent, None, d)
    assert none is None and same(got, want)
    assert clean_nonfinite(latent, None, 0)[0] is latent  # no value columns: nothing to clean


def _slot_rows(layout: str, page: int):
    """(cache index of slot s) for a pool of `layout`."""
    if layout == "NHD":
        return lambda s: (s,)
    return lambda s: (s // page, slice(None), s % page)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_pool_writes_clean_rows_and_nothing_else(seed, layout):
    gen = random.Random(100 + seed)
    page = 4 if layout == "HND" else 1
    h, d, dv = gen.randint(1, 3), 8, gen.choice([4, 8])
    pool = MHATokenToKVPool(32, page, torch.float16, h, d, 2, v_head_dim=dv, kv_layout=layout)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.fill_(SENTINEL)
    t = gen.randint(1, 12)
    slots = torch.tensor(gen.sample(range(1, pool.num_slots), t))
    k, v = random_rows(gen, t, h, d, torch.float16, 0.1), random_rows(gen, t, h, dv, torch.float32)
    pool.set_kv_buffer(1, slots, k, v)
    want_k, want_v = expected_rows(k, v.half())
    at = _slot_rows(layout, page)
    kb, vb = pool.get_key_buffer(1), pool.get_value_buffer(1)
    for i, s in enumerate(slots.tolist()):
        assert same(kb[at(s)], want_k[i]) and same(vb[at(s)], want_v[i])
        kb[at(s)], vb[at(s)] = SENTINEL, SENTINEL
    assert (kb == SENTINEL).all() and (vb == SENTINEL).all()  # no other slot written
    assert (pool.get_key_buffer(0) == SENTINEL).all()  # nor another layer


def test_mla_pool_cleans_the_latent_value():
    gen = random.Random(7)
    pool = MLATokenToKVPool(16, 1, torch.bfloat16, 8, 4, 1)
    pool.kv_buffer[0].fill_(SENTINEL)
    latent = random_rows(gen, 5, 1, 12, torch.bfloat16)
    slots = torch.tensor([3, 9, 1, 12, 5])
    pool.set_kv_buffer(0, slots, latent)
    want, _ = expected_rows(latent, None, 8)
    buf = pool.get_key_buffer(0)
    for i, s in enumerate(slots.tolist()):
        assert same(buf[s], want[i])


def test_fp8_pool_cleans_nan_and_saturates_inf():
    """e4m3 has no infinity: an Inf value is stored saturated (finite, as before); a NaN value is cleaned."""
    pool = MHATokenToKVPool(8, 1, torch.float8_e4m3fn, 1, 4, 1)
    k = torch.ones(3, 1, 4)
    v = torch.tensor([[[1.0, 2.0, 3.0, 4.0]], [[1.0, float("inf"), 0.5, 1.0]], [[float("nan"), 1.0, 1.0, 1.0]]])
    pool.set_kv_buffer(0, torch.tensor([1, 2, 3]), k, v)
    kb, vb = pool.get_key_buffer(0).float(), pool.get_value_buffer(0).float()
    assert same(vb[1], [[1, 2, 3, 4]]) and same(kb[1], [[1, 1, 1, 1]])
    assert same(vb[2], [[1, 448, 0.5, 1]]) and same(kb[2], [[1, 1, 1, 1]])
    assert same(vb[3], [[0, 0, 0, 0]]) and kb[3].isnan().all()


def test_clean_inputs_cleans_the_callers_rows_in_place():
    """`clean_inputs` (a backend whose kernel reads the new K/V from the inputs): the rows that changed are
    cleaned in k and v too; the others are left as they were."""
    gen = random.Random(11)
    pool = MHATokenToKVPool(32, 1, torch.float16, 3, 8, 1)
    k, v = random_rows(gen, 6, 3, 8, torch.float16, 0.1), random_rows(gen, 6, 3, 8, torch.float16)
    k0, v0 = k.clone(), v.clone()
    pool.set_kv_buffer(0, torch.arange(1, 7), k, v, clean_inputs=True)
    want_k, want_v = expected_rows(k0, v0)
    assert same(k, want_k) and same(v, want_v)
    k1, v1 = k0.clone(), v0.clone()
    pool.set_kv_buffer(0, torch.arange(1, 7), k1, v1)  # default: the inputs untouched
    assert same(k1, k0) and same(v1, v0)


def test_engine_owned_strided_cache():
    """`write_kv` into views of one engine tensor (K | V side by side per slot, HND pages)."""
    gen = random.Random(3)
    pages, h, page, d = 6, 2, 4, 8
    both = torch.full((pages, h, page, 2 * d), SENTINEL, dtype=torch.float16)
    k_cache, v_cache = both[..., :d], both[..., d:]
    k, v = random_rows(gen, 7, h, d, torch.float16, 0.1), random_rows(gen, 7, h, d, torch.float16)
    slots = torch.tensor(gen.sample(range(page, pages * page), 7))
    write_kv(k_cache, v_cache, slots, k, v, layout="HND", page_size=page)
    want_k, want_v = expected_rows(k, v)
    for i, s in enumerate(slots.tolist()):
        assert same(k_cache[s // page, :, s % page], want_k[i]) and same(v_cache[s // page, :, s % page], want_v[i])
        both[s // page, :, s % page] = SENTINEL
    assert (both == SENTINEL).all()


def triton_case(
    seed: int, layout: str, shared: bool, dtype: torch.dtype, strided: bool, device: str = "cpu", clean_inputs=False
):
    """One random write through `kv_write_triton.write_kv_triton` against the loops (a slot's rows as the
    rule says; every other slot still the sentinel): NHD / HND, K | V side by side in one tensor (`strided`),
    an MLA latent (`shared`). On the CPU this needs the Triton interpreter."""
    from attn_core.ops.kv_write_triton import fused_write_fits, write_kv_triton

    gen = random.Random(seed)
    page = gen.choice([2, 4, 16]) if layout == "HND" else 1
    pages, h, d = 8, 1 if shared else gen.randint(1, 9), gen.choice([8, 64, 128] if device != "cpu" else [8, 24])
    dv = gen.choice([4, 8]) if shared else gen.choice([8, d])
    n = pages * page
    shape = (n, h) if layout == "NHD" else (pages, h, page)
    width = d + (dv if strided and not shared else 0)
    kc = torch.full((*shape, width), SENTINEL, dtype=dtype, device=device)
    own_v = torch.full((*shape, dv), SENTINEL, dtype=dtype, device=device)
    vc = None if shared else (kc[..., d:] if strided else own_v)
    kc = kc[..., :d]
    tok = gen.randint(1, n - 1)
    slots = torch.tensor(gen.sample(range(1, n), tok), dtype=torch.int64, device=device)
    k = random_rows(gen, tok, h, d, gen.choice([dtype, torch.float32]), 0.1).to(device)
    v = None if shared else random_rows(gen, tok, h, dv, dtype).to(device)
    assert fused_write_fits(kc, vc, k, v, 1.0, 1.0)
    k_in, v_in = k.clone(), None if v is None else v.clone()
    write_kv_triton(kc, vc, slots, k, v, layout, page, dv if shared else 0, clean_inputs)
    want_k, want_v = expected_rows(k_in.to(dtype).cpu(), None if v is None else v_in.cpu(), dv if shared else 0)
    if clean_inputs and not shared:  # the inputs' changed rows as stored, the others as they were
        in_k, in_v = expected_rows(k_in.cpu(), v_in.cpu())
        assert same(k.cpu(), in_k) and same(v.cpu(), in_v)
    else:
        assert same(k.cpu(), k_in.cpu()) and (v is None or same(v.cpu(), v_in.cpu()))
    at = _slot_rows(layout, page)
    kc, vc = kc.cpu(), None if vc is None else vc.cpu()
    for i, s in enumerate(slots.tolist()):
        assert same(kc[at(s)], want_k[i]), (seed, layout, i)
        kc[at(s)] = SENTINEL
        if vc is not None:
            assert same(vc[at(s)], want_v[i]), (seed, layout, i)
            vc[at(s)] = SENTINEL
    assert (kc == SENTINEL).all() and (vc is None or (vc == SENTINEL).all())


def triton_cases(device: str) -> None:
    dtypes = (torch.float16, torch.float32) if device == "cpu" else (torch.float16, torch.bfloat16, torch.float32)
    for seed in range(3):
        for layout in ("NHD", "HND"):
            for dtype in dtypes:
                triton_case(seed, layout, False, dtype, seed % 2 == 1, device, clean_inputs=dtype == dtypes[0])
            triton_case(seed + 10, layout, True, dtypes[0], False, device)


_INTERPRETED = """
import sys, torch
sys.path.insert(0, {here!r})
import test_kv_write_clean as t
from attn_core.ops.kv_write_triton import fused_write_fits

t.triton_cases("cpu")
pool = torch.zeros(4, 1, 8, dtype=torch.float8_e4m3fn)
assert not fused_write_fits(pool, pool, torch.ones(1, 1, 8), torch.ones(1, 1, 8), 1.0, 1.0)  # fp8: quantizes
half = torch.zeros(4, 1, 8, dtype=torch.float16)
assert not fused_write_fits(half, half, torch.ones(1, 1, 8), torch.ones(1, 1, 8), 0.5, 1.0)  # a scale to apply
print("ok")
"""


def test_triton_write_interpreted():
    """The one-launch write under the Triton interpreter (a fresh process: TRITON_INTERPRET must be set before
    Triton is imported), against the loops: NHD / HND, K | V side by side in one tensor, MLA latents."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-c", _INTERPRETED.format(here=HERE)], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_write_on_cuda():
    """The same cases compiled, on a GPU (head dims 64 / 128, bf16 too), and a pool's write takes this path."""
    triton_cases("cuda")
    from attn_core.ops import kv_write

    pool = MHATokenToKVPool(64, 16, torch.bfloat16, 8, 128, 1, device="cuda", kv_layout="HND")
    k, v = torch.randn(5, 8, 128, device="cuda"), torch.randn(5, 8, 128, device="cuda")
    assert kv_write._fused_writer()[0](pool.get_key_buffer(0), pool.get_value_buffer(0), k, v, 1.0, 1.0)
