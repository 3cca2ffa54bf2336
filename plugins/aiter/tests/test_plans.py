"""The pure helpers of `attn_aiter.plans`: their worked examples, and the query pieces checked against a
plain causal definition on random requests."""

from __future__ import annotations

import random

import pytest
import torch
from attn_aiter import plans

from attn_core.contract.errors import InvalidArgumentError


def test_worked_examples():
    assert plans.partitions_for(300) == 2 and plans.partitions_for(256) == 1 and plans.partitions_for(0) == 1
    assert plans.decode_workspace_bytes(2, 4, 3, 64, 2) == 3264
    assert [plans.mla_padded_heads(h) for h in (4, 16, 40, 128)] == [16, 16, 48, 128]
    assert plans.fold_kv_scales(0.125, 0.5, 2.0) == (0.0625, 2.0)
    assert plans.query_pieces([5, 0, 2], [9, 3, 2], 2) == [(0, 2, 6), (0, 2, 8), (0, 1, 9), (2, 2, 2)]
    assert [plans.mla_kernel_for(q) for q in ([1, 1], [3, 3], [5, 5], [1, 2], [])] == [
        "decode",
        "decode",
        "prefill",
        "prefill",
        "prefill",
    ]
    assert plans.offsets([3, 0, 2]) == [0, 3, 3, 5]
    a, b = plans.to_device([[1, 2], [3]], torch.device("cpu"))
    assert a.tolist() == [1, 2] and b.tolist() == [3] and a.dtype == torch.int32


def test_bad_values_are_typed_errors():
    with pytest.raises(InvalidArgumentError, match="num_q_heads"):
        plans.mla_padded_heads(129)
    with pytest.raises(InvalidArgumentError, match="max_q"):
        plans.query_pieces([3], [3], 0)


@pytest.mark.parametrize("seed", range(10))
def test_query_pieces_keep_each_query_s_keys(seed):
    """Every query of every request lands in exactly one piece, in order, and under causal-from-the-
    bottom-right attention within its piece sees exactly the keys 0..p of its own position p."""
    rng = random.Random(seed)
    q_lens = [rng.choice([0, 1, rng.randint(1, 300)]) for _ in range(rng.randint(1, 5))]
    kv_lens = [n + rng.randint(0, 500) for n in q_lens]
    max_q = rng.choice([1, 4, 128])
    pieces = plans.query_pieces(q_lens, kv_lens, max_q)
    seen = {r: [] for r in range(len(q_lens))}
    for r, n, keys in pieces:
        assert 1 <= n <= max_q
        for i in range(n):
            seen[r].append(i + keys - n)  # the last key a query i of the piece sees (bottom-right causal)
    for r, (n, total) in enumerate(zip(q_lens, kv_lens)):
        assert seen[r] == list(range(total - n, total))  # query j of the request is at position total - n + j
