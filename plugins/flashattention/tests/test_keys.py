"""The key lists (`attn_flashattention.keys`): the docstrings' worked examples, and random cases against
plain Python loops over the request rows."""

from __future__ import annotations

import random

import torch

from attn_core.ops.kv_indices import rows_in_table, slots_in_pool
from attn_flashattention.keys import (
    TreeVerify,
    page_lists,
    pages_for,
    query_offsets,
    token_lists,
    tree_key_lists,
    verify_queries,
)


def test_worked_examples():
    assert pages_for(33, 16) == 3 and pages_for(0, 16) == 1 and pages_for(16, 16) == 1
    assert query_offsets(torch.tensor([3, 0, 2], dtype=torch.int32)).tolist() == [0, 3, 3, 5]
    r2t = torch.tensor([[8, 9, 4, 5, 6, 7]], dtype=torch.int32)
    assert page_lists(r2t, torch.tensor([0]), torch.tensor([5], dtype=torch.int32), 2, 3).tolist() == [[4, 2, 3]]
    r2t = torch.tensor([[10, 11, 12, 13, 14]], dtype=torch.int32)
    one = torch.tensor([0])
    assert token_lists(r2t, one, torch.tensor([2]), torch.tensor([3]), 4).tolist() == [[12, 13, 14, 0]]
    r2t = torch.tensor([[5, 6, 7]], dtype=torch.int32)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool).reshape(-1)
    q_req, q_idx = verify_queries(torch.tensor([2]), "cpu")
    table, counts = tree_key_lists(
        mask, torch.tensor([0, 6]), r2t, one, torch.tensor([3]), q_req, q_idx, torch.tensor([2]), 3
    )
    assert table.tolist() == [[5, 6, 7], [5, 7, 6]] and counts.tolist() == [2, 2]
    req, idx = verify_queries(torch.tensor([2, 1]), "cpu")
    assert req.tolist() == [0, 0, 1] and idx.tolist() == [0, 1, 0]


def test_bad_device_rows_and_slots_are_never_read():
    """Rows outside the table and slots outside the pool (what a careless engine's device tensors may hold,
    refused by the step check and raised at the next step) give dummy ids 0, never an out-of-range index
    (on the CPU an out-of-range index raises: these calls must not)."""
    r2t = torch.tensor([[1, 2, 3, 4], [5, 6, 999, 8]], dtype=torch.int32)
    safe, ok = rows_in_table(torch.tensor([1, -1, 7]), r2t.shape[0])
    assert safe.tolist() == [1, 0, 1] and ok.tolist() == [True, False, False]
    assert slots_in_pool(torch.tensor([3, -1, 7]), 5).tolist() == [True, False, False]
    assert slots_in_pool(torch.tensor([3, -1]), None).tolist() == [True, True]
    rows, lens = torch.tensor([1, -1, 7]), torch.tensor([4, 2, 3])
    fault = torch.zeros(32, dtype=torch.int32)
    table = page_lists(r2t, rows, lens, 1, 4, num_slots=10, fault=fault)
    assert table.tolist() == [[5, 6, 0, 8], [0, 0, 0, 0], [0, 0, 0, 0]] and bool(fault.any())
    tokens = token_lists(r2t, rows, torch.tensor([1, 0, 0]), torch.tensor([3, 2, 1]), 3, num_slots=10)
    assert tokens.tolist() == [[6, 0, 8], [0, 0, 0], [0, 0, 0]]
    mask = torch.ones(2 * 4 + 4, dtype=torch.bool)
    q_req, q_idx = verify_queries(torch.tensor([2, 1]), "cpu")
    table, counts = tree_key_lists(
        mask,
        torch.tensor([0, 8, 12]),
        r2t,
        torch.tensor([1, 9]),
        torch.tensor([4, 4]),
        q_req,
        q_idx,
        torch.tensor([2, 1]),
        4,
        num_slots=10,
    )
    assert counts.tolist() == [3, 3, 0] and table[0].tolist() == [5, 6, 8, 0] and table[2].tolist() == [0, 0, 0, 0]


