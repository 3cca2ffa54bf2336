"""The device MLA work list (`attn_flashinfer.mla_works`, under the Triton interpreter on CPU tensors)
against a plain port of FlashInfer 0.6.6's host MLA scheduler (`fake_flashinfer.mla_schedule`): the same
works (which request, tile and key range each covers, where split rows go), the same merge entries in
the same order, and an assignment of works to clusters in rounds (round r's works one per cluster),
complete, with clusters' loads within one work of each other; the page ids the same launch writes equal
core's index builder's. Random batches of 1-150 requests (several scheduling blocks), causal and not,
1-4 query tiles a request, empty requests, page sizes 1 / 16 / 64, and a device batch longer than the
host's (ids cut at the capacity)."""

from __future__ import annotations

import importlib.util
import pathlib
import random

import pytest
import torch

from attn_core.discovery.probes import triton_interpreter_enabled
from attn_core.ops.kv_indices import build_kv_indices
from attn_flashinfer.mla_works import (
    CTA_TILE_Q,
    MAX_WORKS,
    WORK_ARRAYS,
    WorkLaunch,
    cluster_size,
    fits,
    tiles_per_request,
    work_layout,
)

pytestmark = pytest.mark.skipif(
    not triton_interpreter_enabled(), reason="runs the Triton kernel under TRITON_INTERPRET=1"
)


