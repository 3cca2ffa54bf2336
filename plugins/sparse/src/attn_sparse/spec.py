"""Registry entries of attn-sparse's two backends. Import-light: no torch, no triton at import time.

Both backends run their own Triton kernels: on a CUDA GPU, or on CPU tensors under the Triton interpreter
(`TRITON_INTERPRET=1`), which is how CI tests them. Both rank below every dense backend (`priority` -10):
they change what a query attends to, so `select_backend` never picks one unless asked for by name.
"""

from __future__ import annotations

from typing import Optional

from attn_core.contract.capabilities import Capabilities, CudaGraphLevel, Feature
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.spec import BackendSpec
from attn_core.discovery.probes import gpu_device_present, module_missing, triton_interpreter_enabled

#: head dims the kernels are tested at (masked to the next power of two inside)
HEAD_DIMS = frozenset({32, 64, 96, 128, 256})

CAPABILITIES = Capabilities(
    devices=frozenset({"cuda", "cpu"}),
    q_dtypes=frozenset({"bfloat16", "float16", "float32"}),
    kv_dtypes=frozenset({"bfloat16", "float16", "float32"}),
    head_dims=HEAD_DIMS,
    page_sizes=None,
    forward_modes=frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.IDLE}),
    features=frozenset({Feature.LOGIT_CAP, Feature.LSE_OUTPUT}),
    cuda_graph=CudaGraphLevel.UNIFORM_SINGLE_TOKEN_DECODE,
)


INTERPRETER_NOTE = "CPU tensors run only under the Triton interpreter"


def probe() -> Optional[str]:
    """None when the kernels can run here (a CUDA GPU, or the Triton interpreter), else why not."""
    reason = module_missing("triton", "pip install attn-sparse") or module_missing("torch", "pip install torch")
    if reason:
        return reason
    if triton_interpreter_enabled():
        return None
    if not gpu_device_present():
        return f"needs a CUDA GPU (none on this machine); {INTERPRETER_NOTE} (set TRITON_INTERPRET=1)"
    import torch

    if torch.cuda.is_available() and not torch.version.hip:
        return None
    build = (
        f"ROCm {torch.version.hip}"
        if torch.version.hip
        else (f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only")
    )
    return f"needs a CUDA GPU (torch {torch.__version__}, {build} build); {INTERPRETER_NOTE}"


DOUBLE_SPARSITY = BackendSpec(
    name="double_sparsity",
    summary="Double sparsity: decode over the top-k keys scored by a heavy-channel label cache (dense when short)",
    capabilities=CAPABILITIES,
    distribution="attn-sparse",
    backend_class="attn_sparse.double_sparsity.backend:DoubleSparsityBackend",
    priority=-10,
    probe_fn=probe,
)

DUAL_CHUNK = BackendSpec(
    name="dual_chunk",
    summary="Dual chunk attention (Qwen2.5-1M): intra / successive / inter chunk parts merged by LSE",
    capabilities=CAPABILITIES,
    distribution="attn-sparse",
    backend_class="attn_sparse.dual_chunk.backend:DualChunkBackend",
    priority=-10,
    probe_fn=probe,
)
