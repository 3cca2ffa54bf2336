"""Double sparsity's engine inputs: the label cache written, allocated and reused with the K/V
(`DoubleSparseKVPool`), the calibration helper, and bad inputs refused with typed errors before any K/V
(or label) write."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from sparse_engine import SparseEngine, nan_equal

import attn_core as ac
from attn_core.contract.errors import InvalidArgumentError
from attn_sparse.double_sparsity.backend import DoubleSparsityBackend
from attn_sparse.double_sparsity.calibrate import select_heavy_channels
from attn_sparse.double_sparsity.pool import DoubleSparseKVPool


def test_pool_worked_example_and_layout():
    pool = DoubleSparseKVPool(
        16, 1, torch.float32, head_num=1, head_dim=8, layer_num=2, heavy_channels=[[[6, 1]], [[0, 7]]]
    )
    pool.set_kv_buffer(0, torch.tensor([5]), torch.arange(10.0, 18.0).view(1, 1, 8), torch.zeros(1, 1, 8))
    assert pool.get_label_buffer(0)[5, 0].tolist() == [16.0, 11.0]
    assert pool.get_label_buffer(0).shape == (pool.num_slots, 1, 2) and pool.heavy_channels.dtype == torch.int64
    assert not pool.get_label_buffer(1).any()  # another layer's labels untouched
    with pytest.raises(InvalidArgumentError, match="layer_id"):
        pool.get_label_buffer(2)


def test_labels_follow_the_kv_through_reuse_of_freed_slots():
    """A freed request's slots go to a new request; its labels are rewritten with its K/V (page size 4)."""
    chans = torch.tensor([[[3, 0]], [[1, 2]]])
    pool = DoubleSparseKVPool(32, 4, torch.float32, head_num=1, head_dim=4, layer_num=2, heavy_channels=chans)
    rows = ac.ReqToTokenPool(4, 32)
    requests = ac.RequestPool(rows, ac.PagedTokenAllocator(32, 4), pool)
    layer = [ac.AttentionLayer(i, 1, 1, 4) for i in range(2)]
    a = requests.add()
    batch = ac.build_step(requests, [(a, 6)])
    for lid in range(2):
        pool.set_kv_buffer(layer[lid], batch.out_cache_loc, torch.randn(6, 1, 4), torch.randn(6, 1, 4))
    slots_a = batch.out_cache_loc.clone()
    requests.free(a)
    b = requests.add()
    batch = ac.build_step(requests, [(b, 6)])
    assert set(batch.out_cache_loc.tolist()) & set(slots_a.tolist()), (
        "the allocator should hand the freed pages out again"
    )
    for lid in range(2):
        k = torch.randn(6, 1, 4)
        pool.set_kv_buffer(layer[lid], batch.out_cache_loc, k, torch.randn(6, 1, 4))
        assert torch.equal(pool.get_label_buffer(lid)[batch.out_cache_loc], k[:, :, chans[lid, 0]])


@pytest.mark.parametrize(
    "channels, match",
    [
        ([[[0, 8]]], r"\[0, 8\)"),  # an index past head_dim
        ([[[-1, 2]]], r"\[0, 8\)"),
        ([[[0.0, 2.0]]], "integer"),
        ([[[0, 1]], [[2, 3]]], "shape"),  # two layers for a one-layer pool
        (torch.zeros(1, 1, 0, dtype=torch.long), "shape"),  # no channel
        ("abc", "heavy_channels"),
    ],
)
def test_bad_heavy_channels_are_refused(channels, match):
    with pytest.raises(InvalidArgumentError, match=match):
        DoubleSparseKVPool(16, 1, torch.float32, head_num=1, head_dim=8, layer_num=1, heavy_channels=channels)


def test_fp8_label_cache_is_refused():
    with pytest.raises(InvalidArgumentError, match="dtype"):
        DoubleSparseKVPool(16, 1, torch.float8_e4m3fn, head_num=1, head_dim=8, layer_num=1, heavy_channels=[[[0]]])


