"""The float64 stand-ins of the Blackwell kernels, against a reference written here plainly (per query, per
head, a softmax over the visible keys), on random paged batches; and their documented rules: argument names,
int32 tables, the zero workspace on first use, the degenerate-stride rule, CUTLASS's table widths and heads."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from attn_trtllm_mla.mha_args import hnd_view
from attn_trtllm_mla.testing import blackwell_stand_ins as si


def plain(q, keys, vals, pos, scale, window_left=-1, sink=None):
    """One query row `[H, D]` at position `pos` over keys `[n, Hkv, D]`: float64 loops, the plainest form."""
    h, g = q.shape[0], q.shape[0] // keys.shape[1]
    out = torch.zeros(h, vals.shape[-1], dtype=torch.float64)
    for i in range(h):
        js = [j for j in range(keys.shape[0]) if j <= pos and (window_left < 0 or j >= pos - window_left)]
        s = torch.tensor([float(q[i].double() @ keys[j, i // g].double()) * scale for j in js], dtype=torch.float64)
        m = s.max() if sink is None else max(float(s.max()), float(sink[i]))
        e = torch.exp(s - m)
        den = e.sum() + (0.0 if sink is None else math.exp(float(sink[i]) - m))
        out[i] = sum(e[t] * vals[j, i // g].double() for t, j in enumerate(js)) / den
    return out


def paged_pool(lens, page, hkv, d, gen, dtype=torch.bfloat16):
    """NHD pool buffers `[slots, Hkv, D]` with each request's keys on shuffled pages; block tables int32."""
    npages = [max(1, -(-n // page)) for n in lens]
    total = sum(npages) + 2
    k = torch.full((total * page, hkv, d), float("nan"), dtype=dtype)
    v = torch.full((total * page, hkv, d), float("nan"), dtype=dtype)
    perm = (torch.randperm(total - 1, generator=gen) + 1).tolist()
    width = max(npages)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    dense = []
    for b, n in enumerate(lens):
        pg, perm = perm[: npages[b]], perm[npages[b] :]
        table[b, : len(pg)] = torch.tensor(pg, dtype=torch.int32)
        kd, vd = torch.randn(n, hkv, d, generator=gen).to(dtype), torch.randn(n, hkv, d, generator=gen).to(dtype)
        for t in range(n):
            k[pg[t // page] * page + t % page], v[pg[t // page] * page + t % page] = kd[t], vd[t]
        dense.append((kd, vd))
    return k, v, table, dense


@pytest.mark.parametrize("seed", range(3))
def test_trtllm_decode_with_q_len_window_and_sinks(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    page, hkv, q_len = rng.choice([16, 32]), rng.choice([1, 2]), rng.choice([1, 3])
    hq, d = hkv * 2, 16
    lens = [rng.randint(q_len, 80) for _ in range(rng.randint(1, 3))]
    k, v, table, dense = paged_pool(lens, page, hkv, d, gen)
    q = torch.randn(len(lens) * q_len, hq, d, generator=gen).bfloat16()
    window = rng.choice([-1, 5])
    sinks = torch.randn(hq, generator=gen) if seed % 2 else None
    kw = dict(
        query=q,
        kv_cache=(hnd_view(k, page), hnd_view(v, page)),
        workspace_buffer=torch.zeros(64, dtype=torch.uint8),
        block_tables=table,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        max_seq_len=max(lens),
        bmm1_scale=0.3,
        bmm2_scale=0.5,
        window_left=window,
        sinks=sinks,
        out_dtype=torch.bfloat16,
        q_len_per_req=q_len,
    )
    out = si.trtllm_decode(kw)
    for b, (kd, vd) in enumerate(dense):
        for t in range(q_len):
            want = plain(q[b * q_len + t], kd, vd, lens[b] - q_len + t, 0.3, window, sinks) * 0.5
            got = out[b * q_len + t].double()
            assert (got - want).norm() / want.norm() < 2e-2


def test_trtllm_context_causal_bottom_right():
    gen = torch.Generator().manual_seed(7)
    lens, qlens, page = [40, 9], [6, 9], 16
    k, v, table, dense = paged_pool(lens, page, 2, 16, gen, torch.float16)
    q = torch.randn(sum(qlens), 4, 16, generator=gen).half()
    kw = dict(
        query=q,
        kv_cache=(hnd_view(k, page), hnd_view(v, page)),
        workspace_buffer=torch.zeros(64, dtype=torch.uint8),
        block_tables=table,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        max_q_len=9,
        max_kv_len=40,
        bmm1_scale=0.25,
        bmm2_scale=1.0,
        batch_size=2,
        cum_seq_lens_q=torch.tensor([0, 6, 15], dtype=torch.int32),
        cum_seq_lens_kv=torch.tensor([0, 40, 49], dtype=torch.int32),
        window_left=-1,
        sinks=None,
        out_dtype=torch.float16,
    )
    out = si.trtllm_context(kw)
    start = 0
    for b, (kd, vd) in enumerate(dense):
        for t in range(qlens[b]):
            want = plain(q[start + t], kd, vd, lens[b] - qlens[b] + t, 0.25)
            assert (out[start + t].double() - want).norm() / want.norm() < 2e-2
        start += qlens[b]
    bad = dict(kw, cum_seq_lens_kv=torch.tensor([0, 41, 50], dtype=torch.int32))
    with pytest.raises(si.StandInError, match="running sum"):
        si.trtllm_context(bad)
    with pytest.raises(si.StandInError, match="documented signature"):
        si.trtllm_context(dict(kw, q_len_per_req=2))


def test_trtllm_documented_rules():
    gen = torch.Generator().manual_seed(1)
    k, v, table, _ = paged_pool([5], 16, 1, 8, gen)
    base = dict(
        query=torch.randn(1, 2, 8).bfloat16(),
        kv_cache=(hnd_view(k, 16), hnd_view(v, 16)),
        block_tables=table,
        seq_lens=torch.tensor([5], dtype=torch.int32),
        max_seq_len=5,
        bmm1_scale=1.0,
        bmm2_scale=1.0,
    )
    dirty = torch.ones(64, dtype=torch.uint8)
    with pytest.raises(si.StandInError, match="initialized to 0"):
        si.trtllm_decode(dict(base, workspace_buffer=dirty))
    clean = torch.zeros(64, dtype=torch.uint8)
    si.trtllm_decode(dict(base, workspace_buffer=clean))
    clean.fill_(3)  # a kernel may leave it non-zero after its first use
    si.trtllm_decode(dict(base, workspace_buffer=clean))
    si.trtllm_decode(dict(base, workspace_buffer=clean[:32]))  # a view of it: the same workspace
    memory = np.zeros(64, dtype=np.uint8)  # two allocations at one address, one after the other
    first = torch.from_numpy(memory)
    si.trtllm_decode(dict(base, workspace_buffer=first))
    address = first.data_ptr()
    del first
    memory[:] = 1
    second = torch.from_numpy(memory)  # a new buffer at the freed one's address: new, so it must be 0
    assert second.data_ptr() == address
    with pytest.raises(si.StandInError, match="initialized to 0"):
        si.trtllm_decode(dict(base, workspace_buffer=second))
    degenerate = k.view(-1, 16, 1, 8).permute(0, 2, 1, 3)
    with pytest.raises(si.StandInError, match="degenerate"):
        si.trtllm_decode(dict(base, kv_cache=(degenerate, degenerate), workspace_buffer=clean))
    with pytest.raises(si.StandInError, match="int32"):
        si.trtllm_decode(dict(base, block_tables=table.long(), workspace_buffer=clean))
    with pytest.raises(si.StandInError, match="max_seq_len"):
        si.trtllm_decode(dict(base, max_seq_len=4, workspace_buffer=clean))


def test_cutlass_decode_and_its_rules():
    gen = torch.Generator().manual_seed(3)
    lens, page = [300, 7], 128
    k, _, table, dense = paged_pool(lens, page, 1, 576, gen)
    cache = k.view(-1, page, 576)
    q = torch.randn(2, 8, 576, generator=gen).bfloat16()
    ws = torch.empty(si.cutlass_mla_get_workspace_size(table.shape[1] * page, 2), dtype=torch.uint8)
    seq = torch.tensor(lens, dtype=torch.int32)
    out = si.cutlass_mla_decode(q[..., :512], q[..., 512:], cache, seq, table, ws, 0.04)
    assert out.shape == (2, 8, 512) and out.dtype == torch.bfloat16
    for b, (kd, _) in enumerate(dense):
        want = plain(q[b], kd, kd[..., :512], lens[b] - 1, 0.04)
        assert (out[b].double() - want).norm() / want.norm() < 2e-2
    with pytest.raises(si.StandInError, match="workspace"):
        si.cutlass_mla_decode(q[..., :512], q[..., 512:], cache, seq, table, ws[:100], 0.04)
    with pytest.raises(si.StandInError, match="block_num"):
        si.cutlass_mla_decode(q[..., :512], q[..., 512:], cache.view(-1, 64, 576), seq, table, ws, 0.04)
    big = torch.randn(2, 130, 576).bfloat16()
    with pytest.raises(si.StandInError, match="128 heads"):
        si.cutlass_mla_decode(big[..., :512], big[..., 512:], cache, seq, table, ws, 0.04)
