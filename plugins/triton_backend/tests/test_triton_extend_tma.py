"""The extend kernel's whole-page TMA path (`ExtendConfig.page_tma`, issue 16) under the interpreter:
against the float64 reference on random paged batches (pages of 16, lengths off the tile and page
boundaries, GQA, 1, 2 and 4 pages a tile, stacked and per-page dots), its bad-page faults, where it applies (`tma_page`), and the
backend over several steps of the same requests. The sm_90 build is in test_triton_compile_sm90.py."""

from __future__ import annotations

import pytest
import torch
from triton_helpers import paged_setup, requires_interpreter

from attn_core.ops.device_faults import DeviceFaultKind
from attn_core.testing.engine_steps import EngineWorld, compare_over_steps
from attn_core.testing.reference import reference_attention, relative_error, tolerance
from attn_triton.backend import TritonAttnBackend
from attn_triton.kernels import extend as ex
from attn_triton.kernels.extend import ExtendConfig, extend_attention, tma_page

pytestmark = requires_interpreter

HQ, HKV, D, DV, PAGE = 4, 2, 32, 16, 16


def _batch(dtype, gen, shapes, page_size=PAGE, dv=DV):
    lens = [p + e for p, e in shapes]
    k_buf, v_buf, indptr, indices, ks, vs = paged_setup(lens, HKV, D, dv, dtype, gen, page_size)
    qo = torch.zeros(len(shapes) + 1, dtype=torch.int32)
    qo[1:] = torch.tensor([e for _, e in shapes]).cumsum(0)
    q = torch.randn(int(qo[-1]), HQ, D, generator=gen).to(dtype)
    return q, k_buf, v_buf, qo, indptr, indices, ks, vs


def _run(q, k_buf, v_buf, qo, indptr, indices, max_q_len, cfg, page_size, **kw):
    o = torch.full((q.shape[0], HQ, v_buf.shape[2]), float("nan"), dtype=q.dtype)
    fault = torch.zeros(8, dtype=torch.int32)
    extend_attention(q, k_buf, v_buf, o, qo, indptr, indices, max_q_len, fault, sm_scale=0.3, config=cfg, page_size=page_size, **kw)
    return o, fault


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_n", [16, 32, 64])
@pytest.mark.parametrize("dots", [False, True], ids=["stacked", "page_dots"])
def test_page_tma_matches_reference(dtype, block_n, dots):
    """Random prefixes and q lengths (none a multiple of the tile or page, one request with no prefix)
    through 1, 2 and 4 pages a tile, with sinks and the LSE, a logit cap at 4 pages (a window leaves no
    unmasked tile: gathered)."""
    gen = torch.Generator().manual_seed(block_n)
    shapes = [(0, 19), (int(torch.randint(33, 90, (1,), generator=gen)), 21), (70, 5), (131, 2)]
    q, k_buf, v_buf, qo, indptr, indices, ks, vs = _batch(dtype, gen, shapes)
    cfg = ExtendConfig(block_m=16, block_n=block_n, num_warps=1, num_stages=1, page_tma=True, page_dots=dots)
    assert tma_page(cfg, PAGE, q, k_buf, v_buf, 0, False) == PAGE
    sinks = torch.randn(HQ, generator=gen)
    cap = 2.0 if block_n == 64 else 0.0
    lse = torch.full((q.shape[0], HQ), float("nan"))
    o, fault = _run(q, k_buf, v_buf, qo, indptr, indices, 21, cfg, PAGE, sinks=sinks, lse_out=lse, logit_cap=cap)
    assert not fault.any()
    for r, (p, e) in enumerate(shapes):
        rows = slice(int(qo[r]), int(qo[r + 1]))
        pos = torch.arange(p, p + e)
        ref_o, ref_lse = reference_attention(q[rows], ks[r], vs[r], q_positions=pos, scale=0.3, sinks=sinks, logit_cap=cap)
        assert relative_error(o[rows], ref_o) <= tolerance(dtype), (p, e)
        assert (lse[rows].double() - ref_lse).abs().max() <= 1e-3, (p, e)


