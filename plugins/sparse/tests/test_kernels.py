"""The selection kernels and the split merge on their own, against plain loops: integer-valued labels and
queries make many exact ties (the rule: larger approximate score first, then lower position), negative
scores and zeros of both signs, lengths off every block size, top-k smaller and larger than a request."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from attn_sparse.kernels.merge import merge_splits
from attn_sparse.kernels.topk import label_scores, select_topk


def selection_case(lens, hq, hkv, c, d, seed, values=(-2, 3)):
    gen = torch.Generator().manual_seed(seed)
    slots_total = sum(lens) + 5
    perm = (torch.randperm(slots_total - 1, generator=gen) + 1).to(torch.int32)  # slots in random order, 0 unused
    kv_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.tensor(lens).cumsum(0)
    kv_indices = perm[: sum(lens)]
    labels = torch.full((slots_total, hkv, c), float("nan"))
    labels[kv_indices.long()] = torch.randint(*values, (sum(lens), hkv, c), generator=gen).float()
    q = torch.randint(*values, (len(lens), hq, d), generator=gen).float()
    channels = torch.stack([torch.randperm(d, generator=gen)[:c] for _ in range(hkv)])
    plan = SimpleNamespace(kv_indptr=kv_indptr, kv_indices=kv_indices)
    return q, labels, channels, plan


def expected_selection(q, labels, channels, plan, r, h, top_k, group):
    beg, end = int(plan.kv_indptr[r]), int(plan.kv_indptr[r + 1])
    slots = plan.kv_indices[beg:end].long()
    g = h // group
    approx = [float(labels[s, g] @ q[r, h, channels[g]]) for s in slots.tolist()]
    order = sorted(range(len(approx)), key=lambda j: (-approx[j], j))[:top_k]
    return [int(slots[j]) for j in sorted(order)]


@pytest.mark.parametrize("top_k", [1, 7, 64, 300])
def test_top_k_with_ties_follows_the_position_rule(top_k):
    lens, hq, hkv, c, d = [70, 200, 5, 129], 4, 2, 3, 16
    q, labels, channels, plan = selection_case(lens, hq, hkv, c, d, seed=top_k)
    sparse = torch.tensor([1, 1, 1, 0], dtype=torch.int8)  # the last request is not worked on
    keys = torch.full((len(lens), hq, max(lens)), -7, dtype=torch.int32)
    width = max(top_k, 1)
    selected = torch.full((len(lens), hq, width), -1, dtype=torch.int32)
    label_scores(q, channels, labels, plan, sparse, keys, block_n=16)
    select_topk(keys, plan, sparse, top_k, selected)
    ties = 0
    for r in range(len(lens)):
        for h in range(hq):
            row = selected[r, h].tolist()
            if not sparse[r]:
                assert row == [-1] * width
                continue
            want = expected_selection(q, labels, channels, plan, r, h, top_k, hq // hkv)
            assert row[: len(want)] == want, (r, h)
            assert row[len(want) :] == [-1] * (width - len(want))  # nothing written past min(top_k, kv_len)
            beg = int(plan.kv_indptr[r])
            approx = labels[plan.kv_indices[beg : beg + lens[r]].long(), h // 2] @ q[r, h, channels[h // 2]]
            if len(want) < lens[r]:
                kth = torch.sort(approx, descending=True).values[len(want) - 1]
                ties += int((approx == kth).sum()) > 1
    assert ties >= 4 or top_k >= max(lens), "the data should put ties at the cut"


def test_negative_and_signed_zero_scores_order_as_floats():
    """Scores of both signs, tiny and huge, and -0.0 next to +0.0 (equal: the lower position wins)."""
    values = torch.tensor([-3.5, 0.0, -0.0, 1e-30, -1e-30, 7e20, -7e20, 2.0, -0.0, 0.0, 5.0, -1.0])
    n = values.numel()
    q = torch.ones(1, 1, 16)
    labels = torch.full((n + 1, 1, 1), float("nan"))
    labels[1:, 0, 0] = values
    plan = SimpleNamespace(
        kv_indptr=torch.tensor([0, n], dtype=torch.int32), kv_indices=torch.arange(1, n + 1, dtype=torch.int32)
    )
    channels = torch.tensor([[0]])
    sparse = torch.ones(1, dtype=torch.int8)
    keys = torch.empty(1, 1, n, dtype=torch.int32)
    label_scores(q, channels, labels, plan, sparse, keys, block_n=16)
    for top_k in range(1, n + 1):
        selected = torch.full((1, 1, top_k), -1, dtype=torch.int32)
        select_topk(keys, plan, sparse, top_k, selected)
        order = sorted(range(n), key=lambda j: (-float(values[j]), j))[:top_k]
        assert selected[0, 0].tolist() == [j + 1 for j in sorted(order)], top_k


def test_merge_splits_matches_the_definition():
    gen = torch.Generator().manual_seed(3)
    T, H, S, dv = 5, 3, 4, 24
    partial_o = torch.randn(T, H, S, dv, generator=gen)
    partial_lse = torch.randn(T, H, S, generator=gen) * 3
    partial_lse[0, 0, 1:] = float("-inf")  # one split only
    partial_o[0, 0, 1:] = float("nan")  # empty splits are not read
    partial_lse[1, 1] = float("-inf")  # no key at all
    partial_o[1, 1] = float("nan")
    out = torch.empty(T, H, dv)
    lse = torch.empty(T, H)
    merge_splits(partial_o, partial_lse, out, lse)
    want_lse = torch.logsumexp(partial_lse.double(), dim=-1)
    w = torch.exp(partial_lse.double() - want_lse[..., None]).nan_to_num(0.0)
    want = (partial_o.double().nan_to_num(0.0) * w[..., None]).sum(2)
    want[1, 1] = 0.0
    assert torch.allclose(lse.double(), want_lse, atol=1e-6) and torch.isneginf(lse[1, 1])
    assert torch.allclose(out.double(), want, atol=1e-6)
