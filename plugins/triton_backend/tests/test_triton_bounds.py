"""Memory safety of the Triton path under device input no host check saw (what a CUDA-graph replay
feeds the kernels; issue 11's Triton repros): request rows -1 / equal to the table's rows / 10**6,
negative seq_lens and extend_seq_lens, a req_to_token slot past the KV pool, device seq_lens larger
than the host sum that sized kv_indices, extend lengths past the step's tokens.

Every buffer the kernels touch is a view into a larger NaN-poisoned tensor (canaries on both sides,
the pool's unused slots NaN too, the dummy slot 0 zero): after the metadata launch and the attention
kernels, the canaries are unchanged, no NaN reached an output row the kernel wrote, every request the
fault did not touch matches the float64 oracle, and the fault buffer / `poll_device_fault()` names the
bad index. Under the Triton interpreter (CPU) with small shapes; fp32 and fp16."""

from __future__ import annotations

import pytest
import torch
from triton_helpers import requires_interpreter

from attn_core.ops.device_faults import DeviceFaultKind as K
from attn_core.testing.reference import reference_attention, relative_error, tolerance

pytestmark = requires_interpreter

ROWS, WIDTH, SLOTS, PAD = 8, 32, 300, 7
HQ, HKV, D = 4, 2, 16


def inside(shape, fill, dtype, pad=PAD):
    """(whole, view): a `shape` tensor in the middle of a `fill`-ed tensor `pad` rows longer each side."""
    whole = torch.full((shape[0] + 2 * pad, *shape[1:]), fill, dtype=dtype)
    return whole, whole[pad : pad + shape[0]]


class Pool:
    """A NaN-poisoned K/V pool and a req_to_token table whose row r holds distinct random slots."""

    def __init__(self, dtype, seed):
        gen = torch.Generator().manual_seed(seed)
        self.k_whole, self.k = inside((SLOTS, HKV, D), float("nan"), dtype)
        self.v_whole, self.v = inside((SLOTS, HKV, D), float("nan"), dtype)
        self.k[0] = self.v[0] = 0  # the dummy slot
        self.r2t_whole, self.r2t = inside((ROWS, WIDTH), 10**6, torch.int32)
        self.r2t.copy_((torch.randperm(SLOTS - 1, generator=gen)[: ROWS * WIDTH] + 1).view(ROWS, WIDTH).to(torch.int32))
        used = self.r2t.reshape(-1).long()
        self.k[used] = torch.randn(used.shape[0], HKV, D, generator=gen).to(dtype)
        self.v[used] = torch.randn(used.shape[0], HKV, D, generator=gen).to(dtype)
        self.gen = gen

    def keys(self, row, n, skip=()):
        """K and V of row's first n keys (a list of key positions to leave out: masked-out bad slots)."""
        cols = [j for j in range(n) if j not in skip]
        slots = self.r2t[row, cols].long()
        return self.k[slots], self.v[slots]

    def snapshot(self):
        return [t.clone() for t in (self.k_whole, self.v_whole, self.r2t_whole)]

    def unchanged(self, snap) -> bool:
        return all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(snap, self.snapshot()))


def flags(fault) -> set:
    return {k for k in K if fault[k].item()}


def decode_run(pool, rows, dev_lens, host_total, dtype, max_splits=3):
    """Index launch (kv_indices sized by `host_total`) + split decode, every buffer canaried."""
    from attn_triton.kernels.decode import DecodeConfig, decode_attention
    from attn_triton.metadata import KVIndex, fill_kv

    bs = len(rows)
    fault = torch.zeros(len(K), dtype=torch.int32)
    ind_whole, indices = inside((max(host_total, 1),), -5, torch.int32)
    ptr_whole, indptr = inside((bs + 1,), -5, torch.int32)
    kv = KVIndex(indptr, indices)
    lens = torch.tensor(dev_lens, dtype=torch.int32)
    fill_kv(kv, pool.r2t, torch.tensor(rows), lens, fault)
    q = torch.randn(bs, HQ, D, generator=pool.gen).to(dtype)
    o_whole, o = inside((bs, HQ, D), float("nan"), dtype)
    part_o = torch.full((bs, HQ, max_splits, D), float("nan"))
    part_lse = torch.full((bs, HQ, max_splits), float("nan"))
    cfg = DecodeConfig(block_n=16, block_h=16, num_warps=1, num_stages=1)
    decode_attention(
        q, pool.k, pool.v, o, indptr, indices, max_splits, 4, part_o, part_lse, fault, sm_scale=0.3, config=cfg
    )
    n = int(indptr[-1])
    assert indices.shape[0] == max(host_total, 1) and n <= indices.shape[0]
    assert ind_whole[:PAD].eq(-5).all() and ind_whole[PAD + n :].eq(-5).all(), "wrote past kv_indices' ids"
    assert ptr_whole[:PAD].eq(-5).all() and ptr_whole[PAD + bs + 1 :].eq(-5).all(), "wrote outside kv_indptr"
    assert o_whole[:PAD].isnan().all() and o_whole[PAD + bs :].isnan().all(), "wrote outside o"
    assert not o.isnan().any(), "a NaN (poisoned slot or canary) reached the output"
    return q, o, fault


