"""Index builders vs plain Python loops over requests."""

import random

import pytest
import torch

from attn_core.batching.positions import extend_start_loc_from_lens, positions_from_lens
from attn_core.ops.kv_indices import kv_indices_from_req_to_token, kv_indptr_from_lens, page_table_from_req_to_token


def _random_table(rng, bs, max_len):
    r2t = torch.randint(1, 10_000, (bs + 3, max_len), dtype=torch.int32)
    rows = torch.tensor(rng.sample(range(bs + 3), bs), dtype=torch.int64)
    lens = torch.tensor([rng.randint(0, max_len) for _ in range(bs)], dtype=torch.int32)
    return r2t, rows, lens


@pytest.mark.parametrize("seed", range(5))
def test_kv_indices_match_loop(seed):
    rng = random.Random(seed)
    bs, max_len = rng.randint(1, 7), rng.randint(1, 40)
    r2t, rows, lens = _random_table(rng, bs, max_len)
    start = torch.tensor([rng.randint(0, max_len - int(n)) for n in lens], dtype=torch.int32)
    indptr = kv_indptr_from_lens(lens)
    assert indptr.dtype == torch.int32 and indptr.tolist()[0] == 0
    total = int(lens.sum())
    got = kv_indices_from_req_to_token(r2t, rows, indptr, total, kv_start=start)
    want = []
    for r, n, s in zip(rows.tolist(), lens.tolist(), start.tolist()):
        want += r2t[r, s : s + n].tolist()
    assert got.dtype == torch.int32 and got.tolist() == want
    got0 = kv_indices_from_req_to_token(r2t, rows, indptr, total)
    assert got0.tolist() == [v for r, n in zip(rows.tolist(), lens.tolist()) for v in r2t[r, :n].tolist()]


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_page_table_matches_loop(page_size):
    rng = random.Random(page_size)
    bs, max_len = 5, 200
    # a table laid out like the paged allocator's: token i at offset i % page_size of its page
    r2t = torch.zeros(bs, max_len, dtype=torch.int32)
    pages = list(range(1, 5000))
    rng.shuffle(pages)
    for r in range(bs):
        for i in range(max_len):
            if i % page_size == 0:
                page = pages.pop()
            r2t[r, i] = page * page_size + i % page_size
    rows = torch.tensor([3, 0, 4, 1, 2])
    lens = torch.tensor([0, 1, page_size, page_size + 1, 199], dtype=torch.int32)
    max_pages = -(-max_len // page_size)
    got = page_table_from_req_to_token(r2t, rows, lens, page_size, max_pages)
    for b, (r, n) in enumerate(zip(rows.tolist(), lens.tolist())):
        n_pages = -(-n // page_size)
        want = [int(r2t[r, p * page_size]) // page_size for p in range(n_pages)] + [0] * (max_pages - n_pages)
        assert got[b].tolist() == want


def test_positions_and_start_loc():
    prefix = torch.tensor([0, 5, 2], dtype=torch.int32)
    ext = torch.tensor([3, 0, 2], dtype=torch.int32)
    assert positions_from_lens(prefix, ext, 5).tolist() == [0, 1, 2, 2, 3]
    assert extend_start_loc_from_lens(ext).tolist() == [0, 3, 3]
