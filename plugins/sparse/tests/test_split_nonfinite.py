"""A non-finite value a row sees reaches its output through the split merge too: the kit's masked-values
checks (`masked_nonfinite-*`) with every step split into several parts (on a GPU the default policy splits the
kit's MIXED step; under the interpreter's default policy it never splits), and the merge kernel alone with a
split whose LSE is NaN. Found on an H100: the merge dropped a NaN split (its weight test `lse > -inf` is false
for NaN, and the max over the splits skips NaN), so a query that saw a NaN key got a finite output."""

from __future__ import annotations

import math

import torch

from attn_core.testing import ConformanceSuite
from attn_sparse.config import SplitPolicy
from attn_sparse.kernels.merge import merge_splits

#: every step split: parts of at least 8 keys, up to 4, whatever the program count
ALWAYS_SPLIT = SplitPolicy(min_split_keys=8, max_splits=4, target_programs=1 << 20)


class TestDoubleSparsityMaskedSplit(ConformanceSuite):
    backend = "double_sparsity"
    options = {"sparse_decode_threshold": 1 << 30, "split_policy": ALWAYS_SPLIT}
    quick = True
    only = ("masked_nonfinite",)


class TestDualChunkMaskedSplit(ConformanceSuite):
    backend = "dual_chunk"
    options = {"chunk_size": 1 << 30, "split_policy": ALWAYS_SPLIT}
    quick = True
    only = ("masked_nonfinite",)


def test_merge_keeps_a_nan_split():
    gen = torch.Generator().manual_seed(0)
    T, H, S, dv = 5, 3, 4, 16
    partial_o = torch.randn(T, H, S, dv, generator=gen)
    partial_lse = torch.randn(T, H, S, generator=gen)
    partial_lse[:, :, 3] = float("-inf")  # an empty split: not read
    partial_o[:, :, 3] = float("nan")
    partial_lse[1, 2, 1] = float("nan")  # this split saw a NaN score: its row is NaN
    partial_o[1, 2, 1] = float("nan")
    partial_lse[3, 0, 0] = float("nan")
    partial_o[3, 0, 0] = float("nan")
    out = torch.full((T, H, dv), 7.0)
    lse = torch.full((T, H), 7.0)
    merge_splits(partial_o, partial_lse, out, lse)
    for t in range(T):
        for h in range(H):
            if (t, h) in ((1, 2), (3, 0)):
                assert out[t, h].isnan().all() and math.isnan(float(lse[t, h])), (t, h)
                continue
            ls = partial_lse[t, h, :3].double()
            want_lse = torch.logsumexp(ls, 0)
            want = (torch.exp(ls - want_lse)[:, None] * partial_o[t, h, :3].double()).sum(0)
            assert torch.allclose(out[t, h].double(), want, atol=1e-5), (t, h)
            assert abs(float(lse[t, h]) - float(want_lse)) < 1e-5
