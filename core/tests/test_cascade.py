"""Cascade-attention helpers: worked examples, random rows against a plain loop, typed errors; and
torch_native cascade steps (decode, extend, mixed) against the float64 reference."""

import dataclasses
import random

import pytest
import torch

from attn_core import InvalidArgumentError
from attn_core.batching.cascade import check_cascade_prefix, shared_prefix_len, use_cascade_attention
from attn_core.testing.harness import AttnCase, make_env, run_case


def test_shared_prefix_examples():
    rows = [[5, 6, 7, 9], [5, 6, 7, 3], [5, 6, 8, 1]]
    assert shared_prefix_len(rows, [4, 4, 3]) == 2
    assert shared_prefix_len(rows, [4, 4, 3], page_size=2) == 2
    assert shared_prefix_len(rows, [4, 4, 3], page_size=4) == 0
    assert shared_prefix_len(rows[:1], [4]) == 0


def test_shared_prefix_random_vs_loop():
    rng = random.Random(0)
    for _ in range(300):
        bs, width = rng.randint(2, 5), rng.randint(1, 20)
        base = [rng.randint(1, 9) for _ in range(width)]
        rows = [[x if rng.random() < 0.9 else rng.randint(1, 9) for x in base] for _ in range(bs)]
        lens = [rng.randint(0, width) for _ in range(bs)]
        ps = rng.choice([1, 2, 4])
        p = 0
        while p < min(lens) and all(r[p] == rows[0][p] for r in rows):
            p += 1
        assert shared_prefix_len(torch.tensor(rows), lens, ps) == p // ps * ps


def test_use_cascade_examples():
    assert use_cascade_attention(32768, [1] * 64)
    assert not use_cascade_attention(4096, [1] * 64)  # below 16384: the plain path reads it from L2
    assert not use_cascade_attention(32768, [1] * 4)
    assert not use_cascade_attention(32768, [256] * 64)  # extend rows: compute-bound, nothing saved
    assert use_cascade_attention(32768, [4] * 64)  # verify with 4 drafts
    assert not use_cascade_attention(16384, [16] * 8 + [1] * 16, min_saving_ratio=1e4)  # 23 * 16384 < 1e4 * 144
    assert use_cascade_attention(4096, [1] * 64, min_prefix=4096)


def test_bad_cascade_prefix_is_refused_before_any_write():
    env = make_env(AttnCase("EXTEND", [(6, 3), (9, 2)], cascade_prefix=6))
    b = env.batch
    for bad, match in ((7, "cached prefix"), (-1, "int >= 0"), (2.0, "int >= 0")):
        with pytest.raises(InvalidArgumentError, match=match):
            check_cascade_prefix(dataclasses.replace(b, cascade_prefix_len=bad))
    from attn_core.backends.torch_native.backend import TorchNativeBackend

    be = TorchNativeBackend(env.ctx)
    with pytest.raises(InvalidArgumentError, match="cascade_prefix_len"):
        be.init_forward_metadata(dataclasses.replace(b, cascade_prefix_len=7))


@pytest.mark.parametrize("mode", ["DECODE", "EXTEND", "MIXED"])
def test_torch_native_cascade_cases(mode):
    reqs = [(12, 1), (20, 1 if mode == "DECODE" else 5), (12, 1 if mode == "DECODE" else 3)]
    case = AttnCase(mode, reqs, cascade_prefix=11, page_size=4, return_lse=True, logit_cap=2.0, num_layers=2)
    from attn_core.backends.torch_native.backend import TorchNativeBackend

    result = run_case(TorchNativeBackend, case)
    assert result.ok, result.message()
