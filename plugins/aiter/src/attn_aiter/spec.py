"""Registry entry of attn-aiter (import-light: no torch, never aiter; the probe imports them only on a
machine with an AMD GPU device).

Never ran on hardware: no AMD GPU was available to this project. See README.md for what was verified
(against an emulation of AITER's documented operators, on the CPU) and what only an AMD GPU can settle.
"""

from __future__ import annotations

import importlib.util
from typing import Callable, Optional

from attn_core.contract.capabilities import ARCH_MHA, ARCH_MLA, Capabilities, CudaGraphLevel
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.spec import BackendSpec
from attn_core.discovery.probes import first_reason, needs_rocm

#: what `attn-core list` says about how far this backend is verified
UNVERIFIED = (
    "its AITER calls never ran on hardware: verified only against an emulation of AITER's documented operators "
    "(paged_attention_ragged, flash_attn_varlen_func, mla_decode_fwd, mla_prefill_fwd), not on an AMD GPU"
)
#: the install command (AITER is the `amd-aiter` package on PyPI; its import name is `aiter`)
INSTALL = "pip install 'attn-aiter[rocm]'"
NOT_INSTALLED = f"not installed: {INSTALL} (AMD's AITER, the amd-aiter package)"

CAPABILITIES = Capabilities(
    devices=frozenset({"cuda"}),  # ROCm builds of torch name AMD GPUs "cuda"
    q_dtypes=frozenset({"bfloat16", "float16"}),
    kv_dtypes=frozenset({"bfloat16", "float16"}),
    archs=frozenset({ARCH_MHA, ARCH_MLA}),
    head_dims=frozenset({64, 128}),
    mla_head_dims=frozenset({576}),  # kv_lora_rank 512 + qk_rope_head_dim 64
    # the paged decode kernel's documented block sizes (16, 32) and page size 1; MLA reads any page size
    page_sizes=frozenset({1, 16, 32}),
    forward_modes=frozenset(
        {
            ForwardMode.EXTEND,
            ForwardMode.DECODE,
            ForwardMode.MIXED,
            ForwardMode.IDLE,
            ForwardMode.TARGET_VERIFY,
            ForwardMode.DRAFT_EXTEND,
            ForwardMode.DUMMY_FIRST,
        }
    ),
    features=frozenset(),
    cuda_graph=CudaGraphLevel.UNIFORM_SINGLE_TOKEN_DECODE,
)


def aiter_missing() -> Optional[str]:
    """None when AMD's AITER imports with the operators attn-aiter calls, else why not (with the pip
    command). PyPI's unrelated `aiter` package (async iterators) is told apart by its missing operators."""
    if importlib.util.find_spec("aiter") is None:
        return NOT_INSTALLED
    from attn_aiter.aiter_ops import missing_operators

    missing = missing_operators()
    return None if not missing else f"{missing}; {NOT_INSTALLED}"


def probe(checks: tuple[Callable[[], Optional[str]], ...] = (needs_rocm, aiter_missing)) -> Optional[str]:
    """None when the backend can run here, else why not: no AMD GPU under a ROCm torch, AITER missing."""
    return first_reason(*checks)


def info() -> str:
    """Shown next to "available": how far the backend is verified."""
    return UNVERIFIED


SPEC = BackendSpec(
    name="aiter",
    summary="AMD AITER kernels: paged decode, varlen prefill, MLA decode/prefill (never ran on an AMD GPU)",
    capabilities=CAPABILITIES,
    distribution="attn-aiter",
    backend_class="attn_aiter.backend:AiterBackend",
    priority=5,  # below attn-triton, which serves ROCm too: ask for aiter by name
    probe_fn=probe,
    info_fn=info,
    unverified=UNVERIFIED,
)
