"""Registry entry of attn-ascend (import-light: no torch, never torch_npu; the probe imports them only
when it runs)."""

from __future__ import annotations

import importlib.util
from typing import Optional

from attn_core.contract.capabilities import ARCH_MHA, ARCH_MLA, Capabilities, CudaGraphLevel
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.spec import BackendSpec

#: what `attn-core list` says about how far this backend is verified
UNVERIFIED = (
    "verified only against an emulation of the documented torch_npu operators (Ascend Extension for PyTorch "
    "6.0.0 / 7.0.0 signatures, CANN 8.x ATB), not on NPU hardware"
)
NEEDS = "needs torch_npu and an Ascend NPU (pip install attn-ascend[npu])"

CAPABILITIES = Capabilities(
    devices=frozenset({"npu"}),
    q_dtypes=frozenset({"bfloat16", "float16"}),
    kv_dtypes=frozenset({"bfloat16", "float16"}),
    archs=frozenset({ARCH_MHA, ARCH_MLA}),
    head_dims=frozenset({64, 128}),
    mla_head_dims=frozenset({576}),  # kv_lora_rank 512 + qk_rope_head_dim 64
    # attn-core's allocators hand out power-of-two pages; the paged operators take multiples of 16 up to 128
    page_sizes=frozenset({16, 32, 64, 128}),
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
    cuda_graph=CudaGraphLevel.UNIFORM_BATCH,  # NPU graph mode: DECODE and TARGET_VERIFY
)


def probe() -> Optional[str]:
    """None when torch_npu imports and sees an NPU; else why not (with the pip command)."""
    if importlib.util.find_spec("torch_npu") is None:
        return f"{NEEDS}; {UNVERIFIED}"
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)

        found = torch.npu.is_available()
    except Exception as exc:  # a broken CANN install must not break discovery of other backends
        return f"{NEEDS}: torch_npu failed to load ({type(exc).__name__}: {exc}); {UNVERIFIED}"
    return None if found else f"{NEEDS}: torch_npu sees no NPU; {UNVERIFIED}"


def info() -> str:
    """Shown next to "available": how far the backend is verified."""
    return UNVERIFIED


SPEC = BackendSpec(
    name="ascend",
    summary="Ascend NPU attention through torch_npu's paged-attention and fused-infer-attention operators",
    capabilities=CAPABILITIES,
    distribution="attn-ascend",
    backend_class="attn_ascend.backend:AscendBackend",
    priority=10,
    probe_fn=probe,
    info_fn=info,
)
