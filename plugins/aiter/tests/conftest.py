"""Every test of attn-aiter runs against the emulated AITER (`attn_aiter.testing.emulated_aiter`),
installed in `sys.modules` per test module (removed after each, so suites of other packages that share
the pytest process never see it), on CPU tensors; except `test_gpu.py`, which needs the real one."""

from __future__ import annotations

import pytest
from attn_aiter.testing.emulated_aiter import installed


@pytest.fixture(scope="module", autouse=True)
def emulated_aiter(request):
    if request.module.__name__.rsplit(".", 1)[-1] == "test_gpu":  # the GPU tests use the real AITER
        yield None
        return
    with installed("current") as mod:
        yield mod