def _fake():
    path = pathlib.Path(__file__).with_name("fake_flashinfer.py")
    spec = importlib.util.spec_from_file_location("fake_flashinfer_for_works", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FAKE = _fake()
PER_WORK = ("q_indptr", "kv_indptr", "partial_indptr", "q_len", "kv_len", "q_start", "kv_start", "kv_end")
MERGE = (
    "merge_packed_offset_start",
    "merge_packed_offset_end",
    "merge_partial_packed_offset_start",
    "merge_partial_packed_offset_end",
)
FAKE_MERGE = {
    "merge_packed_offset_start": "m_start",
    "merge_packed_offset_end": "m_end",
    "merge_partial_packed_offset_start": "mp_start",
}
FAKE_MERGE |= {"merge_partial_packed_offset_end": "mp_end", "merge_partial_stride": "m_stride"}


def _arrays(works: torch.Tensor, layout) -> dict[str, list[int]]:
    return {name: works[off // 4 :].tolist() for (name, _), off in zip(WORK_ARRAYS, layout.offsets)}


def _run(
    kv_lens: list[int],
    q_len: int,
    heads: int,
    causal: bool,
    page_size: int,
    num_sm: int,
    seed: int,
    device_extra: int = 0,
):
    """One launch over requests of `kv_lens` keys (the device lengths exceed them by `device_extra` on
    the last request); returns (ids, work arrays, layout, host page offsets, reference ids)."""
    g = random.Random(seed)
    bs = len(kv_lens)
    width = max(kv_lens) + device_extra + page_size
    rows = list(range(bs + 3))
    g.shuffle(rows)
    r2t = torch.zeros(bs + 3, width, dtype=torch.int32)
    for r in rows[:bs]:  # pages of each row: page-aligned slots, random pages
        pages = g.sample(range(1, 4000), -(-width // page_size))
        r2t[r] = torch.tensor([p * page_size + j for p in pages for j in range(page_size)][:width], dtype=torch.int32)
    pool_rows = torch.tensor(rows[:bs], dtype=torch.int64)
    host = torch.tensor(kv_lens, dtype=torch.int32)
    dev = host.clone()
    dev[-1] += device_extra
    pages = [-(-n // page_size) for n in kv_lens]
    capacity = sum(pages)
    ids = torch.full((capacity + 7,), -5, dtype=torch.int32)
    cs = cluster_size(bs * q_len, bs, heads)
    layout = work_layout(num_sm, cs, 512)
    assert fits(bs, q_len, heads, layout)
    works = torch.full((layout.buffer_entries,), -777, dtype=torch.int32)
    works[layout.int_bytes // 4 :] = torch.randint(
        0, layout.num_clusters, (layout.buffer_entries - layout.int_bytes // 4,)
    )  # stale scratch
    fault = torch.zeros(16, dtype=torch.int32)
    launch = WorkLaunch(layout, bs, q_len, heads, page_size, causal, works, True, True)
    launch(r2t, pool_rows, dev, ids, capacity, 4000 * page_size, fault)
    want_ids = build_kv_indices(r2t, pool_rows, host, capacity, page_size=page_size)
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + p)
    return ids, _arrays(works, layout), layout, indptr, want_ids, fault


def _check(kv_lens, q_len, heads, causal, page_size, num_sm, seed):
    bs = len(kv_lens)
    ids, got, layout, indptr, want_ids, _ = _run(kv_lens, q_len, heads, causal, page_size, num_sm, seed)
    assert torch.equal(ids[: len(want_ids)], want_ids) and bool((ids[len(want_ids) :] == -5).all())
    qo = [i * q_len for i in range(bs + 1)]
    cs, ref = FAKE.mla_schedule(qo, indptr, kv_lens, heads, causal, num_sm)
    assert cs == layout.cluster_size
    n_works = ref["work_indptr"][-1]
    nc = num_sm // cs
    # the works: the same set (FlashInfer orders them cluster by cluster, the device request by request)
    mine = sorted(tuple(got[a][w] for a in PER_WORK) for w in range(n_works))
    theirs = sorted(zip(*(ref[a] for a in PER_WORK)))
    assert mine == theirs
    # rounds: the works in request, tile (last first), chunk order, round r's (r * nc ..) one per cluster,
    # as the j-th work of its cluster's list
    key = lambda w: (got["q_indptr"][w], -got["q_start"][w], got["kv_start"][w])  # noqa: E731
    rank = {key(w): g for g, w in enumerate(sorted(range(n_works), key=key))}
    bounds = got["work_indptr"][: nc + 1]
    for c in range(nc):
        assert [rank[key(w)] // nc for w in range(bounds[c], bounds[c + 1])] == list(
            range(bounds[c + 1] - bounds[c])
        ), c
    # merge entries: the same, in the same order, zeros past them
    for a in MERGE + ("merge_partial_stride",):
        assert got[a][:num_sm] == ref[FAKE_MERGE[a]], a
    # clusters: ranges covering every work, loads within one work of each other
    assert bounds[0] == 0 and bounds[-1] == n_works and bounds == sorted(bounds)
    cost = [2 * CTA_TILE_Q * cs + got["kv_end"][w] - got["kv_start"][w] for w in range(n_works)]
    loads = [sum(cost[bounds[c] : bounds[c + 1]]) for c in range(nc)]
    assert max(loads) - min(loads) <= max(cost), loads
    # nothing written past the step's works
    for a in PER_WORK:
        assert got[a][n_works] == -777, a
    return n_works


def test_decode_128_heads_matches_the_host_scheduler():
    """DeepSeek decode shapes on an H100's 132 SMs (66 clusters of 2): one long request (split into
    chunks, merged), a uniform batch, and a random one."""
    assert _check([8192], 1, 128, False, 64, 132, 0) > 1
    _check([4096] * 64, 1, 128, False, 64, 132, 1)
    g = random.Random(2)
    _check([g.randrange(0, 3000) for _ in range(150)], 1, 128, False, 16, 132, 3)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_the_host_scheduler(seed):
    g = random.Random(100 + seed)
    heads = g.choice([4, 16, 128])
    q_len = g.choice([1, 2, 4, 5]) if heads < 128 else g.choice([1, 2, 4])
    bs = g.choice([1, 3, 70, 130])
    lens = [g.choice([0, g.randrange(1, 64), g.randrange(q_len, 2500)]) for _ in range(bs)]
    lens = [max(n, q_len) if g.random() < 0.9 else n for n in lens]
    causal = q_len > 1 or g.random() < 0.3
    _check(lens, q_len, heads, causal, g.choice([1, 16, 64]), g.choice([6, 8, 132]), seed)


def test_device_lengths_past_the_host_capacity_are_cut():
    """A device length larger than the host's: ids stop at the host's page count (and the fault is
    recorded), and the last request's works cover only the keys its written ids describe."""
    ids, got, layout, indptr, want_ids, fault = _run([40, 70], 1, 16, False, 16, 8, 7, device_extra=50)
    assert torch.equal(ids[: len(want_ids)], want_ids) and int(fault.sum()) > 0
    n_works = got["work_indptr"][layout.num_clusters]
    last = [w for w in range(n_works) if got["q_indptr"][w] == 1]
    assert (
        last
        and all(got["kv_len"][w] <= 70 + 15 for w in last)
        and max(got["kv_end"][w] for w in last) <= got["kv_len"][last[0]]
    )


def test_layout_and_limits():
    """`work_layout` for an H100 at both cluster sizes (the offsets FlashInfer 0.6.6's allocator gives,
    the GPU test compares them with its scheduler's), `tiles_per_request` and `fits`."""
    two, one = work_layout(132, 2, 512), work_layout(132, 1, 512)
    assert (
        two.offsets == one.offsets and two.offsets[:4] == (0, 65536, 131072, 196608) and two.offsets[4] == 196608 + 528
    )
    assert two.plan_info[:2] == (2, 66) and one.plan_info[:2] == (1, 132)
    assert two.plan_info[-2:] == (0, 2 * 66 * 128 * 2 * 512) and two.int_bytes == two.offsets[-1] + 4 * MAX_WORKS
    assert tiles_per_request(4, 128, 2) == 4 and tiles_per_request(1, 16, 1) == 1 and tiles_per_request(5, 16, 2) == 1
    assert cluster_size(64, 64, 128) == 2 and cluster_size(64, 64, 16) == 1 and cluster_size(320, 64, 16) == 2
    assert fits(64, 4, 128, two) and not fits(64, 9 * 2, 128, two) and not fits(0, 1, 128, two)
    assert not fits(MAX_WORKS, 1, 128, two)
