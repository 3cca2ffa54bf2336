"""Every test of attn-ascend runs against the emulated torch_npu (`attn_ascend.testing.emulated_torch_npu`),
installed in `sys.modules` for the whole session, on CPU tensors."""

from __future__ import annotations

import pytest
from attn_ascend.testing.emulated_torch_npu import installed


@pytest.fixture(scope="session", autouse=True)
def emulated_torch_npu():
    with installed("7.0.0") as mod:
        yield mod