@pytest.mark.parametrize("page_size, window", [(1, None), (16, 20)])
def test_gather_where_pages_do_not_apply(page_size, window, monkeypatch):
    """A pool of one slot a page (no page promise) and a window (no unmasked tile) keep the row gather
    under `page_tma`: no descriptor is made, and the answer matches the reference."""
    made = []
    monkeypatch.setattr(ex, "page_descriptor", lambda buf, page: made.append(page))
    gen = torch.Generator().manual_seed(7)
    shapes = [(37, 11), (0, 23)]
    q, k_buf, v_buf, qo, indptr, indices, ks, vs = _batch(torch.float16, gen, shapes, page_size=page_size)
    cfg = ExtendConfig(block_m=16, block_n=32, num_warps=1, num_stages=1, page_tma=True)
    o, fault = _run(q, k_buf, v_buf, qo, indptr, indices, 23, cfg, page_size, window=window)
    assert not fault.any() and not made
    for r, (p, e) in enumerate(shapes):
        rows = slice(int(qo[r]), int(qo[r + 1]))
        ref_o, _ = reference_attention(q[rows], ks[r], vs[r], q_positions=torch.arange(p, p + e), scale=0.3, window=window)
        assert relative_error(o[rows], ref_o) <= tolerance(torch.float16)


