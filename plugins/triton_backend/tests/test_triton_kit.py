"""attn-core's conformance kit over the `triton` entry point: every check derived from the declared
capabilities (quick profile; CPU under the Triton interpreter, cuda on a GPU machine).

One documented skip: bf16 under the interpreter, whose dot has no faithful bf16 (bf16 is checked by
the GPU suite, test_triton_gpu.py).
"""

from __future__ import annotations

import torch

from attn_core.testing import ConformanceSuite

SKIP = {}
if not torch.cuda.is_available():
    SKIP["dtype-bfloat16-*"] = "the Triton interpreter computes bf16 dots unfaithfully; bf16 runs in the GPU suite"


class TestTritonConformance(ConformanceSuite):
    backend = "triton"
    quick = True
    skip = SKIP
