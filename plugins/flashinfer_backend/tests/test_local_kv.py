"""Chunked local key lists (`attn_flashinfer.local_kv`, plain torch on CPU) against plain-Python loops over
each query's visible keys, on random batches laid out by the real allocator."""

import random

import pytest
import torch

from attn_core.memory import PagedTokenAllocator
from attn_flashinfer.local_kv import build_local_decode_kv, build_local_extend, local_page_size


def test_local_page_size_examples():
    assert local_page_size(8, 4, False) == 4
    assert local_page_size(6, 4, False) == 1
    assert local_page_size(8, 4, True) == 1
    assert local_page_size(5, 1, True) == 1


def test_worked_example_of_the_module_docstring():
    r2t = torch.zeros(2, 16, dtype=torch.int32)
    r2t[1] = 20 + torch.arange(16, dtype=torch.int32)
    r2t[0] = 40 + torch.arange(16, dtype=torch.int32)
    rows, q, seq = (
        torch.tensor([1, 0]),
        torch.tensor([3, 1], dtype=torch.int32),
        torch.tensor([6, 9], dtype=torch.int32),
    )
    local = build_local_extend(4, r2t, rows, q, seq, 2)
    assert local.qo.indptr.tolist() == [0, 1, 3, 4]
    assert local.kv.kv_lens.tolist() == [4, 2, 1]
    assert local.kv.indptr.tolist() == [0, 2, 3, 4]
    assert local.kv.last_page_len.tolist() == [2, 2, 1]
    assert local.kv.indices.tolist() == [10, 11, 12, 24]
    kv = build_local_decode_kv(4, r2t, rows, seq, seq, 2)
    assert kv.kv_lens.tolist() == [2, 1] and kv.indices.tolist() == [12, 24]


def _keys_of(kv, v):
    """Slots the wrapper reads for (virtual) request v: page p, offsets 0 .. len - 1 in page order."""
    ps = kv.page_size
    pages = kv.indices[int(kv.indptr[v]) : int(kv.indptr[v + 1])].tolist()
    return [pages[i // ps] * ps + i % ps for i in range(int(kv.kv_lens[v]))]


def _random_batch(rng, page_size, decode, encoder):
    alloc = PagedTokenAllocator(8192, page_size)
    bs = rng.randint(1, 6)
    rows = rng.sample(range(8), bs)
    r2t = torch.zeros(8, 200, dtype=torch.int32)
    seq, q, enc = [], [], []
    for row in rows:
        s = rng.randint(1, 120)
        n = 1 if decode else rng.randint(0, s)
        e = rng.randint(0, 30) if encoder else 0
        r2t[row, : e + s] = alloc.alloc_extend([0], [e + s], [0]).to(torch.int32)
        seq.append(s), q.append(n), enc.append(e)
    i32 = dict(dtype=torch.int32)
    return r2t, torch.tensor(rows), torch.tensor(seq, **i32), torch.tensor(q, **i32), torch.tensor(enc, **i32)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("encoder", [False, True], ids=["decoder_only", "encoder_first"])
def test_random_extend_steps_give_each_query_its_chunk(page_size, encoder):
    """Per query row (in the batch's order): the virtual request holding it must list exactly the keys
    (p // C) * C .. p of its request as slots, with the query last among them (the causal alignment)."""
    rng = random.Random(f"ext-{page_size}-{encoder}")
    for _ in range(4):
        chunk = rng.randint(1, 40)
        r2t, rows, seq, q, enc = _random_batch(rng, page_size, False, encoder)
        if int(q.sum()) == 0:
            continue
        ps = local_page_size(chunk, page_size, encoder)
        local = build_local_extend(chunk, r2t, rows, q, seq, ps, enc if encoder else None)
        assert local.kv.page_size == ps
        qo = local.qo.indptr.tolist()
        row_of_v = [v for v in range(len(qo) - 1) for _ in range(qo[v + 1] - qo[v])]
        t = 0
        for i, row in enumerate(rows.tolist()):
            s, n, e = int(seq[i]), int(q[i]), int(enc[i])
            for p in range(s - n, s):
                v = row_of_v[t]
                keys = _keys_of(local.kv, v)
                k_last = len(keys) - (qo[v + 1] - 1 - t) - 1  # the key the query sits on
                start = p // chunk * chunk
                assert keys[: k_last + 1] == [int(r2t[row, e + j]) for j in range(start, p + 1)]
                assert keys[k_last:] == [int(r2t[row, e + j]) for j in range(p, p + len(keys) - k_last)]
                t += 1
        assert t == int(q.sum()) == qo[-1]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("encoder", [False, True], ids=["decoder_only", "encoder_first"])
def test_random_decode_steps_start_at_the_chunk(page_size, encoder):
    rng = random.Random(f"dec-{page_size}-{encoder}")
    for _ in range(4):
        chunk = rng.randint(1, 40)
        r2t, rows, seq, _, enc = _random_batch(rng, page_size, True, encoder)
        ps = local_page_size(chunk, page_size, encoder)
        kv = build_local_decode_kv(chunk, r2t, rows, seq, seq, ps, enc if encoder else None)
        for i, row in enumerate(rows.tolist()):
            s, e = int(seq[i]), int(enc[i])
            start = (s - 1) // chunk * chunk
            assert _keys_of(kv, i) == [int(r2t[row, e + j]) for j in range(start, s)]


def test_query_offsets_go_to_the_device_buffer():
    r2t = torch.arange(64, dtype=torch.int32).reshape(2, 32)
    buf = torch.full((16,), -1, dtype=torch.int32)
    local = build_local_extend(4, r2t, torch.tensor([0, 1]), torch.tensor([6, 2]), torch.tensor([10, 2]), 1, qo_out=buf)
    assert local.qo.indptr.tolist() == [0, 4, 6, 8] and buf[:4].tolist() == [0, 4, 6, 8] and not local.qo.pending
