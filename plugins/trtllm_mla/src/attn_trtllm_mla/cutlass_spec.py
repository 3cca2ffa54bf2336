"""Registry entry of `cutlass_mla`: CUTLASS's MLA decode kernel for Blackwell (SM100) through sgl-kernel, DECODE
only (pair it with a prefill backend through `attn_core.wrappers.HybridAttnBackend`). Import-light: no torch,
no sgl_kernel at import time.

Never ran on hardware: no Blackwell GPU was available to this project. Everything around the kernel call is
tested on the CPU against a float64 stand-in of its documented semantics (README.md).
"""

from __future__ import annotations

from typing import Callable, Optional

from attn_core.contract.capabilities import ARCH_MLA, Capabilities, CudaGraphLevel
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.spec import BackendSpec
from attn_core.discovery.probes import first_reason
from attn_trtllm_mla.blackwell_probes import needs_sm100, sgl_kernel_missing

#: the one page size the CUTLASS MLA kernel is run with (sgl-kernel and SGLang: 128 tokens)
PAGE_SIZE = 128

CAPABILITIES = Capabilities(
    devices=frozenset({"cuda"}),
    q_dtypes=frozenset({"bfloat16", "float16"}),
    kv_dtypes=frozenset({"bfloat16", "float16"}),
    archs=frozenset({ARCH_MLA}),
    mla_head_dims=frozenset({512 + 64}),
    page_sizes=frozenset({PAGE_SIZE}),
    forward_modes=frozenset({ForwardMode.DECODE, ForwardMode.IDLE, ForwardMode.DUMMY_FIRST}),
    features=frozenset(),
    cuda_graph=CudaGraphLevel.UNIFORM_SINGLE_TOKEN_DECODE,
    min_compute_capability=(10, 0),
    max_compute_capability=(10, 9),
)

UNVERIFIED = (
    "the CUTLASS MLA decode kernel (through sgl-kernel) never ran on hardware: verified only against a float64 "
    "stand-in of its documented semantics, not on a Blackwell GPU"
)


def probe(checks: tuple[Callable[[], Optional[str]], ...] = (needs_sm100, sgl_kernel_missing)) -> Optional[str]:
    """None when the backend can run here, else why not: no CUDA, not compute capability 10.x, no sgl-kernel."""
    return first_reason(*checks)


SPEC = BackendSpec(
    name="cutlass_mla",
    summary="CUTLASS MLA decode (512 + 64, page 128) via sgl-kernel on Blackwell, DECODE only (never ran on hardware)",
    capabilities=CAPABILITIES,
    distribution="attn-trtllm-mla",
    backend_class="attn_trtllm_mla.cutlass_backend:CutlassMLABackend",
    priority=15,
    probe_fn=probe,
    unverified=UNVERIFIED,
)
