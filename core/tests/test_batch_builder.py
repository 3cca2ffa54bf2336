"""The batch builder produces internally consistent batches for every mode."""

import random

import pytest
import torch

from attn_core.contract.errors import InvalidArgumentError, KVCacheError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.memory import PagedTokenAllocator, ReqToTokenPool
from attn_core.testing.batch_builder import RequestShape, build_forward_batch, random_tree_mask, release_forward_batch


def _pools(page_size=1, slots=2048, reqs=16, ctx=256):
    return ReqToTokenPool(reqs, ctx), PagedTokenAllocator(slots, page_size)


def _random_requests(rng, mode, n):
    if mode is ForwardMode.DECODE:
        return [RequestShape(rng.randint(0, 40), 1, rng.choice([0, 0, 3])) for _ in range(n)]
    if mode is ForwardMode.TARGET_VERIFY:
        d = rng.randint(1, 5)
        return [RequestShape(rng.randint(0, 40), d) for _ in range(n)]
    return [RequestShape(rng.randint(0, 40), rng.randint(0, 9), rng.choice([0, 0, 5])) for _ in range(n)]


MODES = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", range(3))
def test_batch_is_consistent(mode, page_size, seed):
    rng = random.Random(seed)
    req_pool, alloc = _pools(page_size)
    reqs = _random_requests(rng, mode, rng.randint(1, 6))
    if mode is ForwardMode.EXTEND and all(r.extend_len == 0 for r in reqs):
        reqs[0] = RequestShape(reqs[0].prefix_len, 2)
    b = build_forward_batch(mode, reqs, req_to_token_pool=req_pool, allocator=alloc)
    assert b.forward_mode is mode and b.batch_size == len(reqs)
    assert b.seq_lens.tolist() == [r.prefix_len + r.extend_len for r in reqs] == b.seq_lens_cpu.tolist()
    assert b.seq_lens_sum == sum(b.seq_lens_cpu.tolist())
    assert b.num_tokens == sum(r.extend_len for r in reqs) == b.out_cache_loc.numel() == b.positions.numel()
    assert (
        b.req_pool_indices.dtype == torch.int64
        and b.out_cache_loc.dtype == torch.int64
        and b.seq_lens.dtype == torch.int32
    )
    # out_cache_loc is the new tokens' slots, request after request; positions count from the prefix
    want_loc, want_pos, all_slots = [], [], []
    for row, r in zip(b.req_pool_indices.tolist(), reqs):
        row_slots = req_pool.req_to_token[row, : r.encoder_len + r.prefix_len + r.extend_len].tolist()
        all_slots += row_slots
        start = r.encoder_len + r.prefix_len
        want_loc += row_slots[start:]
        want_pos += list(range(r.prefix_len, r.prefix_len + r.extend_len))
        assert all(s % page_size == i % page_size for i, s in enumerate(row_slots))
    assert b.out_cache_loc.tolist() == want_loc
    assert b.positions.tolist() == want_pos
    assert len(all_slots) == len(set(all_slots)) and min(all_slots, default=page_size) >= page_size
    if mode.is_extend():
        assert b.extend_seq_lens_cpu.tolist() == [r.extend_len for r in reqs]
        assert b.extend_prefix_lens.tolist() == [r.prefix_len for r in reqs]
        starts = [sum(r.extend_len for r in reqs[:i]) for i in range(len(reqs))]
        assert b.extend_start_loc.tolist() == starts and b.extend_num_tokens == b.num_tokens
    else:
        assert b.extend_seq_lens is None
    if any(r.encoder_len for r in reqs):
        assert b.encoder_lens_cpu.tolist() == [r.encoder_len for r in reqs]
        new_enc = [
            s
            for row, r in zip(b.req_pool_indices.tolist(), reqs)
            if r.prefix_len == 0
            for s in req_pool.req_to_token[row, : r.encoder_len].tolist()
        ]
        assert b.encoder_out_cache_loc.tolist() == new_enc
    if mode is ForwardMode.TARGET_VERIFY:
        spec = b.spec_info
        d = reqs[0].extend_len
        assert spec.num_draft_tokens == d
        sizes = [d * (r.prefix_len + d) for r in reqs]
        assert spec.mask_indptr.tolist() == [sum(sizes[:i]) for i in range(len(reqs) + 1)]
        assert spec.custom_mask.dtype == torch.bool and spec.custom_mask.numel() == sum(sizes)
    free_before = alloc.available_size()
    release_forward_batch(b, alloc)
    assert alloc.available_size() == alloc.size and req_pool.available_size() == req_pool.size
    assert free_before < alloc.size or not all_slots