def test_calibration_worked_example_and_modes():
    q = torch.tensor([[[1.0, 0.0, 2.0, 1.0]]])
    k = torch.tensor([[[3.0, 5.0, 1.0, 1.0]]])
    assert select_heavy_channels(q, k, 2).tolist() == [[0, 2]]
    assert select_heavy_channels(q, k, 2, mode="q").tolist() == [[2, 0]]  # |q| = [1, 0, 2, 1], ties: lower first
    assert select_heavy_channels(q, k, 3, mode="k").tolist() == [[1, 0, 2]]


def test_calibrated_channels_find_planted_outlier_channels():
    """GQA samples whose q and k are large on channels 5 and 9 of KV head 0 and on 2 and 14 of KV head 1."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(64, 4, 16, generator=gen), torch.randn(64, 2, 16, generator=gen)
    for g, chans in ((0, [5, 9]), (1, [2, 14])):
        q[:, 2 * g : 2 * g + 2, chans] *= 20
        k[:, g, chans] *= 20
    picked = select_heavy_channels(q, k, 2)
    assert picked.dtype == torch.int64 and picked.shape == (2, 2)
    assert sorted(picked[0].tolist()) == [5, 9] and sorted(picked[1].tolist()) == [2, 14]


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.ones(3, 4, 8), torch.ones(3, 3, 8), 2), "multiple"),
        ((torch.ones(3, 4, 8), torch.ones(2, 2, 8), 2), "q/k"),
        ((torch.ones(3, 4, 8), torch.ones(3, 2, 8), 9), "num_channels"),
        ((torch.ones(3, 4, 8), torch.ones(3, 2, 8), 0), "num_channels"),
    ],
)
def test_calibration_refuses_bad_samples(args, match):
    with pytest.raises(InvalidArgumentError, match=match):
        select_heavy_channels(*args)
    with pytest.raises(InvalidArgumentError, match="mode"):
        select_heavy_channels(torch.ones(3, 4, 8), torch.ones(3, 2, 8), 2, mode="v")


@pytest.mark.parametrize(
    "options, argument",
    [
        ({"heavy_token_num": 0}, "heavy_token_num"),
        ({"heavy_token_num": 2.5}, "heavy_token_num"),
        ({"sparse_decode_threshold": 0}, "sparse_decode_threshold"),
        ({"sparse_decode_threshold": True}, "sparse_decode_threshold"),
        ({"split_policy": "small"}, "split_policy"),
        ({"heavy": 3}, "options"),
    ],
)
def test_bad_options_are_refused(options, argument):
    with pytest.raises(InvalidArgumentError, match=argument):
        SparseEngine(partial(DoubleSparsityBackend, **options), page_size=1)


def test_a_context_that_may_go_sparse_needs_the_label_cache():
    """Refused at construction (a plain pool, max_context_len past the threshold), and per step for a batch
    whose pool has no labels: typed errors naming the pool, nothing written."""
    with pytest.raises(InvalidArgumentError, match="ctx.token_to_kv_pool"):
        SparseEngine(partial(DoubleSparsityBackend, heavy_token_num=4, sparse_decode_threshold=16), page_size=1)
    chans = torch.zeros(2, 2, 3, dtype=torch.long)
    engine = SparseEngine(
        partial(DoubleSparsityBackend, heavy_token_num=4, sparse_decode_threshold=16), page_size=1, heavy_channels=chans
    )
    plain = ac.MHATokenToKVPool(size=1024, page_size=1, dtype=torch.float32, head_num=2, head_dim=32, layer_num=2)
    engine.requests.token_to_kv_pool = plain  # an engine mixing up its pools
    batch = engine.build([("a", 20)])
    engine.backend.init_forward_metadata(batch)  # EXTEND: dense, no labels needed
    batch = engine.build([("a", 1)])
    before = [b.clone() for b in engine.buffers()]
    with pytest.raises(InvalidArgumentError, match="forward_batch.token_to_kv_pool"):
        engine.backend.init_forward_metadata(batch)
    assert all(nan_equal(a, b) for a, b in zip(engine.buffers(), before))