def check_decode_row(pool, q, o, r, row, n, dtype, skip=()):
    k, v = pool.keys(row, n, skip)
    ref, _ = reference_attention(q[r : r + 1], k, v, q_positions=torch.tensor([n - 1]), scale=0.3)
    assert relative_error(o[r : r + 1], ref) <= tolerance(dtype), (r, row, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bad_row", [-1, ROWS, 10**6])
def test_decode_request_row_outside_the_table(dtype, bad_row):
    pool = Pool(dtype, 1)
    snap = pool.snapshot()
    rows, lens = [3, bad_row, 5], [20, 9, 7]
    q, o, fault = decode_run(pool, rows, lens, sum(lens), dtype)
    assert flags(fault) == {K.REQUEST_ROW}
    assert pool.unchanged(snap)
    check_decode_row(pool, q, o, 0, 3, 20, dtype)
    check_decode_row(pool, q, o, 2, 5, 7, dtype)
    assert o[1].eq(0).all(), "a request with a bad row must see no key"


@pytest.mark.parametrize("dtype", [torch.float32])
def test_decode_negative_and_too_long_lengths(dtype):
    pool = Pool(dtype, 2)
    q, o, fault = decode_run(pool, [0, 1, 2], [-4, 11, WIDTH + 50], 11 + WIDTH, dtype)
    assert flags(fault) == {K.LENGTH, K.TABLE_WIDTH}
    assert o[0].eq(0).all()
    check_decode_row(pool, q, o, 1, 1, 11, dtype)
    check_decode_row(pool, q, o, 2, 2, WIDTH, dtype)  # cut at the table's width


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "n, bad, max_splits",
    [
        (12, {2: SLOTS + 3, 5: -2}, 3),  # one tail tile (16-key tiles)
        (32, {2: SLOTS + 3, 21: -2, 28: 10**6}, 3),  # whole tiles in two splits: the unmasked steps' redo
        (
            31,
            {5: SLOTS, 20: -1},
            1,
        ),  # one split: a whole tile's bad slot sends it back over all keys; the tail's is masked
    ],
)
def test_decode_slot_past_the_pool(dtype, n, bad, max_splits):
    pool = Pool(dtype, 3)
    for key, slot in bad.items():
        pool.r2t[4, key] = slot  # past the pool (the canary region) or negative
    q, o, fault = decode_run(pool, [4, 6], [n, 10], n + 10, dtype, max_splits)
    assert flags(fault) == {K.SLOT}
    check_decode_row(pool, q, o, 0, 4, n, dtype, skip=tuple(bad))  # the bad keys are masked out
    check_decode_row(pool, q, o, 1, 6, 10, dtype)


def test_decode_device_lengths_above_the_host_sum():
    """Host seq_lens_sum 12 sized kv_indices; the device says 30 keys: no id past 12 is written."""
    dtype = torch.float32
    pool = Pool(dtype, 4)
    q, o, fault = decode_run(pool, [2, 7], [8, 22], 12, dtype)
    assert flags(fault) == {K.INDEX_CAPACITY}
    check_decode_row(pool, q, o, 0, 2, 8, dtype)
    k, v = pool.keys(7, 4)  # what fitted: the first 4 keys of the second request
    ref, _ = reference_attention(q[1:2], k, v, q_positions=torch.tensor([3]), scale=0.3)
    assert relative_error(o[1:2], ref) <= tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_extend_hostile_lengths_and_rows(dtype):
    """Extend: a negative extend length, a bad row, and q lengths summing past the step's tokens."""
    from attn_triton.kernels.extend import ExtendConfig, extend_attention
    from attn_triton.metadata import KVIndex, fill_kv

    pool = Pool(dtype, 5)
    snap = pool.snapshot()
    rows, seq, ext = [1, -1, 3, 4], [9, 6, 12, 7], [3, 2, -5, 6]
    T = 7  # the host's tokens: 3 + 2 + 0 + 2 (the last request's 6 reach past them)
    bs = len(rows)
    fault = torch.zeros(len(K), dtype=torch.int32)
    ind_whole, indices = inside((sum(seq),), -5, torch.int32)
    kv = KVIndex(torch.empty(bs + 1, dtype=torch.int32), indices)
    qo = torch.empty(bs + 1, dtype=torch.int32)
    fill_kv(
        kv,
        pool.r2t,
        torch.tensor(rows),
        torch.tensor(seq, dtype=torch.int32),
        fault,
        q_lens=torch.tensor(ext, dtype=torch.int32),
        qo_indptr=qo,
    )
    assert flags(fault) == {K.REQUEST_ROW, K.LENGTH}
    assert qo.tolist() == [0, 3, 5, 5, 11]
    q_whole, q = inside((T, HQ, D), float("nan"), dtype)
    q.copy_(torch.randn(T, HQ, D, generator=pool.gen).to(dtype))
    o_whole, o = inside((T, HQ, D), float("nan"), dtype)
    cfg = ExtendConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
    extend_attention(q, pool.k, pool.v, o, qo, kv.indptr, kv.indices, 6, fault, sm_scale=0.3, config=cfg)
    assert K.QUERY_ROWS in flags(fault)
    assert o_whole[:PAD].isnan().all() and o_whole[PAD + T :].isnan().all(), "wrote outside o"
    assert ind_whole[:PAD].eq(-5).all() and ind_whole[PAD + sum(seq) :].eq(-5).all()
    assert not o.isnan().any()
    assert pool.unchanged(snap)
    k, v = pool.keys(1, 9)
    ref, _ = reference_attention(q[0:3], k, v, q_positions=torch.arange(6, 9), scale=0.3)
    assert relative_error(o[0:3], ref) <= tolerance(dtype)
    assert o[3:5].eq(0).all(), "the bad row's queries must see no key"
    k, v = pool.keys(4, 7)  # the last request: 2 of its 6 queries fit in the tokens (the last 2 keys)
    ref, _ = reference_attention(q[5:7], k, v, q_positions=torch.arange(5, 7), scale=0.3)
    assert relative_error(o[5:7], ref) <= tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bad", [{5: SLOTS + 3}, {5: SLOTS + 3, 20: -2}])
