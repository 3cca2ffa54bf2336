"""The interpreter's bounds guard (`interp_bounds.strict_bounds`) catches what a GPU traps: a load or store one
element past a tensor (masked-off elements excluded), and lets in-bounds accesses through."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from interp_bounds import strict_bounds
from triton_helpers import requires_interpreter

pytestmark = requires_interpreter


@triton.jit
def _copy_kernel(X, Y, n, extra, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ok = offs < n + extra
    tl.store(Y + offs, tl.load(X + offs, mask=ok, other=0.0), mask=ok)


def test_in_bounds_passes_and_masked_lanes_are_ignored():
    x, y = torch.arange(10, dtype=torch.float32), torch.zeros(10)
    with strict_bounds() as hits:
        _copy_kernel[(1,)](x, y, 10, 0, BLOCK=16)
    assert not hits and torch.equal(x, y)


def test_one_past_the_end_is_caught():
    big = torch.arange(64, dtype=torch.float32)
    x, y = big[:10].clone(), torch.zeros(10)
    with pytest.raises(AssertionError, match="_copy_kernel: load"):
        with strict_bounds():
            _copy_kernel[(1,)](x, y, 10, 1, BLOCK=16)
    with strict_bounds(raise_on_hit=False) as hits:
        _copy_kernel[(1,)](x, torch.zeros(10), 10, 1, BLOCK=16)
    assert any("load" in h for h in hits) and any("store" in h for h in hits)
