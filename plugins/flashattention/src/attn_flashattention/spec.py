"""Registry entry of attn-flashattention (`fa4`). Import-light: no torch, never flash_attn; the probe
imports torch only where a GPU device node exists.

What is declared is what FlashAttention-4's forward (`flash_attn.cute.flash_attn_varlen_func`,
flash-attn-4 4.0.0b36) does on its SM90 path, read from its source (README.md, "What FA4 takes"):
bf16/fp16 queries and K/V of one dtype (its fp8 path is SM100 only), head dims multiples of 8 up to 256
(64, 128, 256 declared and tested), GQA/MQA, paged K/V through `page_table` at any page size (pages
other than its key tile are read row by row: 1..64 declared; a page of exactly one tile is read whole by
TMA, including rows past a request's end, which attn's pools do not promise to keep finite), causal
and non-causal, sliding windows, logit soft-cap, per-head sinks (`learnable_sink`), natural-log LSE.
Tree masks are served as one key list per query (`keys.tree_key_lists`), not through `mask_mod`.
"""

from __future__ import annotations

from importlib import metadata
from typing import Optional

from attn_core.contract.capabilities import ARCH_MHA, Capabilities, CudaGraphLevel, Feature
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.phases import PhasePriority
from attn_core.contract.spec import BackendSpec
from attn_core.discovery.probes import first_reason, needs_cuda

DISTRIBUTION = "flash-attn-4"
#: flash-attn-4 releases this plugin was run against on a GPU (docs/dev/gpu-runs.md)
VERIFIED_VERSIONS = frozenset({"4.0.0b36"})
#: the page sizes declared: FA4 reads a page that is not exactly one key tile (128 keys at head dim <= 128
#: on SM90) row by row, and only the rows below a request's length (`keys.py`, README.md)
PAGE_SIZES = frozenset({1, 2, 4, 8, 16, 32, 64})

CAPABILITIES = Capabilities(
    devices=frozenset({"cuda"}),
    q_dtypes=frozenset({"bfloat16", "float16"}),
    kv_dtypes=frozenset({"bfloat16", "float16"}),
    archs=frozenset({ARCH_MHA}),
    head_dims=frozenset({64, 128, 256}),
    page_sizes=PAGE_SIZES,
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
        }
    ),
    cuda_graph=CudaGraphLevel.UNIFORM_BATCH,
    min_compute_capability=(9, 0),
    max_compute_capability=(10, 9),
)

#: where each phase should go, from measurements (attn_core.discovery.selection): FA4 is the fastest prefill kernel
#: attn can run on compute capability 9.0, and slower than attn-triton at decode (no split-KV on SM90), so
#: its own priority (5) stays under attn-triton's (10) and FlashInfer's (20)
PHASE_PRIORITIES = (
    PhasePriority(
        "prefill",
        40,
        "docs/dev/perf-notebook.md, 'attn-flashattention (FlashAttention-4) against its peers': extend/prefill "
        "rows 466-528 TFLOP/s against FlashInfer's 424-484 and attn-triton's 396-449 on an H100",
        device="cuda",
        min_compute_capability=(9, 0),
        max_compute_capability=(9, 0),
    ),
)

UNVERIFIED = "the compute capability 10.x (Blackwell) path has never run on hardware"


def fa4_missing() -> Optional[str]:
    """ "not installed: pip install flash-attn-4" when the flash-attn-4 distribution is absent (read from
    its metadata: flash_attn itself is never imported here), else None."""
    try:
        metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return f"not installed: pip install {DISTRIBUTION}"
    return None


def supported_capability(capability: tuple[int, int]) -> Optional[str]:
    """None for compute capability 9.0 or 10.x, else the reason.

    Example: supported_capability((8, 9)) == "needs compute capability 9.0 or 10.x, found 8.9";
    supported_capability((9, 0)) is None; supported_capability((10, 3)) is None."""
    if tuple(capability) == (9, 0) or capability[0] == 10:
        return None
    return f"needs compute capability 9.0 or 10.x, found {capability[0]}.{capability[1]}"


def _device_capability() -> Optional[str]:
    import torch

    return supported_capability(tuple(torch.cuda.get_device_capability()))


def probe() -> Optional[str]:
    """None when the backend can run here, else why not: flash-attn-4 missing, no CUDA, or a GPU other
    than compute capability 9.0 / 10.x."""
    return first_reason(fa4_missing, needs_cuda, _device_capability)


def info() -> str:
    """The installed flash-attn-4 version and whether it is one this plugin was verified with."""
    version = metadata.version(DISTRIBUTION)
    return f"flash-attn-4 {version}" + (
        "" if version in VERIFIED_VERSIONS else f" (verified: {', '.join(sorted(VERIFIED_VERSIONS))})"
    )


#: where FA4's kernels break a rule of the contract that the plugin cannot repair around them
#: (`BackendSpec.known_gaps`).
#: FA4 multiplies a masked key's V by its probability 0 (0 * Inf = NaN). K/V written through attn store a
#: non-finite value as K = NaN, V = 0 (`attn_core.ops.kv_write.clean_nonfinite`), so the same-step cases pass
#: (H200, 2026-11-29); what is left is a value put into the pool around attn's write
MASKED_VALUES_WHY = (
    "FA4 4.0.0b36's SM90 kernel multiplies a masked key's V by its probability 0 (0 * Inf = NaN): an Inf/NaN put "
    "into the pool around attn's K/V write, in a key outside a sliding window that shares a tile with visible "
    "ones, reaches queries that must not see it (H200, 2026-11-29; docs/engine-authors.md, 'Known gaps')"
)
KNOWN_GAPS = (("masked_nonfinite-window-DECODE", MASKED_VALUES_WHY),)

SPEC = BackendSpec(
    name="fa4",
    summary=(
        "FlashAttention-4 (CuTe DSL) over paged KV: varlen prefill/extend/decode, tree verify, CUDA graphs (Hopper)"
    ),
    capabilities=CAPABILITIES,
    distribution="attn-flashattention",
    backend_class="attn_flashattention.backend:FlashAttention4Backend",
    priority=5,
    probe_fn=probe,
    info_fn=info,
    unverified=UNVERIFIED,
    phase_priorities=PHASE_PRIORITIES,
    known_gaps=KNOWN_GAPS,
)