@pytest.mark.parametrize("bad", ["misaligned", "past_pool", "negative"])
@pytest.mark.parametrize("dots", [False, True], ids=["stacked", "page_dots"])
def test_bad_page_is_recorded_and_not_read(bad, dots):
    """A page start in an unmasked tile that is not a page of the pool is recorded as SLOT and read as
    the dummy page (finite output, pool untouched); the row gather reads a misaligned but in-pool slot
    without a fault, so the fault proves the page path ran."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(64, 4)]
    q, k_buf, v_buf, qo, indptr, indices, _, _ = _batch(torch.float32, gen, shapes)
    k_buf[:PAGE], v_buf[:PAGE] = 0.0, 0.0  # the dummy page, as the pool keeps it
    num_slots = k_buf.shape[0]
    indices[PAGE] = {"misaligned": int(indices[PAGE]) + 3, "past_pool": num_slots - PAGE // 2, "negative": -PAGE}[bad]
    snap = (k_buf.clone(), v_buf.clone())
    tma = ExtendConfig(block_m=16, block_n=32, num_warps=1, num_stages=1, page_tma=True, page_dots=dots)
    o, fault = _run(q, k_buf, v_buf, qo, indptr, indices, 4, tma, PAGE)
    assert fault[int(DeviceFaultKind.SLOT)] == 1
    assert o.isfinite().all()
    assert all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip((k_buf, v_buf), snap))
    if bad == "misaligned":
        gather = ExtendConfig(block_m=16, block_n=32, num_warps=1, num_stages=1)
        _, fault = _run(q, k_buf, v_buf, qo, indptr, indices, 4, gather, PAGE)
        assert not fault.any()


def test_where_tma_applies():
    """`tma_page`: the config asks, pages of >= 16 slots, BLOCK_N of 1, 2 or 4 pages, K/V in q's dtype
    with power-of-two head dims and contiguous heads, no rope part, no shared K/V."""
    k = torch.zeros(256, HKV, 32, dtype=torch.float16)
    q = torch.zeros(4, HQ, 32, dtype=torch.float16)
    on = ExtendConfig(128, 64, 4, 3, page_tma=True)
    assert tma_page(on, 16, q, k, k, 0, False) == 16
    assert tma_page(on, 64, q, k, k, 0, False) == 64
    assert tma_page(ExtendConfig(128, 64, 4, 3), 16, q, k, k, 0, False) == 0
    assert tma_page(on, 8, q, k, k, 0, False) == 0  # small pages: the gather
    assert tma_page(on, 128, q, k, k, 0, False) == 0  # a page larger than the tile
    assert tma_page(ExtendConfig(128, 128, 4, 3, page_tma=True), 16, q, k, k, 0, False) == 0  # 8 pages a tile
    assert tma_page(on, 16, q, k, k, 16, False) == 0  # rope part
    assert tma_page(on, 16, q, k, k, 0, True) == 0  # shared K/V (absorbed MLA)
    assert tma_page(on, 16, q.float(), k, k, 0, False) == 0  # K/V not in q's dtype
    odd = torch.zeros(256, HKV, 48, dtype=torch.float16)
    assert tma_page(on, 16, q, odd, odd, 0, False) == 0  # head dim not a power of two
    hnd = torch.zeros(HKV, 256, 32, dtype=torch.float16).transpose(0, 1)
    assert tma_page(on, 16, q, hnd, hnd, 0, False) == 0  # heads not contiguous within a slot


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_backend_steps_take_pages(dtype, monkeypatch):
    """Chunked prefill through the public engine API: three EXTEND steps of the same requests (pages of
    16) on the page path (stacked, and per-page dots) and on the row gather, each against the float64
    causal reference; the page path is taken at every launch."""
    made = []
    real = ex.page_descriptor
    monkeypatch.setattr(ex, "page_descriptor", lambda buf, page: made.append(page) or real(buf, page))
    tiles = dict(block_m=16, block_n=32, num_warps=1, num_stages=1)
    variants = [dict(page_tma=True), dict(page_tma=True, page_dots=True), {}]
    make = [lambda ctx, v=v: TritonAttnBackend(ctx, extend_config=ExtendConfig(**tiles, **v)) for v in variants]
    worlds = [EngineWorld(m, page_size=16, dtype=dtype) for m in make]
    steps = [[("a", 20), ("b", 35)], [("a", 18), ("b", 12), ("c", 9)], [("a", 19), ("c", 30)]]
    seen = compare_over_steps(worlds, steps, seed=5, tol=tolerance(dtype))
    assert [s[0] for s in seen] == ["EXTEND"] * 3
    assert len(made) == 2 * 2 * 3 * 2 and set(made) == {16}  # K and V, 2 paged worlds, 3 steps, 2 layers


@pytest.mark.parametrize("paged", [False, True], ids=["gather", "tma_dots"])
def test_longest_first_grid(paged):
    """`longest_first` (m blocks outermost in the grid) over requests of different q lengths (programs past
    a request's last token return at once) matches the reference, and a request whose key offsets run
    past kv_indices is recorded once as KEY_OFFSETS."""
    gen = torch.Generator().manual_seed(11)
    shapes = [(5, 50), (40, 3), (0, 33), (17, 1), (64, 20)]  # 5 requests, 4 m blocks
    q, k_buf, v_buf, qo, indptr, indices, ks, vs = _batch(torch.float16, gen, shapes)
    cfg = ExtendConfig(block_m=16, block_n=32, num_warps=1, num_stages=1, page_tma=paged, page_dots=paged, longest_first=True)
    o, fault = _run(q, k_buf, v_buf, qo, indptr, indices, 50, cfg, PAGE)
    assert not fault.any()
    for r, (p, e) in enumerate(shapes):
        rows = slice(int(qo[r]), int(qo[r + 1]))
        ref_o, _ = reference_attention(q[rows], ks[r], vs[r], q_positions=torch.arange(p, p + e), scale=0.3)
        assert relative_error(o[rows], ref_o) <= tolerance(torch.float16), (p, e)
    short = indices[: int(indptr[-1]) - 5]  # the last request's keys run past the entries
    _, fault = _run(q, k_buf, v_buf, qo, indptr, short, 50, cfg, PAGE)
    assert fault[int(DeviceFaultKind.KEY_OFFSETS)] == 1 and fault.sum() == 1
