"""Double sparsity against its float64 reference (`attn_sparse.testing.reference`) over several engine steps
of the same requests: chunked prefills (dense, labels written with the K/V), DECODE steps in which some
requests take the top-k path and others stay dense (below the threshold, or with at most heavy_token_num
keys), a request crossing the threshold mid-run, MIXED steps, requests leaving and joining; page sizes 1
and 16, float32 and float16, outputs and scratch poisoned, pools NaN-poisoned, splits on."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from sparse_engine import SparseEngine, ds_reference

from attn_sparse.config import SplitPolicy
from attn_sparse.double_sparsity.backend import DoubleSparsityBackend

SMALL_SPLITS = SplitPolicy(min_split_keys=8, max_splits=3, target_programs=64)
HKV, D, C = 2, 32, 6


def channels(num_layers: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack(
        [torch.stack([torch.randperm(D, generator=gen)[:C] for _ in range(HKV)]) for _ in range(num_layers)]
    )


#: (name, new tokens) steps: prefills in chunks, decodes, a MIXED step, a request leaving and one joining
SCHEDULE = [
    [("a", 30), ("b", 9)],
    [("a", 31), ("b", 20), ("c", 5)],
    [("a", 1), ("b", 1), ("c", 1)],
    [("a", 1), ("b", 1), ("c", 1)],
    [("a", 1), ("b", 1), ("d", 40)],
    "free c",
    [("b", 1), ("a", 1), ("d", 1)],
    [("d", 1), ("a", 1), ("b", 1)],
]


def run_schedule(engine: SparseEngine, reference, schedule=SCHEDULE) -> None:
    for work in schedule:
        if isinstance(work, str):
            engine.free(work.split()[1])
        else:
            engine.step(work, reference)


@pytest.mark.parametrize(
    "page_size, dtype, integer", [(1, torch.float32, False), (16, torch.float16, False), (16, torch.float32, True)]
)
def test_steps_top_k_below_the_length_threshold_on_both_sides(page_size, dtype, integer, poisoned_empty):
    """heavy_token_num 12, threshold 31: after the prefills a (61 keys) and d (40) go top-k, c (6) stays
    dense, b crosses the threshold (29 -> 30 -> 31 -> 32 keys) during the decode steps. Heavy channels of
    q and k random normal (the data has no near-tie at the cut: checked), or small integers (exact scores,
    many exact ties at the cut, broken by position)."""
    chans = channels(2, seed=1)
    margins: list = []
    make = partial(DoubleSparsityBackend, heavy_token_num=12, sparse_decode_threshold=31, split_policy=SMALL_SPLITS)
    engine = SparseEngine(
        make, page_size=page_size, dtype=dtype, heavy_channels=chans, seed=page_size, integer_heavy_channels=integer
    )
    run_schedule(engine, ds_reference(12, 31, chans, margins))
    assert engine.modes == ["EXTEND", "EXTEND", "DECODE", "DECODE", "MIXED", "DECODE", "DECODE"]
    sparse = torch.cat(margins)
    sparse = sparse[torch.isfinite(sparse)]
    assert sparse.numel() >= 4 * 5 * 2, "too few top-k heads: the case does not test the sparse path"
    if integer:
        assert int((sparse == 0).sum()) >= 8, "the integer data should put exact ties at the cut"
    else:
        assert float(sparse.min()) > 1e-4, "a near-tie at the k-th approximate score: rounding could pick another key"


def test_top_k_at_least_the_sequence_is_dense(poisoned_empty):
    """heavy_token_num 100 >= every request's length: every DECODE step attends densely although the
    threshold (8) is passed (and the dense reference agrees)."""
    chans = channels(2, seed=2)
    margins: list = []
    make = partial(DoubleSparsityBackend, heavy_token_num=100, sparse_decode_threshold=8, split_policy=SMALL_SPLITS)
    engine = SparseEngine(make, page_size=16, heavy_channels=chans, seed=3)
    run_schedule(engine, ds_reference(100, 8, chans, margins), SCHEDULE[:3])
    assert margins and all(not torch.isfinite(m).any() for m in margins)


def test_threshold_above_every_request_is_dense_over_a_plain_pool(poisoned_empty):
    """A context whose max_context_len is below the threshold can never go sparse: a plain MHA pool (no
    label cache) is accepted and every step is dense attention."""
    make = partial(DoubleSparsityBackend, heavy_token_num=4, sparse_decode_threshold=1000, split_policy=SMALL_SPLITS)
    engine = SparseEngine(make, page_size=1, seed=4)
    run_schedule(engine, ds_reference(4, 1000, torch.zeros(2, HKV, 1, dtype=torch.long), []), SCHEDULE[:3])


def test_gqa_group_of_three_and_one_split(poisoned_empty):
    """6 q heads over 2 KV heads (a group of 3, not a power of two), the default split policy."""
    chans = channels(1, seed=5)
    margins: list = []
    make = partial(DoubleSparsityBackend, heavy_token_num=9, sparse_decode_threshold=20)
    engine = SparseEngine(make, page_size=16, num_q_heads=6, num_layers=1, heavy_channels=chans, seed=6)
    schedule = [[("a", 33), ("b", 12)], [("a", 1), ("b", 1)], [("a", 1), ("b", 1)]]
    run_schedule(engine, ds_reference(9, 20, chans, margins), schedule)
    finite = torch.cat(margins)
    assert torch.isfinite(finite).sum() == 2 * 6 and float(finite[torch.isfinite(finite)].min()) > 1e-4


def test_decode_through_the_graph_runner(poisoned_empty):
    """DECODE steps through `CudaGraphRunner` (captured for 1, 2, 4 requests; on a CPU the runner replays
    eagerly on its static buffers): padded batches, a request crossing the threshold (b: 21 -> 22 keys),
    top-k and dense requests in one graph, against the reference."""
    chans = channels(2, seed=11)
    margins: list = []
    make = partial(DoubleSparsityBackend, heavy_token_num=10, sparse_decode_threshold=22, split_policy=SMALL_SPLITS)
    engine = SparseEngine(
        make, page_size=16, heavy_channels=chans, cuda_graph=1, max_context_len=96, seed=12, integer_heavy_channels=True
    )
    reference = ds_reference(10, 22, chans, margins)
    engine.step([("a", 30), ("b", 20), ("c", 5)], reference)
    runner = engine.graph_runner([1, 2, 4], variants=False)
    for work in ([("a", 1), ("b", 1), ("c", 1)], [("b", 1), ("a", 1)], [("c", 1), ("a", 1), ("b", 1)], [("c", 1)]):
        engine.step(work, reference, runner=runner)
    sparse = torch.cat(margins)
    assert torch.isfinite(sparse).sum() == 2 * 4 * (1 + 2 + 2), "a, then a and b, then a and b go top-k"
