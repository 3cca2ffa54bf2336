"""attn-core's helpers for plugin backends: growable device scratch (`memory.scratch`), CUDA-graph
bookkeeping (`graph_captures`), the shared query count (`batch_utils.shared_query_len`), page arithmetic
and block tables (`ops.kv_indices`), each against its docstring's worked example and a plain loop."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from attn_core.batching.batch_utils import shared_query_len, uniform_query_len
from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.engine.graph_captures import GraphCaptures, captures_of
from attn_core.memory.scratch import DeviceScratch
from attn_core.ops.device_faults import DeviceFaultFlags, DeviceFaultKind
from attn_core.ops.kv_indices import (
    host_last_page_lens,
    host_page_offsets,
    last_page_len_from_lens,
    page_indptr_from_lens,
    page_table_from_req_to_token,
    pages_for,
)


# ---- DeviceScratch -------------------------------------------------------------------------------
def test_device_scratch_grows_by_doubling_and_reuses():
    s = DeviceScratch(torch.device("cpu"))
    a = s.get("seq", 10)
    assert a.shape[0] == 1024 and a.dtype == torch.int32
    assert s.get("seq", 1024) is a
    b = s.get("seq", 5000)
    assert b.shape[0] == 10000 and s.get("seq", 7) is b
    assert s.get("qo", 3) is not b
    f = s.get("seq", 3, torch.float32)  # another dtype under the same name: a new buffer
    assert f.dtype == torch.float32 and f is not b


def test_device_scratch_carves_views_once_per_key_until_the_buffer_grows():
    s = DeviceScratch(torch.device("cpu"), min_entries=16)
    made = []

    def views(bs):
        def make(buf):
            made.append(bs)
            return buf[: bs + 1], buf[bs + 1 :]

        return make

    a = s.carve("kv", 3 + 10, 2, views(2))
    assert a[0].shape == (3,) and a[1].shape == (23,) and made == [2]  # a 26-entry buffer (twice the 13 asked)
    assert s.carve("kv", 3 + 12, 2, views(2)) is a and made == [2]  # fits: the same views, nothing made
    c = s.carve("kv", 4, 3, views(3))
    assert c[0].data_ptr() == a[0].data_ptr() and made == [2, 3]
    a[1].fill_(5)
    big = s.carve("kv", 100, 2, views(2))  # grows: new views of a new buffer
    assert big is not a and big[0].data_ptr() != a[0].data_ptr() and made == [2, 3, 2]
    big[1].fill_(-1)
    assert bool((a[1] == 5).all())  # views handed out before the growth keep the old buffer


# ---- GraphCaptures -------------------------------------------------------------------------------
def _step(mode, bs, num_tokens=None):
    return CudaGraphStep(
        forward_mode=mode,
        bs=bs,
        num_tokens=num_tokens,
        req_pool_indices=torch.zeros(bs, dtype=torch.int32),
        seq_lens=torch.ones(bs, dtype=torch.int32),
    )


def test_graph_captures_keep_an_entry_per_mode_and_size():
    g = GraphCaptures("demo", max_bs=4, max_num_tokens=16)
    d2, v2 = _step(ForwardMode.DECODE, 2), _step(ForwardMode.TARGET_VERIFY, 2, 8)
    for step, entry in ((d2, "decode-2"), (v2, "verify-2")):
        g.check_capture(step)
        assert g.add(step, entry) == entry
    assert g.captured(_step(ForwardMode.DECODE, 2)) == "decode-2"
    assert g.captured(_step(ForwardMode.TARGET_VERIFY, 2)) == "verify-2"  # no token count: the captured one
    assert g.num_tokens(v2) == 8
    g.update(v2, "verify-2b")
    assert g.captured(v2) == "verify-2b" and g.num_tokens(v2) == 8


def test_graph_captures_typed_errors():
    with pytest.raises(InvalidArgumentError, match="max_bs/max_num_tokens"):
        GraphCaptures("demo", max_bs=0, max_num_tokens=4)
    with pytest.raises(InvalidArgumentError, match="max_bs/max_num_tokens"):
        GraphCaptures("demo", max_bs=4, max_num_tokens=3)
    g = GraphCaptures("demo", max_bs=4, max_num_tokens=8)
    with pytest.raises(UnsupportedFeatureError, match="CUDA graphs for EXTEND"):
        g.check_capture(_step(ForwardMode.EXTEND, 2, 6))
    with pytest.raises(InvalidArgumentError, match="bs/num_tokens"):
        g.check_capture(_step(ForwardMode.DECODE, 5))
    with pytest.raises(InvalidArgumentError, match="bs/num_tokens"):
        g.check_capture(_step(ForwardMode.TARGET_VERIFY, 3, 12))
    g.add(_step(ForwardMode.TARGET_VERIFY, 2, 8), "v")
    with pytest.raises(InvalidArgumentError, match="bs"):
        g.captured(_step(ForwardMode.DECODE, 2))  # captured in another mode only
    with pytest.raises(InvalidArgumentError, match="num_tokens"):
        g.captured(_step(ForwardMode.TARGET_VERIFY, 2, 6))
    with pytest.raises(InvalidArgumentError, match="init_cuda_graph_state"):
        captures_of(None, "demo")
    assert captures_of(g, "demo") is g


# ---- the shared query count ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("lens", "want"),
    [([3, 3], 3), ([1, 2], None), ([2, 2], 2), ([], None), ([4], 4), ([4, 4, 0, 8], None), ([0, 0], 0), ([1] * 9, 1)],
)
def test_shared_query_len_three_ways(lens, want):
    bs, T = len(lens), sum(lens)
    assert uniform_query_len(lens) == want
    assert shared_query_len(bs, T, longest=max(lens, default=0)) == want
    for dtype in (torch.int32, torch.int64):
        assert shared_query_len(bs, T, lens=torch.tensor(lens, dtype=dtype)) == want


def test_shared_query_len_worked_examples():
    assert shared_query_len(3, 12, longest=4) == 4
    assert shared_query_len(3, 10, longest=4) is None
    assert shared_query_len(2, 6, lens=torch.tensor([3, 3])) == 3
    assert shared_query_len(4, 4, longest=1) == 1  # a DECODE step
    with pytest.raises(InvalidArgumentError, match="lens"):
        shared_query_len(2, 4)


# ---- page arithmetic and block tables ------------------------------------------------------------
def test_pages_for_and_host_page_arithmetic_match_torch():
    assert (pages_for(129, 128), pages_for(70, 32), pages_for(0, 16)) == (2, 3, 0)
    rng = random.Random(0)
    for bs in (0, 1, 3, 16, 17, 40):  # both sides of the small-batch threshold
        for page_size in (1, 4, 16):
            lens = np.array([rng.randint(0, 70) for _ in range(bs)], dtype=np.int32)
            offsets, last = np.zeros(bs + 1, dtype=np.int32), np.zeros(bs, dtype=np.int32)
            total = host_page_offsets(lens, page_size, offsets)
            host_last_page_lens(lens, page_size, last)
            t = torch.from_numpy(lens)
            assert offsets.tolist() == page_indptr_from_lens(t, page_size).tolist() and total == offsets[-1]
            assert last.tolist() == last_page_len_from_lens(t, page_size).tolist()
            assert total == sum(pages_for(int(n), page_size) for n in lens)


def test_block_table_worked_example_and_padding():
    r2t = torch.zeros(3, 128, dtype=torch.int32)
    r2t[2, :70] = torch.cat([torch.arange(320, 352), torch.arange(96, 128), torch.arange(640, 646)])
    r2t[0, :5] = torch.arange(32, 37)
    rows, lens = torch.tensor([2, 0]), torch.tensor([70, 5], dtype=torch.int32)
    table = page_table_from_req_to_token(r2t, rows, lens, 32, 4, pad=-1)
    assert table.tolist() == [[10, 3, 20, -1], [1, -1, -1, -1]] and table.dtype == torch.int32
    assert page_table_from_req_to_token(r2t, rows, lens, 32, 4).tolist() == [[10, 3, 20, 0], [1, 0, 0, 0]]
    out = torch.full((4, 4), 7, dtype=torch.int32)
    got = page_table_from_req_to_token(r2t, rows, lens, 32, 4, pad=-1, out=out)
    assert got.data_ptr() == out.data_ptr() and out[:2].tolist() == table.tolist() and out[2:].eq(7).all()


def test_block_table_against_a_loop():
    gen = torch.Generator().manual_seed(1)
    for page_size in (1, 2, 16):
        per_row = pages_for(96, page_size)
        pages = torch.randperm(6 * per_row, generator=gen) + 1
        r2t = torch.zeros(6, 96, dtype=torch.int32)
        lens = torch.randint(0, 96, (4,), generator=gen, dtype=torch.int32)
        for r in range(6):
            mine = pages[r * per_row : (r + 1) * per_row]
            r2t[r] = (mine[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:96]
        rows = torch.tensor([5, 0, 3, 1])
        width = pages_for(96, page_size)
        table = page_table_from_req_to_token(r2t, rows, lens, page_size, width, pad=-1)
        for b in range(4):
            want = [int(r2t[rows[b], j * page_size]) // page_size for j in range(pages_for(int(lens[b]), page_size))]
            assert table[b].tolist() == want + [-1] * (width - len(want))


def test_block_table_refuses_bad_rows_and_slots_on_the_device():
    """With the pool's slot count and a fault buffer, a request row outside the table and a slot outside
    the pool become padding and are recorded (no host sync, no out-of-range read)."""
    r2t = torch.arange(4 * 8, dtype=torch.int32).reshape(4, 8) + 8
    r2t[1, 4] = 999  # past the pool
    faults = DeviceFaultFlags(torch.device("cpu"))
    rows, lens = torch.tensor([1, 7, 2]), torch.tensor([8, 3, 5], dtype=torch.int32)
    table = page_table_from_req_to_token(r2t, rows, lens, 4, 2, pad=-1, num_slots=64, fault=faults.buffer)
    assert table.tolist() == [[4, -1], [-1, -1], [6, 7]]
    flags = faults.buffer.tolist()
    assert flags[DeviceFaultKind.REQUEST_ROW] == 1 and flags[DeviceFaultKind.SLOT] == 1 and sum(flags) == 2
