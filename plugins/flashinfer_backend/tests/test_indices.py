"""Index building for FlashInfer's paged wrappers (plain torch, on CPU): page ids, indptr and last-page
lengths checked against the pool's layout for batches built by the real allocator."""

import random

import pytest
import torch

from attn_core.memory import PagedTokenAllocator, ReqToTokenPool
from attn_core.ops.kv_indices import last_page_len_from_lens, page_indptr_from_lens
from attn_core.testing.batch_builder import build_forward_batch
from attn_flashinfer.indices import (
    HostOffsets,
    build_page_list,
    build_paged_kv,
    paged_kv_host,
    query_layout,
    self_attention_page_size,
)


def test_worked_example_of_the_module_docstring():
    r2t = torch.zeros(4, 8, dtype=torch.int32)
    r2t[3, :5] = torch.tensor([20, 21, 22, 23, 8])
    r2t[0, :2] = torch.tensor([12, 13])
    rows, lens = torch.tensor([3, 0]), torch.tensor([5, 2], dtype=torch.int32)
    kv = build_paged_kv(r2t, rows, lens, lens, 4)
    assert kv.indptr.tolist() == [0, 2, 3]
    assert kv.indices.tolist() == [5, 2, 3]
    assert kv.last_page_len.tolist() == [1, 2]
    assert kv.num_pages == 3 and kv.page_size == 4


def test_host_side_of_empty_and_full_pages():
    kv = paged_kv_host(torch.tensor([0, 16, 17, 1]), 16)
    assert kv.kv_lens.dtype == kv.indptr.dtype == kv.last_page_len.dtype == torch.int32
    assert kv.indptr.tolist() == [0, 0, 1, 3, 4]
    assert kv.last_page_len.tolist() == [0, 16, 1, 1]
    assert kv.max_len == 17 and kv.num_pages == 4 and kv.indices is None


def test_host_side_of_an_empty_batch():
    kv = paged_kv_host(torch.zeros(0, dtype=torch.int32), 16)
    assert kv.indptr.tolist() == [0] and kv.last_page_len.tolist() == [] and kv.max_len == 0 and kv.num_pages == 0


@pytest.mark.parametrize("page_size", [1, 2, 16, 64])
def test_host_layout_matches_attn_core_builders(page_size):
    rng = random.Random(page_size)
    lens = torch.tensor([0, 1, page_size, page_size + 1] + [rng.randint(0, 5000) for _ in range(60)], dtype=torch.int32)
    kv = paged_kv_host(lens, page_size)
    assert torch.equal(kv.kv_lens, lens)
    assert torch.equal(kv.indptr, page_indptr_from_lens(lens, page_size))
    assert torch.equal(kv.last_page_len, last_page_len_from_lens(lens, page_size))
    assert kv.indptr.dtype == kv.last_page_len.dtype == torch.int32
    assert kv.max_len == int(lens.max()) and kv.num_pages == int(kv.indptr[-1])


