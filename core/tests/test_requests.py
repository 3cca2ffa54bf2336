"""RequestPool / build_step: requests continued over several steps, checked against a plain host model
of what each request's row must hold; forks over shared prefixes, rollback, frees, all-or-nothing
allocation and typed errors; the step's derived fields checked field by field on random workloads."""

from __future__ import annotations

import random

import pytest
import torch

import attn_core as ac
from attn_core import ForwardMode, InvalidArgumentError, KVCacheError


def make_pool(page_size: int, slots: int = 256, rows: int = 8, max_len: int = 128) -> ac.RequestPool:
    return ac.RequestPool(ac.ReqToTokenPool(rows, max_len), ac.PagedTokenAllocator(slots, page_size))


def row_slots(pool: ac.RequestPool, req: ac.Request) -> list[int]:
    return pool.req_to_token_pool.req_to_token[req.row, : req.kv_len].tolist()


def check_layout(pool: ac.RequestPool, req: ac.Request) -> None:
    """Token i of the request sits at page offset i % P, tokens of one page in consecutive slots."""
    slots, ps = row_slots(pool, req), pool.page_size
    assert slots == req.slots[: req.kv_len]
    for i, s in enumerate(slots):
        assert s >= ps and s % ps == i % ps, (i, s)
        if i % ps:
            assert s == slots[i - 1] + 1


def assert_empty(pool: ac.RequestPool) -> None:
    assert pool.num_requests == 0
    assert pool.req_to_token_pool.available_size() == pool.req_to_token_pool.size
    assert pool.allocator.available_size() == pool.allocator.size


def test_step_mode_rules():
    assert ac.step_mode([7, 3], [1, 1]) == ForwardMode.DECODE
    assert ac.step_mode([7, 0], [1, 5]) == ForwardMode.MIXED
    assert ac.step_mode([7, 4], [1, 3]) == ForwardMode.MIXED  # a chunk after cached tokens is a prefill chunk
    assert ac.step_mode([0, 16], [5, 16]) == ForwardMode.EXTEND
    assert ac.step_mode([0], [1]) == ForwardMode.EXTEND


def test_positions_helpers_worked_examples():
    prefix, ext = torch.tensor([0, 5, 2], dtype=torch.int32), torch.tensor([3, 0, 2], dtype=torch.int32)
    assert ac.positions_from_lens(prefix, ext, 5).tolist() == [0, 1, 2, 2, 3]
    assert ac.extend_start_loc_from_lens(ext).tolist() == [0, 3, 3]
    assert ac.chain_verify_mask(1, 2).tolist() == [[True, True, False], [True, True, True]]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_random_workload_over_many_steps(page_size):
    """Random arrivals, chunks, decodes and frees; every step's fields against the host model."""
    rng = random.Random(page_size)
    pool = make_pool(page_size, slots=512, rows=6)
    running: dict[int, tuple[ac.Request, int]] = {}  # rid -> (request, prompt length)
    for _ in range(40):
        while len(running) < 5 and rng.random() < 0.5:
            r = pool.add()
            running[r.rid] = (r, rng.randint(1, 40))
        if not running:
            continue
        work = []
        for r, prompt in running.values():
            left = prompt - r.kv_len
            n = min(left, rng.randint(1, 12)) if left > 0 else 1
            if rng.random() < 0.8:
                work.append((r, n))
        if not work:
            continue
        rng.shuffle(work)
        before = [r.kv_len for r, _ in work]
        batch = ac.build_step(pool, work)
        counts = [n for _, n in work]
        assert batch.forward_mode == ac.step_mode(before, counts)
        assert batch.batch_size == len(work)
        assert batch.req_pool_indices.tolist() == [r.row for r, _ in work]
        assert batch.seq_lens_cpu.tolist() == batch.seq_lens.tolist() == [b + n for b, n in zip(before, counts)]
        assert batch.seq_lens_sum == sum(b + n for b, n in zip(before, counts))
        assert batch.seq_lens.dtype == torch.int32 and batch.out_cache_loc.dtype == torch.int64
        assert batch.positions.tolist() == [p for b, n in zip(before, counts) for p in range(b, b + n)]
        want_loc = [s for (r, n), b in zip(work, before) for s in r.slots[b : b + n]]
        assert batch.out_cache_loc.tolist() == want_loc
        assert len(set(want_loc)) == len(want_loc)
        if batch.forward_mode.is_decode():
            assert batch.extend_seq_lens is None and batch.num_tokens == len(work)
        else:
            assert batch.extend_prefix_lens.tolist() == batch.extend_prefix_lens_cpu.tolist() == before
            assert batch.extend_seq_lens.tolist() == batch.extend_seq_lens_cpu.tolist() == counts
            assert batch.extend_start_loc.tolist() == [sum(counts[:i]) for i in range(len(counts))]
            assert batch.extend_num_tokens == batch.num_tokens == sum(counts)
        for r, _ in work:
            check_layout(pool, r)
        held = [s for r, _ in running.values() for s in r.slots]
        assert len(set(held)) == len(held), "two requests hold one slot"
        for rid in [rid for rid, (r, p) in running.items() if r.kv_len >= p + 3 or rng.random() < 0.05]:
            pool.free(running.pop(rid)[0])
    for r, _ in list(running.values()):
        pool.free(r)
    assert_empty(pool)


