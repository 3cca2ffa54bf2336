"""Every test of attn-ascend runs against the emulated torch_npu (`attn_ascend.testing.emulated_torch_npu`),
installed in `sys.modules` per test module (removed after each, so suites of other packages that share
the pytest process never see it), on CPU tensors."""

from __future__ import annotations

import pytest
from attn_ascend.testing.emulated_torch_npu import installed


@pytest.fixture(scope="module", autouse=True)
def emulated_torch_npu():
    with installed("7.0.0") as mod:
        yield mod
