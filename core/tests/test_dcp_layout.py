"""The DCP layout helpers and per-rank step building against plain loops."""

from __future__ import annotations

import random

import pytest
import torch

import attn_core as ac
from attn_core.dcp import DcpLayout, DcpRequestPool, build_dcp_step


def plain_layout(length: int, world: int, interleave: int) -> list[tuple[int, int]]:
    """(rank, local position) of each token 0..length-1, by dealing blocks round-robin."""
    out, counters = [], [0] * world
    for p in range(length):
        r = (p // interleave) % world
        out.append((r, counters[r]))
        counters[r] += 1
    return out


@pytest.mark.parametrize("world,interleave", [(1, 4), (2, 1), (2, 4), (3, 2), (3, 16), (4, 3)])
def test_layout_matches_plain_loop(world, interleave):
    layout = DcpLayout(world, interleave)
    n = 5 * world * interleave + 3  # ends mid-block
    pos = torch.arange(n)
    expected = plain_layout(n, world, interleave)
    assert layout.rank_of(pos).tolist() == [r for r, _ in expected]
    assert layout.local_position(pos).tolist() == [p for _, p in expected]
    lens = torch.randint(0, n + 1, (20,))
    for rank in range(world):
        want = [sum(1 for r, _ in plain_layout(int(L), world, interleave) if r == rank) for L in lens]
        assert layout.local_lens(lens, rank).tolist() == want
    assert sum(layout.local_lens(lens, r) for r in range(world)).tolist() == lens.tolist()
    for rank in range(world):  # global_position: each rank's local row, in order, is its positions
        mine = [p for p, (r, _) in enumerate(expected) if r == rank]
        assert layout.global_position(torch.arange(len(mine)), rank).tolist() == mine


def test_docstring_example():
    layout = DcpLayout(2, 4)
    assert layout.rank_of(torch.tensor([0, 3, 4, 7, 8, 10])).tolist() == [0, 0, 1, 1, 0, 0]
    assert layout.local_position(torch.tensor([0, 3, 4, 7, 8, 10])).tolist() == [0, 3, 0, 3, 4, 6]
    assert layout.local_lens(torch.tensor([0, 3, 4, 5, 11]), 1).tolist() == [0, 0, 0, 1, 4]
    assert layout.global_position(torch.tensor([0, 3, 4, 6]), 0).tolist() == [0, 3, 8, 10]
    assert layout.global_position(torch.tensor([0, 3, 4]), 1).tolist() == [4, 7, 12]


@pytest.mark.parametrize(
    "bad", [dict(world=0, interleave=4), dict(world=2, interleave=0), dict(world=2.0, interleave=4)]
)
def test_layout_rejects_bad_arguments(bad):
    with pytest.raises(ac.InvalidArgumentError):
        DcpLayout(**bad)
    with pytest.raises(ac.InvalidArgumentError):
        DcpLayout(2, 4).local_lens(torch.tensor([3]), 2)


def rank_pool(page_size: int, layout: DcpLayout, rank: int, slots: int = 256) -> DcpRequestPool:
    kv = ac.MHATokenToKVPool(
        size=slots, page_size=page_size, dtype=torch.float32, head_num=1, head_dim=4, layer_num=1, device="cpu"
    )
    rows = ac.ReqToTokenPool(size=8, max_context_len=128, device="cpu")
    return DcpRequestPool(ac.RequestPool(rows, ac.PagedTokenAllocator(slots, page_size), kv), layout, rank)


@pytest.mark.parametrize("world,page_size", [(2, 4), (3, 1), (3, 2)])
def test_steps_store_each_token_on_its_rank(world, page_size):
    """Several steps of the same requests on every rank: each token is stored by exactly one rank, at
    its local position in that rank's row; local
    DECODE batches cover the requests with local keys with local seq_lens."""
    layout = DcpLayout(world, page_size)
    pools = [rank_pool(page_size, layout, r) for r in range(world)]
    rng = random.Random(world * 10 + page_size)
    reqs = [[p.add() for p in pools] for _ in range(3)]
    stored: dict[tuple[int, int], list[int]] = {}  # (request, global pos) -> ranks that stored it
    schedule = (
        [[rng.randint(1, 9) for _ in reqs]]
        + [[1] * len(reqs)] * 3
        + [[rng.randint(1, 5) for _ in reqs]]
        + [[1] * len(reqs)]
    )
    for counts in schedule:
        for r, pool in enumerate(pools):
            step = build_dcp_step(pool, [(reqs[i][r], n) for i, n in enumerate(counts)])
            starts = [0] + torch.tensor(counts).cumsum(0).tolist()
            for row, slot in zip(step.save_rows.tolist(), step.save_loc.tolist()):
                i = next(i for i in range(len(counts)) if starts[i] <= row < starts[i + 1])
                gpos = int(step.positions[row])
                stored.setdefault((i, gpos), []).append(r)
                local = int(layout.local_position(torch.tensor(gpos)))
                assert int(pool.requests.req_to_token_pool.req_to_token[reqs[i][r].row, local]) == slot
            if step.forward_mode.is_decode():
                lens = layout.local_lens(step.seq_lens_cpu.long(), r)
                assert step.local_rows.tolist() == (lens > 0).nonzero().flatten().tolist()
                assert step.local_batch.seq_lens_cpu.tolist() == lens[lens > 0].tolist()
            else:
                assert step.local_batch is None
    total = {i: pools[0].kv_len(reqs[i][0]) for i in range(len(reqs))}
    assert sorted(stored) == sorted((i, p) for i in total for p in range(total[i]))
    for (_, p), ranks in stored.items():
        assert ranks == [int(layout.rank_of(torch.tensor(p)))]
    for r, pool in enumerate(pools):
        for i in range(len(reqs)):
            assert reqs[i][r].kv_len == int(layout.local_lens(torch.tensor(total[i]), r))
            pool.free(reqs[i][r])
        assert pool.requests.allocator.available_size() == pool.requests.allocator.size


def test_step_rejects_bad_work():
    pool = rank_pool(4, DcpLayout(2, 4), 0)
    req = pool.add()
    with pytest.raises(ac.InvalidArgumentError):
        build_dcp_step(pool, [(req, 0)])
    with pytest.raises(ac.InvalidArgumentError):
        build_dcp_step(pool, [(req, 1), (req, 1)])
    assert req.kv_len == 0 and pool.kv_len(req) == 0
