"""Allocators: exhaustion, misuse errors, and a property test over random alloc/free sequences."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attn_core.errors import InvalidArgumentError, KVCacheError
from attn_core.memory import PagedTokenAllocator, TokenAllocator


def test_token_allocator_basic_and_exhaustion():
    a = TokenAllocator(8)
    s = a.alloc(5)
    assert sorted(s.tolist()) == [1, 2, 3, 4, 5]  # slot 0 is never handed out
    assert a.available_size() == 3
    assert a.alloc(4) is None  # exhaustion: clear failure ...
    assert a.available_size() == 3  # ... and nothing changed
    a.free(s)
    assert a.available_size() == 8


@pytest.mark.parametrize("page_size", [1, 16, 32, 64, 128])
def test_paged_alloc_extend_keeps_pages_per_request(page_size):
    a = PagedTokenAllocator(page_size * 12, page_size)
    first = a.alloc_extend([0, 0], [page_size + 3, 2], [0, 0])
    assert first.numel() == page_size + 5
    r0, r1 = first[: page_size + 3], first[page_size + 3 :]
    # token i of a request sits at offset i % page_size of its page
    assert ((r0 % page_size) == torch.arange(page_size + 3) % page_size).all()
    assert ((r1 % page_size) == torch.arange(2) % page_size).all()
    assert not set((r0 // page_size).tolist()) & set((r1 // page_size).tolist())
    more = a.alloc_extend([page_size + 3, 2], [page_size + 5, 3], [int(r0[-1]), int(r1[-1])])
    if page_size > 1:  # the partly filled last page is finished first
        assert more[:2].tolist() == [int(r0[-1]) + 1, int(r0[-1]) + 2]
    dec = a.alloc_decode([page_size + 6, 4], [int(more[1]), int(more[2])])
    assert dec.numel() == 2


def test_paged_exhaustion_leaves_state_unchanged():
    a = PagedTokenAllocator(64, 16)
    held = a.alloc_extend([0], [40], [0])  # 3 pages
    assert a.available_size() == 16
    assert a.alloc_extend([0, 0], [10, 10], [0, 0]) is None  # needs 2 pages, 1 free
    assert a.available_size() == 16
    a.free(held)
    assert a.available_size() == 64


def test_misuse_raises():
    a = PagedTokenAllocator(64, 16)
    s = a.alloc(16)
    a.free(s)
    with pytest.raises(KVCacheError, match="double free"):
        a.free(s)
    with pytest.raises(KVCacheError, match="reserved page 0"):
        a.free(torch.tensor([0]))
    with pytest.raises(KVCacheError, match="out of range"):
        a.free(torch.tensor([64 + 16]))
    with pytest.raises(KVCacheError, match="out of range"):
        a.free(torch.tensor([-1]))
    with pytest.raises(InvalidArgumentError, match="need_size"):
        a.alloc(5)
    with pytest.raises(InvalidArgumentError, match="page_size"):
        PagedTokenAllocator(64, 12)
    with pytest.raises(InvalidArgumentError, match="last_loc"):
        a.alloc_extend([3], [5], [17])  # token 2 cannot be at offset 1


def test_failed_free_changes_nothing():
    a = PagedTokenAllocator(64, 16)
    s = a.alloc(32)
    with pytest.raises(KVCacheError):
        a.free(torch.cat([s[:16], torch.tensor([0])]))
    assert a.available_size() == 32  # the valid page was not freed either
    a.free(s)


@st.composite
def _ops(draw):
    page_size = draw(st.sampled_from([1, 16, 32, 64, 128]))
    pages = draw(st.integers(2, 12))
    ops = draw(
        st.lists(
            st.tuples(st.sampled_from(["new", "extend", "decode", "free"]), st.integers(0, 10**6), st.integers(1, 3 * page_size)),
            max_size=40,
        )
    )
    return page_size, pages, ops


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_ops())
def test_random_alloc_free_invariants(spec):
    """No slot owned twice, free + used == capacity, pages never shared across requests."""
    page_size, pages, ops = spec
    a = PagedTokenAllocator(pages * page_size, page_size)
    capacity = a.available_size()
    owned: dict[int, list[int]] = {}  # request -> slots in token order
    next_id = 0
    for kind, pick, n in ops:
        ids = sorted(owned)
        if kind == "new":
            got = a.alloc_extend([0], [n], [0])
            if got is not None:
                owned[next_id] = got.tolist()
                next_id += 1
        elif kind in ("extend", "decode") and ids:
            rid = ids[pick % len(ids)]
            cur = owned[rid]
            last = cur[-1] if cur else 0
            got = a.alloc_decode([len(cur) + 1], [last]) if kind == "decode" else a.alloc_extend([len(cur)], [len(cur) + n], [last])
            if got is not None:
                cur.extend(got.tolist())
        elif kind == "free" and ids:
            rid = ids[pick % len(ids)]
            a.free(torch.tensor(owned.pop(rid)))
        all_slots = [s for slots in owned.values() for s in slots]
        assert len(all_slots) == len(set(all_slots)), "a slot is owned twice"
        assert all(s >= page_size for s in all_slots), "the reserved page was handed out"
        used_pages = {s // page_size for s in all_slots}
        assert a.available_size() + len(used_pages) * page_size == capacity
        page_owner: dict[int, int] = {}
        for rid, slots in owned.items():
            for i, s in enumerate(slots):
                assert s % page_size == i % page_size, "token not at its page offset"
                assert page_owner.setdefault(s // page_size, rid) == rid, "page shared across requests"
