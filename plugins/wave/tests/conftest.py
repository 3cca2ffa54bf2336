"""Every test of attn-wave runs against the emulated wave_lang (`attn_wave.testing.emulated_wave_lang`),
installed in `sys.modules` per test module (removed after each, so suites of other packages that share
the pytest process never see it), on CPU tensors; except `test_gpu.py`, which needs the real one."""

from __future__ import annotations

import pytest
from attn_wave.testing.emulated_wave_lang import installed


@pytest.fixture(scope="module", autouse=True)
def emulated_wave_lang(request):
    if request.module.__name__.rsplit(".", 1)[-1] == "test_gpu":  # the GPU tests use the real wave-lang
        yield None
        return
    with installed("full") as mods:
        yield mods
