"""Paged index builders (page counts, last-page lengths, page indptr, page ids) vs plain Python loops,
for the torch path and `build_kv_indices` on a GPU (the Triton kernel itself: test_kv_indices_triton.py)."""

import random
import subprocess
import sys

import pytest
import torch

import attn_core.ops.kv_indices as kvi
from attn_core.contract.errors import InvalidArgumentError


def _paged_table(rng, num_rows, max_len, page_size):
    """A req_to_token laid out like the paged allocator's: token i at offset i % page_size of a random page."""
    r2t = torch.zeros(num_rows, max_len, dtype=torch.int32)
    pages = list(range(1, num_rows * (max_len // page_size + 1) + 2))
    rng.shuffle(pages)
    for r in range(num_rows):
        for i in range(max_len):
            if i % page_size == 0:
                page = pages.pop()
            r2t[r, i] = page * page_size + i % page_size
    return r2t


def _case(seed, page_size, with_start):
    rng = random.Random(seed)
    bs, max_len = rng.randint(1, 9), rng.choice([page_size * 3, page_size * 5 + 1, 70])
    r2t = _paged_table(rng, bs + 2, max_len, page_size)
    rows = torch.tensor(rng.sample(range(bs + 2), bs), dtype=torch.int64)
    starts, lens = [], []
    for _ in range(bs):
        s = rng.randrange(0, max_len, page_size) if with_start else 0
        starts.append(s)
        lens.append(
            rng.choice([0, 1, page_size, rng.randint(0, max_len - s)])
            if max_len - s > page_size
            else rng.randint(0, max_len - s)
        )
    return r2t, rows, torch.tensor(lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32)


def _expected_ids(r2t, rows, lens, starts, page_size):
    want = []
    for r, n, s in zip(rows.tolist(), lens.tolist(), starts.tolist()):
        for j in range(-(-n // page_size)):
            want.append(int(r2t[r, s + j * page_size]) // page_size)
    return want


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_counts_last_lens_and_indptr_match_loop(page_size):
    rng = random.Random(page_size)
    lens = [0, 1, page_size, page_size + 1, 2 * page_size] + [rng.randint(0, 200) for _ in range(20)]
    t = torch.tensor(lens, dtype=torch.int32)
    pages = [-(-n // page_size) for n in lens]
    last = [n - (p - 1) * page_size if p else 0 for n, p in zip(lens, pages)]
    assert kvi.num_pages_from_lens(t, page_size).tolist() == pages
    got_last = kvi.last_page_len_from_lens(t, page_size)
    assert got_last.dtype == torch.int32 and got_last.tolist() == last
    assert all(1 <= v <= page_size for v, n in zip(last, lens) if n)
    indptr = kvi.page_indptr_from_lens(t, page_size)
    assert indptr.dtype == torch.int32
    assert indptr.tolist() == [sum(pages[:i]) for i in range(len(pages) + 1)]


def test_worked_example_of_the_docstring():
    pages = kvi.num_pages_from_lens(torch.tensor([0, 1, 4, 5]), 4)
    assert pages.tolist() == [0, 1, 1, 2]
    assert kvi.last_page_len_from_lens(torch.tensor([0, 1, 4, 5]), 4).tolist() == [0, 1, 4, 1]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("with_start", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_page_ids_from_req_to_token_match_loop(seed, page_size, with_start):
    r2t, rows, lens, starts = _case(seed, page_size, with_start)
    indptr = kvi.page_indptr_from_lens(lens, page_size)
    total = int(indptr[-1])
    got = kvi.kv_indices_from_req_to_token(
        r2t, rows, indptr, total, starts if with_start else None, page_size=page_size
    )
    assert got.dtype == torch.int32
    assert got.tolist() == _expected_ids(r2t, rows, lens, starts, page_size)


@pytest.mark.parametrize("page_size", [1, 16])
def test_build_kv_indices_torch_path_writes_only_its_prefix_of_out(page_size):
    r2t, rows, lens, starts = _case(11, page_size, True)
    total = int(kvi.num_pages_from_lens(lens, page_size).sum())
    out = torch.full((total + 5,), -7, dtype=torch.int32)
    got = kvi.build_kv_indices(r2t, rows, lens, total, page_size=page_size, kv_start=starts, out=out)
    assert got.data_ptr() == out.data_ptr() and got.shape[0] == total
    assert got.tolist() == _expected_ids(r2t, rows, lens, starts, page_size)
    assert out[total:].tolist() == [-7] * 5
    fresh = kvi.build_kv_indices(r2t, rows, lens, total, page_size=page_size, kv_start=starts)
    assert fresh.tolist() == got.tolist()
    out.fill_(-7)
    whole = kvi.build_kv_indices(r2t, rows, lens, total, page_size=page_size, kv_start=starts, out=out, whole_out=True)
    assert whole is out and out[:total].tolist() == got.tolist() and out[total:].tolist() == [-7] * 5


def _check_build_with_every_output(device: str, page_size: int, seed: int) -> None:
    """build_kv_indices with indptr / last-page lengths / query offsets, into poisoned buffers, vs loops."""
    r2t, rows, lens, starts = (x.to(device) for x in _case(seed, page_size, seed % 2 == 1))
    bs = lens.shape[0]
    q = torch.randint(0, 9, (bs,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    pages = [-(-n // page_size) for n in lens.tolist()]
    total = sum(pages)
    indptr, last, qo = (torch.full((n,), -1, dtype=torch.int32, device=device) for n in (bs + 1, bs, bs + 1))
    got = kvi.build_kv_indices(
        r2t,
        rows,
        lens,
        total,
        page_size=page_size,
        kv_start=starts,
        indptr_out=indptr,
        last_page_len_out=last,
        q_lens=q.to(device),
        qo_indptr_out=qo,
    )
    assert got.tolist() == _expected_ids(r2t.cpu(), rows.cpu(), lens.cpu(), starts.cpu(), page_size)
    assert indptr.tolist() == [sum(pages[:i]) for i in range(bs + 1)]
    assert last.tolist() == [n - (p - 1) * page_size if p else 0 for n, p in zip(lens.tolist(), pages)]
    assert qo.tolist() == [sum(q.tolist()[:i]) for i in range(bs + 1)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_build_kv_indices_torch_path_every_output(page_size):
    for seed in range(6):
        _check_build_with_every_output("cpu", page_size, 40 + seed)


def test_build_kv_indices_rejects_a_short_or_mistyped_out():
    r2t = torch.arange(20, dtype=torch.int32).view(2, 10)
    rows, lens = torch.tensor([1, 0]), torch.tensor([3, 2], dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match="out"):
        kvi.build_kv_indices(r2t, rows, lens, 5, out=torch.empty(4, dtype=torch.int32))
    with pytest.raises(InvalidArgumentError, match="out"):
        kvi.build_kv_indices(r2t, rows, lens, 5, out=torch.empty(5, dtype=torch.int64))
    with pytest.raises(InvalidArgumentError, match="qo_indptr_out"):
        kvi.build_kv_indices(r2t, rows, lens, 5, q_lens=lens)
    assert kvi.build_kv_indices(r2t, rows, lens, 5).tolist() == [10, 11, 12, 0, 1]


def test_kv_indices_module_imports_no_triton():
    code = "import sys, attn_core.ops.kv_indices; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_path_on_gpu(page_size):
    pytest.importorskip("triton")
    for seed in range(10):
        r2t, rows, lens, starts = _case(300 + seed, page_size, seed % 2 == 1)
        total = int(kvi.num_pages_from_lens(lens, page_size).sum())
        got = kvi.build_kv_indices(
            r2t.cuda(), rows.cuda(), lens.cuda(), total, page_size=page_size, kv_start=starts.cuda()
        )
        assert got.cpu().tolist() == _expected_ids(r2t, rows, lens, starts, page_size)
        out = torch.full((total + 3,), -7, dtype=torch.int32, device="cuda")
        whole = kvi.build_kv_indices(
            r2t.cuda(),
            rows.cuda(),
            lens.cuda(),
            total,
            page_size=page_size,
            kv_start=starts.cuda(),
            out=out,
            whole_out=True,
        )
        assert whole is out and out[:total].tolist() == got.tolist() and out[total:].tolist() == [-7] * 3
        _check_build_with_every_output("cuda", page_size, 320 + seed)
