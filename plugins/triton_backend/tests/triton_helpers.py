"""Shared test helpers: skip markers and backend factories (small decode splits so tiny shapes
exercise the split-merge path)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from attn_core.discovery.probes import triton_interpreter_enabled
from attn_triton.config import SplitPolicy

#: CPU tests run the kernels through the Triton interpreter
requires_interpreter = pytest.mark.skipif(not triton_interpreter_enabled(), reason="CPU tests need TRITON_INTERPRET=1")

#: splits of at least 8 keys, up to 8 per request: tiny CPU batches get several splits
SMALL_SPLITS = SplitPolicy(
    min_split_len=8, waves=64.0, cap=8, deterministic_max_splits=4, deterministic_min_split_len=8
)


def factory(**options):
    """Backend factory for the harness: `factory(split_policy=...)(ctx)` builds a TritonAttnBackend."""
    from attn_triton.backend import TritonAttnBackend

    return partial(TritonAttnBackend, **options)


def small_split_factory():
    return factory(split_policy=SMALL_SPLITS)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def paged_setup(lens, hkv, d, dv, dtype, gen, page_size=1):
    """Random K/V for requests of `lens` tokens in a NaN-poisoned pool, pages in random order.

    Returns (k_buf `[slots, hkv, d]`, v_buf `[slots, hkv, dv]`, kv_indptr `[bs+1]` int32, kv_indices int32,
    per-request dense K list, V list)."""
    pages = [-(-n // page_size) for n in lens]
    num_pages = sum(pages) + 3
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    k_buf = torch.full((num_pages * page_size, hkv, d), float("nan"), dtype=dtype)
    v_buf = torch.full((num_pages * page_size, hkv, dv), float("nan"), dtype=dtype)
    slots, ks, vs = [], [], []
    for n, p in zip(lens, pages):
        mine, perm = perm[:p], perm[p:]
        s = (torch.tensor(mine, dtype=torch.int64)[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:n]
        k = torch.randn(n, hkv, d, generator=gen).to(dtype)
        v = torch.randn(n, hkv, dv, generator=gen).to(dtype)
        k_buf[s], v_buf[s] = k, v
        slots.append(s)
        ks.append(k)
        vs.append(v)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(lens).cumsum(0)
    indices = torch.cat(slots).to(torch.int32) if slots else torch.zeros(1, dtype=torch.int32)
    return k_buf, v_buf, indptr, indices, ks, vs
