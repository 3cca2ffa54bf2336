"""Every test of attn-ascend runs against the emulated torch_npu (`attn_ascend.testing.emulated_torch_npu`)
on CPU tensors: the module is installed in `sys.modules` for the whole session, and `EmulatedAscend`
is the real backend class declaring the CPU as the device it runs on (the only difference)."""

from __future__ import annotations

import dataclasses

import pytest

from attn_ascend.testing.emulated_torch_npu import installed


@pytest.fixture(scope="session", autouse=True)
def emulated_torch_npu():
    with installed("7.0.0") as mod:
        yield mod


def emulated_backend_class():
    """`AscendBackend` with "cpu" as its declared device: the test-only device shim."""
    from attn_ascend.backend import AscendBackend

    caps = dataclasses.replace(AscendBackend.capabilities, devices=frozenset({"cpu"}))
    return type("EmulatedAscend", (AscendBackend,), {"capabilities": caps, "__module__": __name__})
