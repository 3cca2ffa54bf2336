"""attn-core's conformance kit over the `triton` entry point: every check derived from the declared
capabilities (quick profile; CPU under the Triton interpreter, cuda on a GPU machine).

Two documented skips: bf16 under the interpreter, whose dot has no faithful bf16 (bf16 is checked by
the GPU suite, test_triton_gpu.py), and MHA at head_dim 576, which is declared only because absorbed
MLA's latent is 512 + 64 wide (Capabilities.head_dims is not per attention arch; MHA goes up to 256
and says so with UnsupportedFeatureError).
"""

from __future__ import annotations

import torch
from attn_core.testing import ConformanceSuite

SKIP = {"head_dim-576-*": "576 is declared for absorbed MLA (kv_lora_rank 512 + rope 64); MHA head dims go up to 256"}
if not torch.cuda.is_available():
    SKIP["dtype-bfloat16-*"] = "the Triton interpreter computes bf16 dots unfaithfully; bf16 runs in the GPU suite"


class TestTritonConformance(ConformanceSuite):
    backend = "triton"
    quick = True
    skip = SKIP
