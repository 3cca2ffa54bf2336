"""The fixtures of the CPU wiring tests: `factory`, `FlashInferBackend` over `fake_flashinfer.py` (a float64
stand-in for FlashInfer's wrappers), allowed on the CPU, public plans only (`lean_replan=False`: the lean
re-plan reads FlashInfer's internals); `mla_factory`, `FlashInferMLABackend` over the stand-in's MLA
wrapper (lean by default: the stand-in models the MLA internals). The stand-in module is `<fixture>.fake`.
Tests using them skip where the real flashinfer is importable (their module's `pytestmark`)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pathlib

import pytest


def _over_the_stand_in():
    """`fake_flashinfer.installed()`: the stand-in as `flashinfer` while the block runs."""
    path = pathlib.Path(__file__).with_name("fake_flashinfer.py")
    spec = importlib.util.spec_from_file_location("fake_flashinfer_loader", path)
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    return loader.installed()


@pytest.fixture(scope="module")
def factory():
    """A FlashInferBackend subclass over the stand-in, allowed on the CPU."""
    with _over_the_stand_in() as fake:
        backend = importlib.import_module("attn_flashinfer.backend")

        class OnCpu(backend.FlashInferBackend):
            capabilities = dataclasses.replace(backend.CAPABILITIES, devices=frozenset({"cuda", "cpu"}))

            def __init__(self, ctx, **kw):
                super().__init__(ctx, lean_replan=False, workspace_bytes=1 << 20, **kw)

        OnCpu.fake = fake
        yield OnCpu


@pytest.fixture(scope="module")
def mla_factory():
    """A FlashInferMLABackend subclass over the stand-in's MLA wrapper, allowed on the CPU; its options
    (e.g. `lean_replan`, on by default here: the stand-in models the internals the lean path calls) go
    to the backend."""
    with _over_the_stand_in() as fake:
        mla_backend = importlib.import_module("attn_flashinfer.mla_backend")

        class MLAOnCpu(mla_backend.FlashInferMLABackend):
            capabilities = dataclasses.replace(mla_backend.CAPABILITIES, devices=frozenset({"cuda", "cpu"}))
            cpu_work_sms = fake.NUM_SM

            def __init__(self, ctx, lean_replan: bool = True, **kw):
                super().__init__(ctx, lean_replan=lean_replan, workspace_bytes=1 << 20, **kw)

        MLAOnCpu.fake = fake
        yield MLAOnCpu
