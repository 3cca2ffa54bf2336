"""Allocators: exhaustion, misuse errors, forks of a prefix ending mid-page, partial frees, and a property
test over random alloc/free/fork sequences."""

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from attn_core.contract.errors import InvalidArgumentError, KVCacheError
from attn_core.memory import KVSlotError, PagedTokenAllocator, PageTailError, TokenAllocator


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


def test_forks_of_a_prefix_ending_mid_page_never_share_slots():
    """The issue's repro: two forks of a prefix whose last token sits mid-page at slot 18."""
    a = PagedTokenAllocator(64, 16)
    prefix = a.alloc_extend([0], [3], [0])  # tokens 0..2 in slots 16, 17, 18
    assert prefix.tolist() == [16, 17, 18] and a.is_page_tail(18)
    first = a.alloc_extend([3], [5], [18])
    assert first.tolist() == [19, 20] and not a.is_page_tail(18)
    before = a.available_size()
    with pytest.raises(PageTailError, match=r"^last_loc\[0\]") as err:
        a.alloc_extend([3], [5], [18])
    assert isinstance(err.value, KVCacheError) and isinstance(err.value, InvalidArgumentError)
    assert a.available_size() == before
    src, dst = a.fork_partial_page(3, 18)  # copy-on-write: a fresh page, the prefix's tokens 0..2 to copy
    assert src.tolist() == [16, 17, 18] and dst.tolist() == [32, 33, 34]
    second = a.alloc_extend([3], [5], [int(dst[-1])])
    assert second.tolist() == [35, 36]
    # freeing the first fork's extension makes slot 18 the tail again: the prefix's owner can continue
    a.free(first)
    assert a.is_page_tail(18) and a.alloc_decode([4], [18]).tolist() == [19]


def test_two_requests_of_one_call_cannot_continue_the_same_page():
    a = PagedTokenAllocator(64, 16)
    a.alloc_extend([0], [3], [0])
    before = a.available_size()
    with pytest.raises(PageTailError, match=r"^last_loc\[1\]"):
        a.alloc_extend([3, 3], [4, 40], [18, 18])  # the second also takes fresh pages: none may be taken
    assert a.available_size() == before and a.is_page_tail(18) and not a.is_allocated(19)
    assert a.alloc_extend([3, 3], [3, 4], [18, 18]).tolist() == [19]  # adding no token continues nothing


def test_partial_free_keeps_the_other_slots_of_the_page():
    a = PagedTokenAllocator(64, 16)
    s = a.alloc_extend([0], [10], [0])  # slots 16..25 of page 1
    free_before = a.available_size()
    a.free(s[2:5])
    assert [a.is_allocated(int(x)) for x in s] == [True, True, False, False, False] + [True] * 5
    assert a.available_size() == free_before  # the page is still in use
    with pytest.raises(KVSlotError, match="^free_index.*double free"):
        a.free(s[3:4])
    with pytest.raises(KVSlotError, match="^free_index.*double free"):
        a.free(torch.tensor([int(s[0]), int(s[0])]))
    assert a.is_allocated(int(s[0]))  # the refused free changed nothing
    a.free(torch.cat([s[:2], s[5:]]))
    assert a.available_size() == free_before + 16  # the last owned slot returned the page


def test_freeing_rejected_draft_slots_lets_the_request_continue_its_page():
    a = PagedTokenAllocator(64, 16)
    a.alloc_extend([0], [5], [0])  # slots 16..20
    drafts = a.alloc_extend([5], [9], [20])  # 21..24
    a.free(drafts[1:])  # one draft token accepted (slot 21)
    assert a.is_page_tail(21) and not a.is_allocated(22)
    assert a.alloc_decode([7], [21]).tolist() == [22]


def test_fork_partial_page_errors_and_exhaustion():
    a = PagedTokenAllocator(32, 16)  # pages 1 and 2
    a.alloc_extend([0], [3], [0])
    with pytest.raises(InvalidArgumentError, match="^prefix_len"):
        a.fork_partial_page(16, 31)
    with pytest.raises(KVSlotError, match="^last_loc"):
        a.fork_partial_page(3, 17)  # token 2 is at offset 2
    with pytest.raises(KVSlotError, match="^last_loc"):
        a.fork_partial_page(5, 20)  # not allocated
    assert a.fork_partial_page(3, 18) is not None
    assert a.available_size() == 0 and a.fork_partial_page(3, 18) is None


