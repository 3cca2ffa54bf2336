"""Test setup: without a CUDA device the kernels run under the Triton interpreter.

TRITON_INTERPRET must be set before `triton.jit` decorates the kernels, i.e. before `attn_triton.backend`
(or any kernel module) is imported; this file runs first. The repo runs pytest with
--import-mode=importlib, so this folder goes on sys.path for the shared `triton_helpers` module.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
