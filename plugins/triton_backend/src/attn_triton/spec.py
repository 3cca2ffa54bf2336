"""Registry entry of the Triton backend. Import-light: no torch, no triton at import time.

On CPU tensors the backend runs only under the Triton interpreter (`TRITON_INTERPRET=1`), which is how
CI tests it; otherwise it needs a CUDA or ROCm GPU.
"""

from __future__ import annotations

from typing import Optional

from attn_core.contract.capabilities import ARCH_MHA, ARCH_MLA, Capabilities, CudaGraphLevel, Feature
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.phases import DECODE, PhasePriority
from attn_core.contract.spec import BackendSpec
from attn_core.discovery.probes import gpu_device_present, module_missing, triton_interpreter_enabled

#: MHA head dims: any multiple of 8 up to 256 (masked to the next power of two in the kernels).
HEAD_DIMS = frozenset(range(8, 257, 8))
#: Absorbed-MLA latent widths kv_lora_rank + qk_rope_head_dim (multiples of 4 up to 512 + 64); the
#: backend also checks the two parts (rank <= 512, rope <= 64).
MLA_HEAD_DIMS = frozenset(range(8, 577, 4))

CAPABILITIES = Capabilities(
    devices=frozenset({"cuda", "cpu"}),
    q_dtypes=frozenset({"bfloat16", "float16", "float32"}),
    #: float8_e4m3fn: fp8 KV caches (per-layer k_scale / v_scale, docs/design.md §3.2); on CUDA it needs
    #: compute capability >= 8.9 (Triton's fp8e4nv), refused below at construction
    kv_dtypes=frozenset({"bfloat16", "float16", "float32", "float8_e4m3fn"}),
    archs=frozenset({ARCH_MHA, ARCH_MLA}),
    head_dims=HEAD_DIMS,
    mla_head_dims=MLA_HEAD_DIMS,
    page_sizes=None,
    forward_modes=frozenset(ForwardMode) - {ForwardMode.SPLIT_PREFILL},
    features=frozenset(
        {
            Feature.SLIDING_WINDOW,
            Feature.LOGIT_CAP,
            Feature.SINKS,
            Feature.CUSTOM_MASK,
            Feature.CROSS_ATTENTION,
            Feature.LSE_OUTPUT,
            Feature.SPEC_TOPK_GT1,
            Feature.DETERMINISTIC,
            Feature.CHUNKED_LOCAL_ATTENTION,
            Feature.SLIDING_WINDOW_POOL,
            Feature.CASCADE,
            Feature.RAGGED,
            Feature.NON_CAUSAL,
            Feature.BIDIRECTIONAL_SPAN,
        }
    ),
    cuda_graph=CudaGraphLevel.UNIFORM_BATCH,
    #: K/V addressed through page, token and head strides (`kernels.common.paged_strides`): attn's pools in
    #: either layout and engine-owned ones (`attn_core.memory.EngineKVPool`) read in place
    kv_layouts=frozenset({"NHD", "HND"}),
    engine_kv_layouts=frozenset({"NHD", "HND"}),
    #: the ragged op's varlen kernel (`kernels/ragged.py`): the same head dims, in one channel block padded
    #: to the next power of two (d72 / d80 / d96 of ViTs run as 128 channels, the extra ones masked)
    ragged_head_dims=HEAD_DIMS,
)


def probe() -> Optional[str]:
    """None when the backend can run here, else why not."""
    reason = module_missing("triton", "pip install triton") or module_missing("torch", "pip install torch")
    if reason:
        return reason
    if triton_interpreter_enabled():
        return None
    if not gpu_device_present():
        return (
            "needs a CUDA or ROCm GPU (none on this machine); CPU tensors run only under the Triton interpreter "
            "(set TRITON_INTERPRET=1)"
        )
    import torch

    if torch.cuda.is_available():
        return None
    build = (
        f"ROCm {torch.version.hip}"
        if torch.version.hip
        else (f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only")
    )
    return (
        f"needs a CUDA or ROCm GPU (torch {torch.__version__}, {build} build, sees no GPU); "
        "CPU tensors run only under the Triton interpreter (set TRITON_INTERPRET=1)"
    )


def info() -> str:
    """The Triton version and whether attn-core's cached launch of the index kernel is on (and why not)."""
    from attn_core.ops.triton_launch import cached_launch_status

    return f"cached index launch {cached_launch_status()}"


#: where each phase should go (attn_core.discovery.selection): on compute capability 9.0 attn-triton's MHA decode
#: is as fast as FlashInfer's or faster (0.933-1.004x its time, fp8 KV 0.872x), so decode comes here even with
#: attn-flashinfer installed (its priority 20); its prefill stays behind FlashInfer's and FA4's (0.875-0.885x
#: FlashInfer's rate), and MLA decode behind flashinfer_mla's at batch 64 and more (no entry for MLA)
PHASE_PRIORITIES = (
    PhasePriority(
        DECODE,
        25,
        "docs/performance.md, 'Kernels against FlashInfer': decode 0.933-1.004x FlashInfer's time, "
        "fp8 KV decode 0.872x (benchmarks/triton_vs_peers.py --only decode,extend,fp8)",
        device="cuda",
        min_compute_capability=(9, 0),
        max_compute_capability=(9, 0),
        archs=frozenset({ARCH_MHA}),
    ),
)

SPEC = BackendSpec(
    name="triton",
    summary="Paged-KV decode/extend attention in Triton: split-KV decode, MLA, spec verify, CUDA graphs",
    capabilities=CAPABILITIES,
    distribution="attn-triton",
    backend_class="attn_triton.backend:TritonAttnBackend",
    priority=10,
    phase_priorities=PHASE_PRIORITIES,
    probe_fn=probe,
    info_fn=info,
)