@st.composite
def _ops(draw):
    page_size = draw(st.sampled_from([1, 4, 16, 128]))
    pages = draw(st.integers(2, 12))
    kinds = ["new", "extend", "decode", "free", "fork", "truncate"]
    ops = draw(
        st.lists(
            st.tuples(st.sampled_from(kinds), st.integers(0, 10**6), st.integers(1, 3 * page_size)),
            min_size=8,
            max_size=40,
        )
    )
    return page_size, pages, ops


class _Request:
    """A request as an engine sees it: its `req_to_token` row (`tokens`) and the slots it must free
    (`own`); a fork's row starts with its parent's slots, owned by the parent (a prefix cache's lock)."""

    def __init__(self, tokens=(), own=()):
        self.tokens = list(tokens)
        self.own = set(own)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_ops())
def test_random_alloc_free_fork_invariants(spec):
    """Random new/extend/decode/free, forks of a shared prefix at any length, and partial frees of a
    request's last tokens: no slot handed out twice, token i at page offset i % page_size, a page
    continued in place only from its tail (else a typed PageTailError and a copy-on-write fork),
    pages in use + free pages == capacity."""
    page_size, pages, ops = spec
    ps = page_size
    a = PagedTokenAllocator(pages * ps, ps)
    capacity = a.available_size()
    reqs: dict[int, _Request] = {}
    next_id = 0

    def borrowed_elsewhere(rid: int) -> set[int]:
        return {s for r, q in reqs.items() if r != rid for s in q.tokens}

    def take(rid: int, got) -> None:
        new = got.tolist()
        owned = {s for q in reqs.values() for s in q.own}
        assert not set(new) & owned, "a slot was handed out twice"
        reqs[rid].tokens.extend(new)
        reqs[rid].own.update(new)

    for kind, pick, n in ops:
        ids = sorted(reqs)
        rid = ids[pick % len(ids)] if ids else None
        if kind == "new":
            got = a.alloc_extend([0], [n], [0])
            if got is not None:
                reqs[next_id] = _Request()
                take(next_id, got)
                next_id += 1
        elif kind == "fork" and ids and reqs[rid].tokens:
            k = 1 + pick % len(reqs[rid].tokens)
            reqs[next_id] = _Request(reqs[rid].tokens[:k])
            next_id += 1
        elif kind in ("extend", "decode") and ids:
            q = reqs[rid]
            cur, last = len(q.tokens), q.tokens[-1] if q.tokens else 0
            grow = 1 if kind == "decode" else n
            page_of_last = [s for r in reqs.values() for s in r.own if s // ps == last // ps]
            in_place = cur % ps == 0 or max(page_of_last, default=last) == last
            try:
                got = a.alloc_extend([cur], [cur + grow], [last])
            except PageTailError:
                assert not in_place, "refused to continue a page from its tail"
                assert not a.is_page_tail(last)
                event("a fork copied its partial page")
                forked = a.fork_partial_page(cur, last)
                if forked is None:
                    continue
                src, dst = forked
                r = cur % ps
                assert src.tolist() == q.tokens[cur - r :]
                q.tokens[cur - r :] = dst.tolist()
                q.own.update(dst.tolist())
                got = a.alloc_extend([cur], [cur + grow], [int(dst[-1])])
            else:
                assert in_place, "continued a page another request had extended past"
            if got is not None:
                take(rid, got)
        elif kind == "truncate" and ids:
            q, shared = reqs[rid], borrowed_elsewhere(rid)
            drop = []  # the last few tokens (rejected drafts): often part of a page
            while q.tokens and len(drop) < 1 + n % ps and q.tokens[-1] in q.own and q.tokens[-1] not in shared:
                drop.append(q.tokens.pop())
            a.free(torch.tensor(drop, dtype=torch.int64))
            q.own -= set(drop)
            if drop and any(s // ps == drop[-1] // ps for s in q.own):
                event("a partial free of a page")
            assert not any(a.is_allocated(s) for s in drop)
        elif kind == "free" and ids and not reqs[rid].own & borrowed_elsewhere(rid):
            q = reqs.pop(rid)
            a.free(torch.tensor(sorted(q.own), dtype=torch.int64))
            assert not any(a.is_allocated(s) for s in q.own)
        owners = [s for q in reqs.values() for s in q.own]
        assert len(owners) == len(set(owners)), "a slot is owned twice"
        assert all(s >= ps for s in owners), "the reserved page was handed out"
        for q in reqs.values():
            for i, s in enumerate(q.tokens):
                assert s % ps == i % ps, "token not at its page offset"
                assert a.is_allocated(s), "a request reads a freed slot"
        used_pages = {s // ps for s in owners}
        assert a.available_size() + len(used_pages) * ps == capacity, "a page leaked or was freed while in use"
