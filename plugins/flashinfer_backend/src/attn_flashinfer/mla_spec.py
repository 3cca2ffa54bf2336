"""Registry entry of the FlashInfer MLA backend (`flashinfer_mla`). Import-light: no torch, no flashinfer
at import time."""

from __future__ import annotations

from typing import Optional

from attn_core.contract.capabilities import ARCH_MLA, Capabilities, CudaGraphLevel, Feature
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.spec import BackendSpec
from attn_core.discovery.probes import first_reason, needs_compute_capability
from attn_flashinfer.spec import KNOWN_GAPS, MIN_COMPUTE_CAPABILITY, flashinfer_missing

#: DeepSeek's latent: kv_lora_rank 512 + qk_rope_head_dim 64 (the widths FlashInfer's MLA kernels build for).
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64

#: Absorbed MLA over the latent pool. No custom mask (FlashInfer's MLA wrapper has none): TARGET_VERIFY
#: runs chains (speculative topk 1) causally; tree masks (topk > 1) are refused. No sliding window,
#: logit cap or sinks. K/V (the latent) in the query's dtype.
CAPABILITIES = Capabilities(
    devices=frozenset({"cuda"}),
    q_dtypes=frozenset({"bfloat16", "float16"}),
    kv_dtypes=frozenset({"bfloat16", "float16"}),
    archs=frozenset({ARCH_MLA}),
    mla_head_dims=frozenset({KV_LORA_RANK + QK_ROPE_HEAD_DIM}),
    page_sizes=frozenset({1, 16, 32, 64}),
    forward_modes=frozenset(ForwardMode) - {ForwardMode.SPLIT_PREFILL},
    features=frozenset({Feature.LSE_OUTPUT}),
    cuda_graph=CudaGraphLevel.UNIFORM_BATCH,
    min_compute_capability=MIN_COMPUTE_CAPABILITY,
)


def probe() -> Optional[str]:
    """None when the backend can run here, else why not: FlashInfer missing, no CUDA, or a GPU older
    than compute capability 8.0."""
    return first_reason(flashinfer_missing, needs_compute_capability(MIN_COMPUTE_CAPABILITY))


SPEC = BackendSpec(
    name="flashinfer_mla",
    summary="FlashInfer's MLA paged wrapper (FA3 on SM90, FA2 on SM80): absorbed MLA decode/extend/verify, CUDA graphs",
    capabilities=CAPABILITIES,
    distribution="attn-flashinfer",
    backend_class="attn_flashinfer.mla_backend:FlashInferMLABackend",
    priority=20,
    probe_fn=probe,
    known_gaps=KNOWN_GAPS,  # none: the latent's value is cleaned on write as well (H200, 2026-11-29)
)