def test_extend_slot_past_the_pool(dtype, bad):
    """Extend, 8 new tokens after 24 (16-key tiles): a slot past the pool in keys [0, 16), which every row sees
    whole (unmasked: the dummy slot 0, zeros, is read in its place, `common.whole_tile_slots`), and one in the
    causal diagonal's tile (masked out); each recorded as SLOT, nothing read outside the pool."""
    from attn_triton.kernels.extend import ExtendConfig, extend_attention
    from attn_triton.metadata import KVIndex, fill_kv

    pool = Pool(dtype, 6)
    row, seq, ext = 2, 32, 8
    for key, slot in bad.items():
        pool.r2t[row, key] = slot
    fault = torch.zeros(len(K), dtype=torch.int32)
    kv = KVIndex(torch.empty(2, dtype=torch.int32), torch.empty(seq, dtype=torch.int32))
    qo = torch.empty(2, dtype=torch.int32)
    fill_kv(
        kv,
        pool.r2t,
        torch.tensor([row]),
        torch.tensor([seq], dtype=torch.int32),
        fault,
        q_lens=torch.tensor([ext], dtype=torch.int32),
        qo_indptr=qo,
    )
    q = torch.randn(ext, HQ, D, generator=pool.gen).to(dtype)
    o_whole, o = inside((ext, HQ, D), float("nan"), dtype)
    cfg = ExtendConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
    extend_attention(q, pool.k, pool.v, o, qo, kv.indptr, kv.indices, ext, fault, sm_scale=0.3, config=cfg)
    assert flags(fault) == {K.SLOT}
    assert o_whole[:PAD].isnan().all() and o_whole[PAD + ext :].isnan().all(), "wrote outside o"
    assert not o.isnan().any(), "a NaN (a slot past the pool) reached the output"
    cols = [j for j in range(seq) if j != 20 or 20 not in bad]  # the masked tile's bad key is left out
    slots = pool.r2t[row, cols].long()
    slots[cols.index(5)] = 0  # the whole tile's bad key reads the dummy slot
    start = seq - ext - (20 in bad)  # the queries' positions among the keys left
    ref, _ = reference_attention(
        q, pool.k[slots], pool.v[slots], q_positions=torch.arange(start, start + ext), scale=0.3
    )
    assert relative_error(o, ref) <= tolerance(dtype)


def test_backend_replay_with_bad_rows_reports_through_poll():
    """The backend's CUDA-graph replay path (no host checks): a row past the table and a negative
    length are refused on the device and `poll_device_fault()` names them, once."""
    from attn_core.contract.forward_mode import ForwardMode
    from attn_core.testing.harness import AttnCase, layer_inputs, make_env, make_layer
    from attn_triton.backend import TritonAttnBackend

    case = AttnCase("DECODE", [(5, 1), (7, 1), (3, 1)])
    env = make_env(case)
    backend = TritonAttnBackend(env.ctx)
    b = env.batch
    rows = env.ctx.req_to_token_pool.req_to_token.shape[0]
    backend.init_cuda_graph_state(4, 4)
    backend.init_forward_metadata_capture_cuda_graph(
        3, 3, b.req_pool_indices, b.seq_lens, None, ForwardMode.DECODE, None
    )
    assert backend.poll_device_fault() is None
    bad_rows = b.req_pool_indices.clone()
    bad_rows[1] = rows
    bad_lens = b.seq_lens.clone()
    bad_lens[2] = -3
    backend.init_forward_metadata_replay_cuda_graph(
        3, bad_rows, bad_lens, int(b.seq_lens_cpu.sum()), None, ForwardMode.DECODE, None, b.seq_lens_cpu
    )
    layer = make_layer(case, 0)
    x = layer_inputs(env, 0, torch.Generator().manual_seed(0))
    out = backend.forward(x["q"], x["k"], x["v"], layer, b)
    assert torch.isfinite(out).all()
    report = backend.poll_device_fault()
    assert report is not None and "request row" in report and "length" in report
    assert backend.poll_device_fault() is None
