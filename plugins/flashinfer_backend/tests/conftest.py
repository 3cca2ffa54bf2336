"""The `factory` fixture of the CPU wiring tests: `FlashInferBackend` over `fake_flashinfer.py` (a float64
stand-in for FlashInfer's wrappers), allowed on the CPU, public plans only (`lean_replan=False`: the lean
re-plan reads FlashInfer's internals). The stand-in module is `factory.fake`. Tests using it skip where
the real flashinfer is importable (their module's `pytestmark`)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pathlib
import sys

import pytest

_REPLACED = ("flashinfer", "flashinfer.cascade", "attn_flashinfer.plans", "attn_flashinfer.mixed", "attn_flashinfer.backend")


@pytest.fixture(scope="module")
def factory():
    """A FlashInferBackend subclass over the stand-in, allowed on the CPU; sys.modules restored after."""
    path = pathlib.Path(__file__).with_name("fake_flashinfer.py")
    spec = importlib.util.spec_from_file_location("fake_flashinfer", path)
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    saved = {name: sys.modules.pop(name, None) for name in _REPLACED}
    sys.modules["flashinfer"], sys.modules["flashinfer.cascade"] = fake, fake.cascade
    try:
        backend = importlib.import_module("attn_flashinfer.backend")

        class OnCpu(backend.FlashInferBackend):
            capabilities = dataclasses.replace(backend.CAPABILITIES, devices=frozenset({"cuda", "cpu"}))

            fake = sys.modules["flashinfer"]

            def __init__(self, ctx, **kw):
                super().__init__(ctx, lean_replan=False, workspace_bytes=1 << 20, **kw)

        yield OnCpu
    finally:
        package = sys.modules["attn_flashinfer"]
        for name in _REPLACED:
            sys.modules.pop(name, None)
            if saved[name] is not None:
                sys.modules[name] = saved[name]
            elif name.startswith("attn_flashinfer.") and hasattr(package, name.split(".")[1]):
                delattr(package, name.split(".")[1])  # a later import sees flashinfer missing again
