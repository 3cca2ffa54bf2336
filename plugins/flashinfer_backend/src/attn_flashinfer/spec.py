"""Registry entry of the FlashInfer backend. Import-light: no torch, no flashinfer at import time."""

from __future__ import annotations

import importlib.util
from typing import Optional

from attn_core.contract.capabilities import ARCH_MHA, Capabilities, CudaGraphLevel, Feature
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.spec import BackendSpec
from attn_core.discovery.probes import first_reason, needs_compute_capability

#: FlashInfer's FA2 kernels need Ampere or newer.
MIN_COMPUTE_CAPABILITY = (8, 0)

#: Declared = verified on a GPU against the float64 reference (docs/dev/gpu-runs.md). K/V in the query's
#: dtype (no `Feature.MIXED_KV_DTYPE`: the base class refuses a mix), or an fp8 (float8_e4m3fn) cache
#: with per-layer k_scale / v_scale under either q dtype (FlashInfer's fp8 decode / paged prefill paths;
#: `attn_flashinfer.fp8`; tests/test_gpu.py's fp8 checks).
#: `Feature.SLIDING_WINDOW_POOL` (window layers read their keys as window slots: `window_kv.py`) and
#: `Feature.CHUNKED_LOCAL_ATTENTION` (virtual requests: `local_kv.py`; tests/test_gpu.py's window_pool /
#: chunked_local checks). All verified on an H100 (docs/dev/gpu-runs.md, 2026-11-23).
#: `Feature.RAGGED` (the ragged op on the ragged prefill wrapper, `ragged.py`; head dims that are not 64 /
#: 128 / 256 zero-padded to the next of them), `Feature.NON_CAUSAL` (encoder-only layers: non-causal ragged /
#: paged plans) and `Feature.BIDIRECTIONAL_SPAN` (one paged pass under the spans' custom mask): checked on the
#: CPU through tests/fake_flashinfer.py (FlashInfer's documented semantics); the GPU kit (tests/test_gpu.py)
#: runs their checks on a GPU.
CAPABILITIES = Capabilities(
    devices=frozenset({"cuda"}),
    q_dtypes=frozenset({"bfloat16", "float16"}),
    kv_dtypes=frozenset({"bfloat16", "float16", "float8_e4m3fn"}),
    archs=frozenset({ARCH_MHA}),
    head_dims=frozenset({64, 128, 256}),
    page_sizes=None,
    forward_modes=frozenset(ForwardMode) - {ForwardMode.SPLIT_PREFILL},
    features=frozenset(
        {
            Feature.SLIDING_WINDOW,
            Feature.LOGIT_CAP,
            Feature.CUSTOM_MASK,
            Feature.CROSS_ATTENTION,
            Feature.LSE_OUTPUT,
            Feature.SPEC_TOPK_GT1,
            Feature.SLIDING_WINDOW_POOL,
            Feature.CHUNKED_LOCAL_ATTENTION,
            Feature.RAGGED,
            Feature.NON_CAUSAL,
            Feature.BIDIRECTIONAL_SPAN,
        }
    ),
    cuda_graph=CudaGraphLevel.UNIFORM_BATCH,
    kv_layouts=frozenset(
        {"NHD", "HND"}
    ),  # HND: verified on the GPU only (the kit's kv_layout-HND checks in tests/test_gpu.py)
    #: engine-owned pools (`attn_core.memory.EngineKVPool`): FlashInfer reads paged K/V through the buffers'
    #: strides (K and V strides equal, as every fused engine cache has them); verified on the GPU only
    engine_kv_layouts=frozenset({"NHD", "HND"}),
    min_compute_capability=MIN_COMPUTE_CAPABILITY,
    ragged_head_dims=frozenset(range(8, 257, 8)),
)


def flashinfer_missing() -> Optional[str]:
    """Reason when the `flashinfer` package (distribution flashinfer-python) cannot be imported."""
    if importlib.util.find_spec("flashinfer") is None:
        return (
            "flashinfer-python not installed (pip install 'flashinfer-python>=0.6.6,<0.8'; a CUDA build of torch first)"
        )
    return None


def probe() -> Optional[str]:
    """None when the backend can run here, else why not: FlashInfer missing, no CUDA, or a GPU older
    than compute capability 8.0."""
    return first_reason(flashinfer_missing, needs_compute_capability(MIN_COMPUTE_CAPABILITY))


#: where FlashInfer's kernels break a rule of the contract that the plugin cannot repair around them
#: (`BackendSpec.known_gaps`): none. Its prefill kernels multiply a masked key's V by its probability 0, so an
#: Inf / NaN there would reach queries that do not see it; attn's K/V write stores such a value as K = NaN,
#: V = 0 (`attn_core.ops.kv_write.clean_nonfinite`), in the pool and, for the ragged pass that reads the new
#: tokens from k and v, in those too (`save_kv(..., clean_inputs=True)`), so nothing reaches them (H200,
#: 2026-11-29, `tests/test_masked_values_gpu.py`)
KNOWN_GAPS: tuple[tuple[str, str], ...] = ()

SPEC = BackendSpec(
    name="flashinfer",
    summary=(
        "FlashInfer paged decode/prefill wrappers: GQA tensor-core decode, ragged+paged extend, tree verify, "
        "CUDA graphs"
    ),
    capabilities=CAPABILITIES,
    distribution="attn-flashinfer",
    backend_class="attn_flashinfer.backend:FlashInferBackend",
    priority=20,
    probe_fn=probe,
    known_gaps=KNOWN_GAPS,
)
