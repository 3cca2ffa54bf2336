"""Registry entry of `trtllm_mha`: TensorRT-LLM's generated MHA kernels (paged decode and context) through
FlashInfer on Blackwell (compute capability 10.x). Import-light: no torch, no flashinfer at import time.

Never ran on hardware: no Blackwell GPU was available to this project. Everything around the two kernel calls
is tested on the CPU against a float64 stand-in of their documented semantics (README.md).
"""

from __future__ import annotations

from typing import Callable, Optional

from attn_core.contract.capabilities import ARCH_MHA, Capabilities, CudaGraphLevel, Feature
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.spec import BackendSpec
from attn_core.discovery.probes import first_reason
from attn_trtllm_mla.blackwell_probes import flashinfer_missing, needs_sm100

CAPABILITIES = Capabilities(
    devices=frozenset({"cuda"}),
    q_dtypes=frozenset({"bfloat16", "float16"}),
    kv_dtypes=frozenset({"bfloat16", "float16"}),
    archs=frozenset({ARCH_MHA}),
    head_dims=frozenset({64, 128}),
    page_sizes=frozenset({16, 32, 64}),
    forward_modes=frozenset(ForwardMode) - {ForwardMode.SPLIT_PREFILL},
    features=frozenset({Feature.SLIDING_WINDOW, Feature.SINKS}),
    cuda_graph=CudaGraphLevel.UNIFORM_BATCH,
    min_compute_capability=(10, 0),
    max_compute_capability=(10, 9),
)

UNVERIFIED = (
    "TensorRT-LLM's MHA decode/context kernels (through FlashInfer) never ran on hardware: verified only against "
    "a float64 stand-in of their documented semantics, not on a Blackwell GPU"
)


def probe(checks: tuple[Callable[[], Optional[str]], ...] = (needs_sm100, flashinfer_missing)) -> Optional[str]:
    """None when the backend can run here, else why not: no CUDA, not compute capability 10.x, no FlashInfer."""
    return first_reason(*checks)


SPEC = BackendSpec(
    name="trtllm_mha",
    summary="TensorRT-LLM MHA paged decode/context via FlashInfer on Blackwell (never ran on hardware)",
    capabilities=CAPABILITIES,
    distribution="attn-trtllm-mla",
    backend_class="attn_trtllm_mla.mha_backend:TrtllmMHABackend",
    priority=15,  # below flashinfer (20), which has run on a GPU: ask for trtllm_mha by name
    probe_fn=probe,
    unverified=UNVERIFIED,
)
