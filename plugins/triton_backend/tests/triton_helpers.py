"""Shared test helpers: skip markers and backend factories (small decode splits so tiny shapes
exercise the split-merge path)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from attn_core.probes import triton_interpreter_enabled
from attn_triton.config import SplitPolicy

#: CPU tests run the kernels through the Triton interpreter
requires_interpreter = pytest.mark.skipif(not triton_interpreter_enabled(), reason="CPU tests need TRITON_INTERPRET=1")

#: splits of at least 8 keys, up to 8 per request: tiny CPU batches get several splits
SMALL_SPLITS = SplitPolicy(min_split_len=8, waves=64.0, cap=8, deterministic_max_splits=4, deterministic_min_split_len=8)


def factory(**options):
    """Backend factory for the harness: `factory(split_policy=...)(ctx)` builds a TritonAttnBackend."""
    from attn_triton.backend import TritonAttnBackend

    return partial(TritonAttnBackend, **options)


def small_split_factory():
    return factory(split_policy=SMALL_SPLITS)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def random_tree_mask(prefix: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """The verify mask of a random draft tree of n tokens (token 0 the root, each later token's parent
    a random earlier one): bool `[n, prefix + n]` where token t sees the prefix, its ancestors and
    itself. A chain (every parent the previous token) would be the causal mask."""
    parent = [-1] + [int(torch.randint(0, t, (1,), generator=gen)) for t in range(1, n)]
    mask = torch.zeros(n, prefix + n, dtype=torch.bool)
    mask[:, :prefix] = True
    for t in range(n):
        a = t
        while a >= 0:
            mask[t, prefix + a] = True
            a = parent[a]
    return mask