@pytest.mark.parametrize("page_size", [1, 4])
def test_fork_shares_whole_pages_and_frees_them_last(page_size):
    pool = make_pool(page_size, slots=64)
    a = pool.add()
    ac.build_step(pool, [(a, 10)])
    b = pool.fork(a, 10)
    shared = 10 // page_size * page_size
    assert b.kv_len == shared and row_slots(pool, b) == row_slots(pool, a)[:shared]
    free_before = pool.allocator.available_size()
    batch = ac.build_step(pool, [(a, 1), (b, 10 - shared + 1)])  # a decodes, b runs the rest of its prompt
    new_a, new_b = batch.out_cache_loc.tolist()[:1], batch.out_cache_loc.tolist()[1:]
    assert not set(new_b) & set(a.slots), "the fork wrote into a page of its parent"
    assert all(s // page_size not in {x // page_size for x in a.slots[:shared]} for s in new_b)
    check_layout(pool, a)
    check_layout(pool, b)
    assert pool.allocator.available_size() < free_before
    pool.free(a)  # the shared pages stay: b still reads them
    assert all(pool.allocator.is_allocated(s) for s in b.slots)
    pool.free(b)
    assert_empty(pool)
    del new_a


def test_truncate_keeps_spares_and_reuses_them():
    pool = make_pool(4, slots=64)
    a = pool.add()
    ac.build_step(pool, [(a, 6)])
    verify = ac.build_step(pool, [(a, 4)], mode="target_verify")
    drafted = verify.out_cache_loc.tolist()
    assert verify.forward_mode == ForwardMode.TARGET_VERIFY and verify.spec_info.num_draft_tokens == 4
    assert verify.spec_info.custom_mask.tolist() == ac.chain_verify_mask(6, 4).reshape(-1).tolist()
    assert verify.extend_prefix_lens_cpu.tolist() == [6] and verify.positions.tolist() == [6, 7, 8, 9]
    pool.truncate(a, 8)  # two drafts rejected
    free = pool.allocator.available_size()
    again = ac.build_step(pool, [(a, 5)])  # positions 8..12: spares 8, 9; 10, 11 in the held page; 12 a new page
    assert again.out_cache_loc.tolist()[:2] == drafted[2:]  # the spares first
    assert pool.allocator.available_size() == free - 4
    check_layout(pool, a)
    pool.free(a)
    assert_empty(pool)


def test_all_or_nothing_and_typed_errors():
    pool = make_pool(4, slots=16, rows=2, max_len=32)
    a, b = pool.add(), pool.add()
    with pytest.raises(KVCacheError):
        pool.add()
    ac.build_step(pool, [(a, 5)])
    state = (pool.allocator.available_size(), a.kv_len, list(a.slots), b.kv_len)
    with pytest.raises(KVCacheError):
        ac.build_step(pool, [(a, 1), (b, 12)])  # a fits, b does not: neither is given anything
    assert state == (pool.allocator.available_size(), a.kv_len, list(a.slots), b.kv_len)
    with pytest.raises(InvalidArgumentError, match="work"):
        ac.build_step(pool, [(a, 1), (a, 1)])
    with pytest.raises(InvalidArgumentError, match="work"):
        ac.build_step(pool, [(a, 0)])
    with pytest.raises(InvalidArgumentError, match="work"):
        ac.build_step(pool, [(a, 2)], mode="decode")
    with pytest.raises(InvalidArgumentError, match="work"):
        ac.build_step(pool, [(a, 2), (b, 3)], mode="target_verify")
    with pytest.raises(InvalidArgumentError, match="custom_masks"):
        ac.build_step(pool, [(a, 2)], mode="target_verify", custom_masks=[torch.ones(2, 2, dtype=torch.bool)])
    with pytest.raises(InvalidArgumentError, match="mode"):
        ac.build_step(pool, [(a, 1)], mode="idle")
    with pytest.raises(InvalidArgumentError, match="counts"):
        ac.build_step(pool, [(a, 40)])  # past max_context_len
    with pytest.raises(InvalidArgumentError, match="num_tokens"):
        pool.fork(a, 6)
    with pytest.raises(InvalidArgumentError, match="kv_len"):
        pool.truncate(a, 6)
    assert state == (pool.allocator.available_size(), a.kv_len, list(a.slots), b.kv_len)
    pool.free(a)
    with pytest.raises(InvalidArgumentError, match="req"):
        pool.free(a)
    with pytest.raises(InvalidArgumentError, match="work"):
        ac.build_step(pool, [(a, 1)])
    pool.free(b)
    assert_empty(pool)


def test_truncate_refuses_to_reopen_a_shared_page():
    pool = make_pool(4, slots=64)
    a = pool.add()
    ac.build_step(pool, [(a, 8)])
    b = pool.fork(a, 8)
    with pytest.raises(InvalidArgumentError, match="kv_len"):
        pool.truncate(a, 6)  # a's next tokens would overwrite keys b reads
    pool.free(a)
    pool.free(b)
    assert_empty(pool)


def test_batches_run_on_a_backend_over_several_steps():
    """Prefill, a MIXED step and decodes on torch_native: each step's output against a float64
    reference over the request's whole history, with unused KV slots poisoned with NaN."""
    torch.manual_seed(0)
    H, HKV, D, P = 4, 2, 16, 4
    kv = ac.MHATokenToKVPool(size=128, page_size=P, dtype=torch.float32, head_num=HKV, head_dim=D, layer_num=1)
    kv.get_key_buffer(0).fill_(float("nan"))
    kv.get_value_buffer(0).fill_(float("nan"))
    rows = ac.ReqToTokenPool(4, 64)
    pool = ac.RequestPool(rows, ac.PagedTokenAllocator(128, P), kv)
    ctx = ac.BackendContext(
        device="cpu",
        dtype=torch.float32,
        num_q_heads=H,
        num_kv_heads=HKV,
        head_dim=D,
        page_size=P,
        req_to_token_pool=rows,
        token_to_kv_pool=kv,
        forward_modes={"extend", "decode", "mixed"},
    )
    backend = ac.create_backend("torch_native", ctx)
    layer = ac.AttentionLayer(0, H, HKV, D)
    a, b = pool.add(), pool.add()
    history = {a.rid: ([], []), b.rid: ([], [])}
    plans = [[(a, 7)], [(a, 1), (b, 5)], [(a, 1), (b, 1)], [(b, 1), (a, 1)]]
    modes = []
    for plan in plans:
        batch = ac.build_step(pool, plan, attn_backend=backend)
        modes.append(batch.forward_mode)
        T = batch.num_tokens
        q, k, v = torch.randn(T, H, D), torch.randn(T, HKV, D), torch.randn(T, HKV, D)
        backend.init_forward_metadata(batch)
        out = layer(q, k, v, batch).view(T, H, D)
        start = 0
        for r, n in plan:
            ks, vs = history[r.rid]
            ks.append(k[start : start + n])
            vs.append(v[start : start + n])
            K, V = torch.cat(ks).double(), torch.cat(vs).double()
            L = K.shape[0]
            for i in range(n):
                pos = L - n + i
                qi = q[start + i].double()  # [H, D]
                Kg, Vg = K[: pos + 1].repeat_interleave(H // HKV, 1), V[: pos + 1].repeat_interleave(H // HKV, 1)
                w = torch.softmax(torch.einsum("hd,khd->hk", qi, Kg) * D**-0.5, -1)
                torch.testing.assert_close(
                    out[start + i].double(), torch.einsum("hk,khd->hd", w, Vg), atol=1e-5, rtol=1e-5
                )
            start += n
    assert modes == [ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE, ForwardMode.DECODE]
    pool.free(a)
    pool.free(b)
    assert_empty(pool)
