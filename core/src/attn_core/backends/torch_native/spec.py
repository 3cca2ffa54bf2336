"""Registry entry of the reference backend (import-light: no torch)."""

from attn_core.contract.capabilities import ARCH_MHA, ARCH_MLA, Capabilities, CudaGraphLevel, Feature
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.spec import BackendSpec
from attn_core.discovery.probes import module_missing

CAPABILITIES = Capabilities(
    devices=frozenset({"cpu", "cuda"}),
    q_dtypes=frozenset({"float32", "bfloat16", "float16"}),
    kv_dtypes=frozenset({"float32", "bfloat16", "float16", "float8_e4m3fn"}),
    archs=frozenset({ARCH_MHA, ARCH_MLA}),
    head_dims=None,
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
            Feature.CHUNKED_LOCAL_ATTENTION,
            Feature.SLIDING_WINDOW_POOL,
            Feature.CASCADE,
            Feature.MIXED_KV_DTYPE,
            Feature.RAGGED,
            Feature.NON_CAUSAL,
            Feature.BIDIRECTIONAL_SPAN,
        }
    ),
    cuda_graph=CudaGraphLevel.UNIFORM_BATCH,
    kv_layouts=frozenset({"NHD", "HND"}),
    engine_kv_layouts=frozenset({"NHD", "HND"}),  # reads / writes by slot through any strides (token_rows, index_put)
)

SPEC = BackendSpec(
    name="torch_native",
    summary="Reference attention in plain torch (CPU and CUDA); the embedded default and the oracle",
    capabilities=CAPABILITIES,
    distribution="attn-core",
    backend_class="attn_core.backends.torch_native.backend:TorchNativeBackend",
    priority=0,
    probe_fn=lambda: module_missing("torch", "pip install torch"),
)
