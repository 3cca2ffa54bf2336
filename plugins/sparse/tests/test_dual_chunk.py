"""Dual chunk attention against its float64 reference (`attn_sparse.testing.reference`: one softmax over all
keys, each scored with its part's query variant) over several engine steps of the same requests: prefills
in chunks that cross chunk boundaries, requests spanning several chunks, DECODE and MIXED steps, requests
leaving and joining; page sizes 1 and 16, float32 and float16, outputs and scratch poisoned, pools
NaN-poisoned, splits on. Also: the engine-side position rule, and bad inputs refused before any KV write."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from sparse_engine import SparseEngine, dc_reference, nan_equal, variants

from attn_core.contract.errors import InvalidArgumentError
from attn_sparse.config import SplitPolicy
from attn_sparse.dual_chunk.backend import DualChunkBackend
from attn_sparse.dual_chunk.positions import chunk_length, dual_chunk_positions
from attn_sparse.testing.reference import dual_chunk_part

SMALL_SPLITS = SplitPolicy(min_split_keys=8, max_splits=3, target_programs=64)


#: chunk_len 8 (chunk_size 11, local_size 3): prefill chunks of 13 and 17 tokens cross chunk boundaries, a
#: request reaches 6 chunks, decodes cross boundaries (a at 43 -> 44 -> 45 ... over the chunk start 48 later)
SCHEDULE = [
    [("a", 13), ("b", 5)],
    [("a", 17), ("b", 1), ("c", 9)],
    [("a", 13), ("c", 1), ("b", 1)],
    [("a", 1), ("b", 1), ("c", 1)],
    [("c", 1), ("a", 1), ("b", 1)],
    "free b",
    [("a", 1), ("d", 22), ("c", 1)],
    [("d", 1), ("a", 1), ("c", 1)],
    [("a", 1), ("c", 1), ("d", 1)],
]


@pytest.mark.parametrize("page_size, dtype", [(1, torch.float32), (16, torch.float16)])
def test_steps_over_several_chunks(page_size, dtype, poisoned_empty):
    make = partial(DualChunkBackend, chunk_size=11, local_size=3, split_policy=SMALL_SPLITS)
    engine = SparseEngine(make, page_size=page_size, dtype=dtype, seed=10 + page_size)
    for work in SCHEDULE:
        if isinstance(work, str):
            engine.free(work.split()[1])
        else:
            engine.step(work, dc_reference(8), variants=True, extras=variants)
    assert engine.modes == ["EXTEND", "MIXED", "MIXED", "DECODE", "DECODE", "MIXED", "DECODE", "DECODE"]
    assert len(engine.history[("a", 0)][0]) == 48  # six chunks of 8


def test_group_of_three_default_splits_and_long_chunks(poisoned_empty):
    """6 q heads over 2 KV heads, the default split policy, chunk_len 16 (local_size 0): one request in its
    third chunk, one still in its first (that step needs q_inter for the first only)."""
    make = partial(DualChunkBackend, chunk_size=16)
    engine = SparseEngine(make, page_size=16, num_q_heads=6, num_layers=1, seed=7)
    schedule = [[("a", 40), ("b", 3)], [("a", 1), ("b", 1)], [("b", 1), ("a", 1)]]
    for work in schedule:
        engine.step(work, dc_reference(16), variants=True, extras=variants)


def test_short_steps_need_no_variants(poisoned_empty):
    """A step whose queries all sit in their first chunk attends within the chunk: q alone; the variants
    given anyway are checked and unused."""
    make = partial(DualChunkBackend, chunk_size=64, local_size=4)
    engine = SparseEngine(make, page_size=1, seed=8)
    engine.step([("a", 20), ("b", 7)], dc_reference(60))
    engine.step([("a", 1), ("b", 1)], dc_reference(60), variants=True, extras=variants)


def test_missing_variant_is_refused_before_any_kv_write():
    make = partial(DualChunkBackend, chunk_size=8, local_size=2)
    engine = SparseEngine(make, page_size=1, seed=9)
    engine.step([("a", 10)], dc_reference(6), variants=True, extras=variants)  # reaches the second chunk
    batch = engine.build([("a", 4)])  # positions 10..13: the previous chunk (q_succ) and the one before (q_inter)
    engine.backend.init_forward_metadata(batch)
    x = engine.random_inputs(4, variants=True)[0]
    layer = engine.layers[0]
    before = [b.clone() for b in engine.buffers()]
    for extras, name in (({}, "q_succ"), ({"q_succ": x["q_succ"]}, "q_inter")):
        with pytest.raises(InvalidArgumentError, match=name):
            layer(x["q"], x["k"], x["v"], batch, **extras)
    bad = [
        ({"q_succ": x["q_succ"][:3], "q_inter": x["q_inter"]}, "q_succ"),  # wrong token count
        ({"q_succ": x["q_succ"], "q_inter": x["q_inter"].double()}, "q_inter"),  # wrong dtype
        ({"q_succ": x["q_succ"], "q_inter": x["q_inter"][:, :2]}, "q_inter"),  # wrong head count
        ({"q_succ": x["q_succ"], "q_inter": x["q_inter"], "q_other": x["q"]}, "extras"),  # unknown extra
    ]
    for extras, name in bad:
        with pytest.raises(InvalidArgumentError, match=name):
            layer(x["q"], x["k"], x["v"], batch, **extras)
    assert all(nan_equal(a, b) for a, b in zip(engine.buffers(), before)), "a refused call wrote to the pool"


@pytest.mark.parametrize(
    "options, argument",
    [
        ({}, "chunk_size"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": 8, "local_size": 8}, "local_size"),
        ({"chunk_size": 8, "local_size": -1}, "local_size"),
        ({"chunk_size": 8.0}, "chunk_size"),
        ({"chunk_size": 8, "split_policy": 3}, "split_policy"),
    ],
)
def test_bad_options_are_refused(options, argument):
    with pytest.raises(InvalidArgumentError, match=argument):
        SparseEngine(partial(DualChunkBackend, **options), page_size=1)


def test_positions_worked_example():
    pos = dual_chunk_positions(torch.tensor([0, 7, 8, 21]), chunk_size=10, local_size=2)
    assert pos.key.tolist() == pos.query.tolist() == [0, 7, 0, 5]
    assert pos.query_succ.tolist() == [8, 10, 8, 10]
    assert pos.query_inter.tolist() == [10, 10, 10, 10]
    assert chunk_length(8192, 1024) == 7168


def rope(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Neox-style rotary embedding of x `[n, H, D]` at integer positions `pos` `[n]`, in float64."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x.double()[..., : d // 2], x.double()[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def test_position_rule_keeps_true_distances_inside_a_chunk_and_the_local_window():
    """With the rotations at `dual_chunk_positions`, the score of a query and a key depends on the distance
    the rule gives: the true one inside a chunk and for the previous chunk's keys seen from the first
    local_size + 1 positions of a chunk; a clamped one otherwise (here checked against scores at the true
    positions, and at the clamped distance)."""
    chunk_size, local_size = 12, 4
    L = chunk_length(chunk_size, local_size)  # 8
    gen = torch.Generator().manual_seed(0)
    n = 40
    raw_q, raw_k = torch.randn(n, 1, 16, generator=gen), torch.randn(n, 1, 16, generator=gen)
    positions = torch.arange(n)
    p = dual_chunk_positions(positions, chunk_size, local_size)
    q_var = [rope(raw_q, p.query), rope(raw_q, p.query_succ), rope(raw_q, p.query_inter)]
    k = rope(raw_k, p.key)[:, 0]
    part = dual_chunk_part(positions, positions, L)
    for i in range(n):
        for j in range(i + 1):
            got = float(q_var[int(part[i, j])][i, 0] @ k[j])
            true = float(
                rope(raw_q[i : i + 1], torch.tensor([i]))[0, 0] @ rope(raw_k[j : j + 1], torch.tensor([j]))[0, 0]
            )
            qi, kj = i % L, j % L
            if part[i, j] == 0 or (part[i, j] == 1 and qi <= local_size):
                assert abs(got - true) < 1e-9, (i, j)
            else:
                d_rule = (min(qi + L, chunk_size) if part[i, j] == 1 else min(2 * L - 1, chunk_size)) - kj
                at_rule = float(rope(raw_q[i : i + 1], torch.tensor([d_rule]))[0, 0] @ raw_k[j, 0].double())
                assert abs(got - at_rule) < 1e-9, (i, j)


def test_decode_through_the_graph_runner(poisoned_empty):
    """DECODE steps through `CudaGraphRunner` (captured for 1, 2, 4 requests; on a CPU the runner replays
    eagerly on its static buffers), requests in their first, second and fourth chunks, against the
    reference."""
    make = partial(DualChunkBackend, chunk_size=10, local_size=2, split_policy=SMALL_SPLITS)
    engine = SparseEngine(make, page_size=1, cuda_graph=1, max_context_len=64, seed=13)
    reference = dc_reference(8)
    engine.step([("a", 29), ("b", 10), ("c", 3)], reference, variants=True, extras=variants)
    runner = engine.graph_runner([1, 2, 4], variants=True)
    for work in ([("a", 1), ("b", 1), ("c", 1)], [("b", 1), ("a", 1)], [("c", 1), ("a", 1), ("b", 1)], [("c", 1)]):
        engine.step(work, reference, variants=True, runner=runner)