def test_random_tree_mask_is_a_tree():
    g = torch.Generator().manual_seed(3)
    m = random_tree_mask(4, 6, g)
    assert m[:, :4].all()
    draft = m[:, 4:]
    assert draft.diagonal().all() and not draft.triu(1).any()  # sees itself, never a later token
    for i in range(6):  # the ancestors of i are closed under "ancestor of"
        for j in range(i):
            if draft[i, j]:
                assert (draft[j] <= draft[i]).all()


def test_mode_rules_and_exhaustion():
    req_pool, alloc = _pools(16, slots=64, reqs=2)
    with pytest.raises(InvalidArgumentError, match="DECODE"):
        build_forward_batch("decode", [(3, 2)], req_to_token_pool=req_pool, allocator=alloc)
    with pytest.raises(InvalidArgumentError, match="TARGET_VERIFY"):
        build_forward_batch("target_verify", [(3, 2), (1, 3)], req_to_token_pool=req_pool, allocator=alloc)
    with pytest.raises(InvalidArgumentError, match="IDLE"):
        build_forward_batch("idle", [(3, 1)], req_to_token_pool=req_pool, allocator=alloc)
    with pytest.raises(InvalidArgumentError, match="max_context_len"):
        build_forward_batch("extend", [(250, 10)], req_to_token_pool=req_pool, allocator=alloc)
    with pytest.raises(KVCacheError, match="out of KV slots"):
        build_forward_batch("extend", [(40, 10), (10, 10)], req_to_token_pool=req_pool, allocator=alloc)
    assert alloc.available_size() == 64 and req_pool.available_size() == 2  # nothing leaked
    with pytest.raises(KVCacheError, match="request rows"):
        build_forward_batch("decode", [(1, 1)] * 3, req_to_token_pool=req_pool, allocator=alloc)
    idle = build_forward_batch("idle", [], req_to_token_pool=req_pool, allocator=alloc)
    assert idle.batch_size == 0 and idle.num_tokens == 0
    with pytest.raises(InvalidArgumentError, match="custom_masks"):
        build_forward_batch(
            "target_verify",
            [(3, 2)],
            req_to_token_pool=req_pool,
            allocator=alloc,
            custom_masks=[torch.ones(2, 4, dtype=torch.bool)],
        )
    assert alloc.available_size() == 64 and req_pool.available_size() == 2


@pytest.mark.parametrize("pool_page, pool_size, match", [(1, 64, "page_size"), (16, 32, "exceeds KV pool size")])
def test_allocator_must_fit_the_kv_pool(pool_page, pool_size, match):
    from attn_core.memory import MHATokenToKVPool

    req_pool, alloc = _pools(16, slots=64, reqs=2)
    pool = MHATokenToKVPool(pool_size, pool_page, torch.float32, head_num=1, head_dim=8, layer_num=1)
    with pytest.raises(KVCacheError, match=match):
        build_forward_batch("extend", [(3, 2)], req_to_token_pool=req_pool, allocator=alloc, token_to_kv_pool=pool)
    assert alloc.available_size() == 64 and req_pool.available_size() == 2  # refused before allocating
    fitting = MHATokenToKVPool(64, 16, torch.float32, head_num=1, head_dim=8, layer_num=1)
    batch = build_forward_batch(
        "extend", [(3, 2)], req_to_token_pool=req_pool, allocator=alloc, token_to_kv_pool=fitting
    )
    assert batch.token_to_kv_pool is fitting
