"""Test setup: without a CUDA device the kernels run under the Triton interpreter.

TRITON_INTERPRET must be set before `triton.jit` decorates the kernels, i.e. before any attn_sparse kernel
module is imported; this file runs first. The repo runs pytest with --import-mode=importlib, so this folder
goes on sys.path for the shared helper module `sparse_engine`.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every `torch.empty` of the test comes back filled with garbage (NaN for floats, -7 for integers), so
    an output or scratch element a kernel forgets to write shows up in the results."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(-7)
        return t

    monkeypatch.setattr(torch, "empty", empty)