def _keys_of(kv, r):
    """Slots FlashInfer reads for request r: page p, offsets 0 .. (page_size or last_page_len) - 1."""
    ps = kv.page_size
    pages = kv.indices[int(kv.indptr[r]) : int(kv.indptr[r + 1])].tolist()
    n = int(kv.kv_lens[r])
    return [pages[i // ps] * ps + i % ps for i in range(n)]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_paged_keys_are_exactly_the_requests_slots(page_size, seed):
    rng = random.Random(seed * 31 + page_size)
    reqs = [
        (rng.randint(0, 60), rng.randint(1, 20), rng.choice([0, 0, rng.randint(1, 40)]))
        for _ in range(rng.randint(1, 6))
    ]
    max_len = max(p + e + n for p, e, n in reqs) + page_size
    pool = ReqToTokenPool(len(reqs) + 2, max_len)
    alloc = PagedTokenAllocator(page_size * (sum(-(-(p + e + n) // page_size) for p, e, n in reqs) + 4), page_size)
    b = build_forward_batch("EXTEND", reqs, req_to_token_pool=pool, allocator=alloc)
    r2t, rows = pool.req_to_token, b.req_pool_indices
    enc = b.encoder_lens if b.encoder_lens is not None else None
    self_ps = self_attention_page_size(page_size, enc is not None)
    sets = {
        "seq": (b.seq_lens, b.seq_lens_cpu, enc, self_ps, lambda p, e, n: (n, n + p + e)),
        "prefix": (b.extend_prefix_lens, b.extend_prefix_lens_cpu, enc, self_ps, lambda p, e, n: (n, n + p)),
    }
    if enc is not None:
        sets["cross"] = (b.encoder_lens, b.encoder_lens_cpu, None, page_size, lambda p, e, n: (0, n))
    for name, (lens, lens_host, start, ps, cols) in sets.items():
        kv = build_paged_kv(r2t, rows, lens, lens_host, ps, kv_start=start)
        assert kv.indices.dtype == torch.int32 and kv.indptr_dev is None, name
        assert kv.last_page_len.tolist() == [n - (-(-n // ps) - 1) * ps if n else 0 for n in kv.kv_lens.tolist()]
        for r, ((p, e, n), row) in enumerate(zip(reqs, rows.tolist())):
            c0, c1 = cols(p, e, n)
            assert _keys_of(kv, r) == r2t[row, c0:c1].tolist(), (name, r)


@pytest.mark.parametrize("page_size", [1, 16])
def test_device_arrays_and_query_offsets_come_from_one_deferred_launch(page_size):
    """With device buffers for them, indptr / last-page lengths (and the step's query offsets, when
    handed to the launch) land in poisoned buffers only when the deferred writes run, equal to the host
    numbers; the page ids fill only their prefix of a longer buffer."""
    rng = random.Random(page_size)
    for _ in range(5):
        bs = rng.randint(1, 7)
        lens = torch.tensor([rng.choice([0, 1, page_size, rng.randint(0, 90)]) for _ in range(bs)], dtype=torch.int32)
        q = torch.tensor([rng.randint(0, 9) for _ in range(bs)], dtype=torch.int32)
        r2t = torch.arange(bs * 100, dtype=torch.int32).view(bs, 100) + 1000
        ids, indptr, last = (torch.full((n,), -5, dtype=torch.int32) for n in (300, bs + 1, bs))
        bufs = (ids, indptr, last)
        kv = build_paged_kv(r2t, torch.arange(bs), lens, lens, page_size, out=lambda b, n, bufs=bufs: bufs, defer=True)
        qo = query_layout(q, torch.full((bs + 1,), -5, dtype=torch.int32), q)
        assert qo.pending and (indptr == -5).all() and (ids == -5).all() and (qo.indptr_dev == -5).all()
        assert kv.indptr_dev is indptr and kv.last_page_len_dev is last
        kv.write_device(qo.lens_dev, qo.indptr_dev)
        assert torch.equal(kv.indptr_dev, kv.indptr) and torch.equal(kv.last_page_len_dev, kv.last_page_len)
        assert torch.equal(qo.indptr_dev, qo.indptr)
        assert kv.indices.tolist() == [
            int(r2t[r, j * page_size]) // page_size for r in range(bs) for j in range(-(-int(lens[r]) // page_size))
        ]
        assert (ids[kv.num_pages :] == -5).all()
        kv.write_device()  # a second call launches nothing
        assert kv.launch is None


def test_a_pending_query_layout_is_copied_when_no_launch_took_it():
    qo = query_layout(
        torch.tensor([2, 5]), torch.full((3,), -1, dtype=torch.int32), torch.tensor([2, 5], dtype=torch.int32)
    )
    qo.write_device()
    assert qo.indptr_dev.tolist() == [0, 2, 7] and not qo.pending


def test_encoder_decoder_self_attention_is_indexed_per_token():
    assert self_attention_page_size(16, True) == 1
    assert self_attention_page_size(16, False) == 16


def test_query_layout():
    qo = query_layout(torch.tensor([3, 0, 5]))
    assert qo.indptr.dtype == qo.lens.dtype == torch.int32
    assert qo.indptr.tolist() == [0, 3, 3, 8] and qo.lens.tolist() == [3, 0, 5]
    assert qo.max_len == 5 and qo.num_tokens == 8
    assert qo.indptr_dev is None and not qo.pending


def test_page_list_worked_example():
    r2t = torch.zeros(4, 8, dtype=torch.int32)
    r2t[3, :5] = torch.tensor([20, 21, 22, 23, 8])
    r2t[0, :2] = torch.tensor([12, 13])
    lens = torch.tensor([5, 2], dtype=torch.int32)
    buf = torch.full((16,), -1, dtype=torch.int32)
    kv = build_page_list(r2t, torch.tensor([3, 0]), lens, lens, 4, lambda n: buf)
    assert kv.indptr.tolist() == [0, 2, 3] and kv.num_pages == 3 and kv.page_size == 4
    assert kv.indices is buf and kv.indices[: kv.num_pages].tolist() == [5, 2, 3] and buf[3:].eq(-1).all()
    assert kv.kv_lens.dtype == kv.indptr.dtype == torch.int32


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_page_lists_built_into_reused_host_offsets(page_size):
    """Steps of one batch size built into one `HostOffsets` pair: each step's offsets and page ids are
    its own (against attn-core's builders), written into the same host memory every time."""
    rng = random.Random(page_size)
    rows, width = 6, 400
    r2t = torch.tensor(
        [[rng.randrange(1000) * page_size + (c % page_size) for c in range(width)] for _ in range(rows)],
        dtype=torch.int32,
    )
    offsets = HostOffsets()
    buf = torch.full((4096,), -1, dtype=torch.int32)
    for step in range(4):
        bs = 3 if step < 3 else 5
        rpi = torch.tensor(rng.sample(range(rows), bs))
        lens = torch.tensor([rng.randrange(0, width) for _ in range(bs)], dtype=torch.int32)
        pair = offsets.get(bs)
        assert offsets.get(bs) is pair and pair[1].shape == (bs + 1,)
        kv = build_page_list(r2t, rpi, lens, lens, page_size, lambda n: buf, host_indptr=pair)
        want = page_indptr_from_lens(lens, page_size)
        assert kv.indptr is pair[1] and kv.indptr.tolist() == want.tolist() and kv.num_pages == int(want[-1])
        ids = [int(r2t[r, c]) // page_size for r, n in zip(rpi.tolist(), lens.tolist()) for c in range(0, n, page_size)]
        assert kv.indices is buf and kv.indices[: kv.num_pages].tolist() == ids


def test_host_offsets_pairs_share_memory():
    arr, t = HostOffsets().get(2)
    arr[:] = [4, 5, 6]
    assert t.tolist() == [4, 5, 6] and t.dtype == torch.int32