def _rows(rng: random.Random, n: int, width: int, slots: int) -> torch.Tensor:
    return torch.tensor([[rng.randrange(1, slots) for _ in range(width)] for _ in range(n)], dtype=torch.int32)


def test_page_and_token_lists_against_loops():
    rng = random.Random(0)
    for _ in range(20):
        ps = rng.choice([1, 2, 4, 16])
        n, width = rng.randint(1, 5), 48
        r2t = _rows(rng, 6, width, 999)
        rows = torch.tensor(rng.sample(range(6), n))
        lens = torch.tensor([rng.randint(0, width) for _ in range(n)], dtype=torch.int32)
        pages = pages_for(int(lens.max()), ps)
        table = page_lists(r2t, rows, lens, ps, pages)
        assert table.dtype == torch.int32 and table.is_contiguous()
        for b in range(n):
            for p in range(int(lens[b])):
                assert int(table[b, p // ps]) == int(r2t[rows[b], p - p % ps]) // ps
        start = torch.tensor([rng.randint(0, 8) for _ in range(n)])
        lens = torch.minimum(lens, width - start).to(torch.int32)
        slots = token_lists(r2t, rows, start, lens, width)
        for b in range(n):
            got = slots[b].tolist()
            assert got[: int(lens[b])] == r2t[rows[b], int(start[b]) : int(start[b] + lens[b])].tolist()
            assert all(x == 0 for x in got[int(lens[b]) :])


def test_tree_key_lists_against_loops():
    """Random masks (prefix keys included), rows, lengths and windows: each query lists exactly the keys its
    mask row (and window) lets it see, in position order."""
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(25):
        bs, t, width = rng.randint(1, 4), rng.randint(1, 5), 40
        r2t = _rows(rng, 5, width, 500)
        rows = torch.tensor(rng.sample(range(5), bs))
        seq = torch.tensor([rng.randint(t, width) for _ in range(bs)], dtype=torch.int32)
        masks = [torch.rand(t, int(s), generator=gen) < 0.6 for s in seq]
        flat = torch.cat([m.reshape(-1) for m in masks])
        indptr = torch.tensor([0] + [m.numel() for m in masks]).cumsum(0)
        q_lens = torch.full((bs,), t, dtype=torch.int32)
        q_req, q_idx = verify_queries(q_lens, "cpu")
        window = rng.choice([None, 1, 3, 7])
        table, counts = tree_key_lists(flat, indptr, r2t, rows, seq, q_req, q_idx, q_lens, int(seq.max()), window)
        for row in range(bs * t):
            b, i = row // t, row % t
            pos = int(seq[b]) - t + i
            want = [
                int(r2t[rows[b], j])
                for j in range(int(seq[b]))
                if masks[b][i, j] and (window is None or j >= pos - window + 1)
            ]
            assert int(counts[row]) == len(want)
            assert table[row, : len(want)].tolist() == want


def test_tree_verify_writes_into_given_buffers_and_reuses_lists():
    r2t = torch.tensor([[5, 6, 7, 8]], dtype=torch.int32)
    mask = torch.ones(2 * 4, dtype=torch.bool)
    q_lens = torch.tensor([2], dtype=torch.int32)
    q_req, q_idx = verify_queries(q_lens, "cpu")
    tree = TreeVerify(
        mask, torch.tensor([0, 8]), r2t, torch.tensor([0]), torch.tensor([4]), q_req, q_idx, q_lens, 4, torch.arange(3)
    )
    out = (torch.full((2, 4), -1, dtype=torch.int32), torch.full((2,), -1, dtype=torch.int32))
    keys = tree.keys(2, out=out)
    assert keys.page_table is out[0] and keys.seqused_k is out[1]
    # the mask shows every key; window 2 keeps keys >= 1 for the query at 2 and >= 2 for the one at 3
    assert out[0].tolist() == [[6, 7, 8, 5], [7, 8, 5, 6]] and out[1].tolist() == [3, 2]
    assert tree.keys(2) is keys and not keys.causal and keys.page_size == 1
