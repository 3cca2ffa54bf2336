"""Window-pool key lists (`attn_flashinfer.window_kv`, plain torch on CPU) against plain-Python loops, on
random batches whose tokens come from a real `SlidingWindowAllocator` with out-of-window slots released."""

import random

import pytest
import torch

from attn_core.memory.window_pool import SlidingWindowAllocator, SlidingWindowKVPool
from attn_flashinfer.window_kv import build_window_kv, window_key_starts


def _pool(window: int, page_size: int = 1, size: int = 4096, window_size: int = 4096) -> SlidingWindowKVPool:
    alloc = SlidingWindowAllocator(size, window_size, window, page_size)
    return SlidingWindowKVPool(alloc, torch.float16, 1, 8, 2, window_layers=[0])


def test_window_key_starts_example():
    got = window_key_starts(torch.tensor([6, 2, 9]), torch.tensor([2, 2, 1]), 3)
    assert got.tolist() == [2, 0, 6]
    assert window_key_starts(torch.tensor([6, 2, 9]), None, 3).tolist() == [3, 0, 6]


def test_worked_example_of_the_module_docstring():
    pool = _pool(3, size=256, window_size=256)
    pool.allocator.full_to_window.copy_(torch.arange(pool.allocator.full_to_window.numel(), dtype=torch.int32) + 100)
    r2t = torch.zeros(2, 8, dtype=torch.int32)
    for row in range(2):
        r2t[row] = 10 * (row + 1) + torch.arange(8, dtype=torch.int32)
    seq, q = torch.tensor([6, 2], dtype=torch.int32), torch.tensor([2, 2], dtype=torch.int32)
    kv = build_window_kv(pool, r2t, torch.tensor([1, 0]), seq, seq, q, q)
    assert kv.page_size == 1
    assert kv.kv_lens.tolist() == [4, 2]
    assert kv.indptr.tolist() == [0, 4, 6]
    assert kv.last_page_len.tolist() == [1, 1]
    assert kv.indices.tolist() == [122, 123, 124, 125, 110, 111]
    assert kv.launch is None  # written at once


def _random_step(rng: random.Random, pool: SlidingWindowKVPool, decode: bool, encoder: bool):
    """Requests allocated through the pool's allocator (encoder tokens first when `encoder`), their
    out-of-window window slots released as an engine would before the step; returns the step's inputs."""
    alloc = pool.allocator
    bs = rng.randint(1, 6)
    rows = rng.sample(range(8), bs)
    r2t = torch.zeros(8, 160, dtype=torch.int32)
    seq, q, enc = [], [], []
    for row in rows:
        s = rng.randint(1, 90)
        n = 1 if decode else rng.randint(1, s)
        e = rng.randint(0, 20) if encoder else 0
        slots = alloc.alloc_extend([0], [e + s], [0])
        assert slots is not None
        r2t[row, : e + s] = slots.to(torch.int32)
        alloc.release_out_of_window(r2t[row, e : e + s], s - n)  # decoder tokens only
        seq.append(s), q.append(n), enc.append(e)
    i32 = dict(dtype=torch.int32)
    return r2t, torch.tensor(rows), torch.tensor(seq, **i32), torch.tensor(q, **i32), torch.tensor(enc, **i32)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "extend"])
@pytest.mark.parametrize("encoder", [False, True], ids=["decoder_only", "encoder_first"])
def test_random_batches_against_loops(page_size, decode, encoder):
    rng = random.Random(f"{page_size}-{decode}-{encoder}")
    for _ in range(4):
        w = rng.randint(1, 40)
        pool = _pool(w, page_size)
        r2t, rows, seq, q, enc = _random_step(rng, pool, decode, encoder)
        f2w = pool.allocator.full_to_window.tolist()
        kv = build_window_kv(
            pool, r2t, rows, seq, seq, None if decode else q, None if decode else q, enc if encoder else None
        )
        want_lens, want_ids = [], []
        for i, row in enumerate(rows.tolist()):
            s, n, e = int(seq[i]), int(q[i]), int(enc[i])
            start = max(0, s - n - w + 1)
            want_lens.append(s - start)
            for p in range(start, s):
                slot = f2w[int(r2t[row, e + p])]
                assert slot != 0, "a key inside the window was released"  # the test's own setup
                want_ids.append(slot)
        assert kv.kv_lens.tolist() == want_lens
        assert kv.indptr.tolist() == [sum(want_lens[:i]) for i in range(len(want_lens) + 1)]
        assert kv.last_page_len.tolist() == [1] * len(want_lens)
        assert kv.indices.tolist() == want_ids
        assert kv.max_len == max(want_lens) and kv.num_pages == sum(want_lens)


def test_device_buffers_from_out_hold_the_host_layout():
    """With `out` (the backend's scratch buffers) the launch also writes indptr / last-page lengths."""
    rng = random.Random(7)
    pool = _pool(5, 4)
    r2t, rows, seq, q, _ = _random_step(rng, pool, False, False)
    bs = rows.shape[0]
    buf = torch.full((4096,), -1, dtype=torch.int32)

    def out(n, pages):
        return buf[2 * n + 1 :], buf[: n + 1], buf[n + 1 : 2 * n + 1]

    kv = build_window_kv(pool, r2t, rows, seq, seq, q, q, out=out)
    assert torch.equal(kv.indptr_dev, kv.indptr) and torch.equal(kv.last_page_len_dev, kv.last_page_len)
    assert kv.indices.data_ptr() == buf[2 * bs + 1 :].data_ptr()
    assert (kv.indices != 0).all()
