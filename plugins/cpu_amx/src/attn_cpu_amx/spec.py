"""Registry entry of attn-cpu-amx (import-light: no torch, no kernels; reads /proc/cpuinfo only)."""

from __future__ import annotations

from typing import Optional

from attn_core.contract.capabilities import ARCH_MHA, Capabilities, CudaGraphLevel, Feature
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.phases import PREFILL, PhasePriority
from attn_core.contract.spec import BackendSpec
from attn_core.discovery.probes import first_reason, module_missing
from attn_cpu_amx.isa import AVX512_FLAGS, requested_path

MAX_HEAD_DIM = 256

CAPABILITIES = Capabilities(
    devices=frozenset({"cpu"}),
    q_dtypes=frozenset({"bfloat16", "float32"}),
    kv_dtypes=frozenset({"bfloat16", "float32"}),
    archs=frozenset({ARCH_MHA}),
    head_dims=frozenset(range(16, MAX_HEAD_DIM + 1, 16)),
    page_sizes=frozenset({1, 2, 4, 8, 16, 32, 64, 128}),
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
    features=frozenset(
        {
            Feature.SLIDING_WINDOW,
            Feature.LOGIT_CAP,
            Feature.SINKS,
            Feature.CUSTOM_MASK,
            Feature.LSE_OUTPUT,
            Feature.MIXED_KV_DTYPE,
        }
    ),
    cuda_graph=CudaGraphLevel.NEVER,
    #: K/V read through their strides (page, token and head strides; power-of-two pages): attn's pools in
    #: either layout and engine-owned ones (`attn_core.memory.EngineKVPool`) in place
    kv_layouts=frozenset({"NHD", "HND"}),
    engine_kv_layouts=frozenset({"NHD", "HND"}),
)


#: where each phase should go (attn_core.discovery.selection), from `attn-core bench cpu_amx --vs torch_native`
#: (docs/dev/perf-notebook.md, "attn-cpu-amx by kernel path: which phases it should serve"): every path
#: decodes faster than torch_native (the spec's priority 20 stands); at bf16 prefill/extend the portable
#: C++ path (CPUs without AVX-512, or ATTN_CPU_AMX_ISA=portable) is slower than torch_native, the AVX-512
#: and AMX paths faster (float32 on the portable path measured faster than torch_native: it keeps 20)
_EVIDENCE = "docs/dev/perf-notebook.md, 'attn-cpu-amx by kernel path: which phases it should serve'"
PHASE_PRIORITIES = (
    PhasePriority(
        PREFILL,
        -10,
        _EVIDENCE + ": portable path, bf16, 0.15-0.54x torch_native on the extend/prefill rows",
        device="cpu",
        q_dtypes=frozenset({"bfloat16"}),
    ),
) + (
    ()
    if requested_path() == "portable"
    else (
        PhasePriority(
            PREFILL,
            20,
            _EVIDENCE + ": AVX-512 path 4.1-9.1x torch_native on the extend/prefill rows (AMX: 20.9-28.2x, issue 7)",
            device="cpu",
            cpu_isa=AVX512_FLAGS,
        ),
    )
)


def _build_tools() -> Optional[str]:
    from attn_cpu_amx import build

    return None if build.is_built() else build.missing_tools()


def _isa() -> Optional[str]:
    from attn_cpu_amx import isa

    return isa.choose_path(isa.requested_path())[1]


def probe() -> Optional[str]:
    """None when the backend can run here: torch importable, the kernels built or buildable (a C++
    compiler and ninja), and the requested ISA path (if forced) runnable on this CPU."""
    return first_reason(lambda: module_missing("torch", "pip install torch"), _build_tools, _isa)


def info() -> str:
    """CPU model, the AMX / AVX-512 flags found and the kernel path chosen."""
    from attn_cpu_amx import isa

    return isa.describe()


SPEC = BackendSpec(
    name="cpu_amx",
    summary="Paged CPU attention: AMX tiles for bf16 where present, AVX-512 or portable C++ otherwise",
    capabilities=CAPABILITIES,
    distribution="attn-cpu-amx",
    backend_class="attn_cpu_amx.backend:CpuAmxBackend",
    aliases=("intel_amx",),
    priority=20,
    phase_priorities=PHASE_PRIORITIES,
    probe_fn=probe,
    info_fn=info,
)
