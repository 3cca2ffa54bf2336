"""Registry entry of the TensorRT-LLM MLA backend (`trtllm_mla`). Import-light: no torch, no flashinfer
at import time.

Unverified on hardware: no Blackwell GPU was available to this project. Everything around the kernel
calls (block tables, argument packing, scale folding, the ragged prefill's layouts and LSE conversion,
the probe) is tested on CPU; the kernel calls themselves have never run here (see README.md).
"""

from __future__ import annotations

from typing import Callable, Optional

from attn_core.contract.capabilities import ARCH_MLA, Capabilities, CudaGraphLevel
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.spec import BackendSpec
from attn_core.discovery.probes import first_reason, needs_cuda

#: The TensorRT-LLM MLA kernels run on these compute capability majors: 10 (SM100/SM103, trtllm-gen)
#: and 12 (SM120/SM121, XQA).
BLACKWELL_MAJORS = (10, 12)
#: Page (block) sizes the trtllm-gen MLA kernels take.
PAGE_SIZES = frozenset({32, 64})

#: Declared, unverified on hardware (README.md). bf16 only: the trtllm-gen kernels write bf16 output.
CAPABILITIES = Capabilities(
    devices=frozenset({"cuda"}),
    q_dtypes=frozenset({"bfloat16"}),
    kv_dtypes=frozenset({"bfloat16"}),
    archs=frozenset({ARCH_MLA}),
    mla_head_dims=frozenset({512 + 64}),
    page_sizes=PAGE_SIZES,
    forward_modes=frozenset(ForwardMode) - {ForwardMode.SPLIT_PREFILL},
    features=frozenset(),
    cuda_graph=CudaGraphLevel.UNIFORM_BATCH,
    min_compute_capability=(10, 0),
    max_compute_capability=(12, 9),
)

UNVERIFIED = "the SM100/SM120 TRT-LLM kernel paths (MLA decode, ragged DeepSeek prefill) have never run on hardware"


def blackwell_reason(capability: tuple[int, int]) -> Optional[str]:
    """None on a Blackwell GPU (compute capability 10.x or 12.x), else the reason naming what serves MLA.

    Example: blackwell_reason((9, 0)) -> "needs a Blackwell GPU (compute capability 10.x or 12.x),
    found 9.0; flashinfer_mla serves MLA here"; blackwell_reason((10, 0)) -> None."""
    if capability[0] in BLACKWELL_MAJORS:
        return None
    found = f"{capability[0]}.{capability[1]}"
    return f"needs a Blackwell GPU (compute capability 10.x or 12.x), found {found}; flashinfer_mla serves MLA here"


def _flashinfer_missing() -> Optional[str]:
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        return (
            "flashinfer-python not installed (pip install 'flashinfer-python>=0.6.6,<0.8'; a CUDA build of torch first)"
        )
    return None


def _device_capability() -> Optional[str]:
    import torch

    return blackwell_reason(torch.cuda.get_device_capability())


def probe(
    checks: tuple[Callable[[], Optional[str]], ...] = (needs_cuda, _device_capability, _flashinfer_missing),
) -> Optional[str]:
    """None when the backend can run here, else why not: no CUDA, not a Blackwell GPU, FlashInfer missing."""
    return first_reason(*checks)


SPEC = BackendSpec(
    name="trtllm_mla",
    summary=(
        "TensorRT-LLM MLA decode/verify and ragged DeepSeek prefill via FlashInfer on Blackwell "
        "(unverified on hardware); the rest via flashinfer_mla"
    ),
    capabilities=CAPABILITIES,
    distribution="attn-trtllm-mla",
    backend_class="attn_trtllm_mla.backend:TRTLLMMLABackend",
    priority=30,
    probe_fn=probe,
    unverified=UNVERIFIED,
)
