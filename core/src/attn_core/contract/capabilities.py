"""What a backend can do (`Capabilities`) and what a model asks for (`Requirements`).

Both are plain data, torch-free, so the registry can match them without importing any kernel.
Dtypes are named by their torch attribute name ("bfloat16", "float16", "float32", "float8_e4m3fn").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from attn_core.contract.forward_mode import ForwardMode


class Feature(str, enum.Enum):
    """Optional behaviours a backend may declare."""

    SLIDING_WINDOW = "sliding_window"
    LOGIT_CAP = "logit_cap"
    SINKS = "sinks"
    CUSTOM_MASK = "custom_mask"
    CROSS_ATTENTION = "cross_attention"
    LSE_OUTPUT = "lse_output"
    SPEC_TOPK_GT1 = "spec_topk>1"
    DETERMINISTIC = "deterministic"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    SLIDING_WINDOW_POOL = "sliding_window_pool"  # window layers served from a SlidingWindowKVPool
    CASCADE = "cascade"  # ForwardBatch.cascade_prefix_len served as prefix + suffix passes (else ignored: same result)
    #: a KV cache dtype other than the query dtype (e.g. bf16 queries over an fp32 cache) computed right;
    #: without it a context whose kv_dtype differs from its dtype is refused at construction (an fp8 KV
    #: dtype, `FP8_KV_DTYPES`, needs no such flag: declaring it in kv_dtypes means reading it under every
    #: declared q dtype)
    MIXED_KV_DTYPE = "mixed_kv_dtype"
    #: the ragged, non-paged op `AttentionBackend.ragged_attention` (packed q/k/v with cu_seqlens, each
    #: sequence attending only within itself: vision towers, encoders), at the head dims of
    #: `Capabilities.ragged_head_dims`; undeclared, the op raises `UnsupportedFeatureError`
    RAGGED = "ragged"
    #: encoder-only layers (`AttentionLayer(attn_type="encoder_only")`): every query of a request sees
    #: every key of its request in the step, the paged path's causal mask off
    NON_CAUSAL = "non_causal"
    #: per-request bidirectional spans (`ForwardBatch.bidirectional_spans`) on
    #: `AttentionLayer(attn_type="decoder_bidirectional")` layers: positions [a, b) see each other
    BIDIRECTIONAL_SPAN = "bidirectional_span"

    def __str__(self) -> str:
        return self.value


class CudaGraphLevel(enum.IntEnum):
    """How much of a step a backend can run inside a captured CUDA graph (higher includes lower)."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1  # DECODE batches
    UNIFORM_BATCH = 2  # DECODE and TARGET_VERIFY (same token count per request)
    ALWAYS = 3  # any batch, extend included

    def covers(self, mode: ForwardMode) -> bool:
        """Whether a graph of this level may run a step of `mode`."""
        if mode.is_no_tokens():
            return self >= CudaGraphLevel.UNIFORM_SINGLE_TOKEN_DECODE
        if mode.is_decode():
            return self >= CudaGraphLevel.UNIFORM_SINGLE_TOKEN_DECODE
        if mode.is_target_verify():
            return self >= CudaGraphLevel.UNIFORM_BATCH
        return self >= CudaGraphLevel.ALWAYS


ALL_MODES = frozenset(ForwardMode)
ARCH_MHA = "mha"
ARCH_MLA = "mla"
#: KV dtypes stored as fp8 with per-layer k_scale / v_scale (docs/design.md §3.2; `attn_core.memory.fp8`)
FP8_KV_DTYPES = frozenset({"float8_e4m3fn"})


@dataclass(frozen=True)
class Requirements:
    """What one model on one device needs from a backend. Built by `BackendContext.requirements()`
    or by hand (the `explain` command does) without torch.

    - `device_type`: "cpu", "cuda", "npu" ... (`torch.device.type`).
    - `compute_capability`: (major, minor) of the CUDA device, or None (not CUDA, or unknown).
    - `cpu_flags`: the CPU's ISA flags (`attn_core.discovery.probes.cpu_flags`) on a CPU device, else None.
    - `q_dtype` / `kv_dtype`: dtype names as `dtype_name` spells them ("bfloat16", "float8_e4m3fn").
    - `head_dim`: q/k channels per head (MLA: the latent width); `page_size`: KV slots per page.
    - `arch`: "mha" or "mla"; `kv_layout`: the KV pool's layout, "NHD" or "HND".
    - `features` / `forward_modes` / `cuda_graph`: what the engine will ask for.

    Example: `Requirements(device_type="cuda", compute_capability=(9, 0), head_dim=128, page_size=16)`.
    """

    device_type: str = "cpu"
    compute_capability: Optional[tuple[int, int]] = None
    cpu_flags: Optional[frozenset[str]] = None
    q_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    head_dim: int = 128
    page_size: int = 1
    arch: str = ARCH_MHA
    features: frozenset[Feature] = frozenset()
    forward_modes: frozenset[ForwardMode] = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE})
    cuda_graph: CudaGraphLevel = CudaGraphLevel.NEVER
    kv_layout: str = "NHD"
    #: the KV pool wraps tensors the engine allocated (`attn_core.memory.EngineKVPool`: strided views, any
    #: strides with the last dimension contiguous) instead of attn's own dense buffers
    engine_kv: bool = False


@dataclass(frozen=True)
class Capabilities:
    """Class-level data describing a backend. `None` in head_dims / mla_head_dims / page_sizes means
    any value. `head_dims` applies to MHA (q/k head_dim); `mla_head_dims` to MLA's latent width
    (kv_lora_rank + qk_rope_head_dim). `kv_layouts`: the KV pool layouts read ("NHD", "HND": see
    `attn_core.memory.pools`). `ragged_head_dims`: the head dims the ragged op (`Feature.RAGGED`) serves
    (None = any); a context that asks for the ragged op alone (`Feature.RAGGED` and no forward mode: a
    vision tower) is matched on these instead of `head_dims`. `engine_kv_layouts`: the layouts in which the
    backend reads and writes an engine-owned KV pool (`attn_core.memory.EngineKVPool`: K and V as strided
    views of tensors the engine allocated, e.g. halves of one fused tensor) in place, taking the buffers'
    strides as they are.

    The other fields: `devices` (device types served, e.g. {"cuda"}), `q_dtypes` / `kv_dtypes` (dtype
    names, as `dtype_name` spells them), `archs` ("mha", "mla"), `forward_modes` and `features` served,
    `cuda_graph` (the `CudaGraphLevel` supported), `min_compute_capability` / `max_compute_capability`
    ((major, minor) bounds on CUDA, None: no bound) and `cpu_isa` (CPU flags every one of which a CPU
    device must have)."""

    devices: frozenset[str]
    q_dtypes: frozenset[str]
    kv_dtypes: frozenset[str]
    archs: frozenset[str] = frozenset({ARCH_MHA})
    head_dims: Optional[frozenset[int]] = None
    page_sizes: Optional[frozenset[int]] = None
    mla_head_dims: Optional[frozenset[int]] = None
    forward_modes: frozenset[ForwardMode] = ALL_MODES - {ForwardMode.SPLIT_PREFILL}
    features: frozenset[Feature] = frozenset()
    cuda_graph: CudaGraphLevel = CudaGraphLevel.NEVER
    min_compute_capability: Optional[tuple[int, int]] = None
    max_compute_capability: Optional[tuple[int, int]] = None
    cpu_isa: frozenset[str] = field(default_factory=frozenset)
    kv_layouts: frozenset[str] = frozenset({"NHD"})
    ragged_head_dims: Optional[frozenset[int]] = None
    engine_kv_layouts: frozenset[str] = frozenset()

    def supports(self, feature: Feature) -> bool:
        return feature in self.features

    def mismatches(self, req: Requirements, layout_only: bool = False) -> list[str]:
        """Every reason this backend cannot serve `req` (empty when it can). `layout_only` checks only
        what a context fixes (device, dtypes, head dim, page size, arch, KV layout, a sliding-window KV
        pool), not modes, features or graphs."""
        out: list[str] = []
        if req.device_type not in self.devices:
            out.append(f"device {req.device_type!r} not in {sorted(self.devices)}")
        if req.device_type == "cuda" and req.compute_capability is not None:
            cc = tuple(req.compute_capability)
            if self.min_compute_capability and cc < tuple(self.min_compute_capability):
                out.append(f"needs compute capability >= {_cc(self.min_compute_capability)}, found {_cc(cc)}")
            if self.max_compute_capability and cc > tuple(self.max_compute_capability):
                out.append(f"needs compute capability <= {_cc(self.max_compute_capability)}, found {_cc(cc)}")
        if req.device_type == "cpu" and self.cpu_isa and req.cpu_flags is not None:
            missing = sorted(self.cpu_isa - req.cpu_flags)
            if missing:
                out.append(f"needs CPU features {missing}")
        if req.q_dtype not in self.q_dtypes:
            out.append(f"q dtype {req.q_dtype} not in {sorted(self.q_dtypes)}")
        if req.kv_dtype not in self.kv_dtypes:
            out.append(f"KV dtype {req.kv_dtype} not in {sorted(self.kv_dtypes)}")
        if (
            req.kv_dtype != req.q_dtype
            and req.kv_dtype not in FP8_KV_DTYPES
            and Feature.MIXED_KV_DTYPE not in self.features
        ):
            out.append(
                f"KV dtype {req.kv_dtype} with q dtype {req.q_dtype}: mixed dtypes not supported "
                f"({Feature.MIXED_KV_DTYPE.value})"
            )
        dims = self.mla_head_dims if req.arch == ARCH_MLA else self.head_dims
        ragged = Feature.RAGGED in req.features
        paged = bool(req.forward_modes) or not ragged  # a ragged-only context has no pages, layout or paged head dims
        if dims is not None and req.head_dim not in dims and paged:
            out.append(f"{req.arch} head_dim {req.head_dim} not in {_ranges(dims)}")
        if ragged and Feature.RAGGED in self.features and self.ragged_head_dims is not None:
            if req.head_dim not in self.ragged_head_dims:
                out.append(f"ragged head_dim {req.head_dim} not in {_ranges(self.ragged_head_dims)}")
        if self.page_sizes is not None and req.page_size not in self.page_sizes and paged:
            out.append(f"page_size {req.page_size} not in {sorted(self.page_sizes)}")
        if req.arch not in self.archs:
            out.append(f"attention arch {req.arch!r} not in {sorted(self.archs)}")
        if req.kv_layout not in self.kv_layouts and paged:
            out.append(f"kv_layout {req.kv_layout} not in {sorted(self.kv_layouts)}")
        if req.engine_kv and req.kv_layout not in self.engine_kv_layouts:
            out.append(
                f"an engine-owned KV pool in layout {req.kv_layout} "
                f"(engine_kv_layouts {sorted(self.engine_kv_layouts)})"
            )
        if Feature.SLIDING_WINDOW_POOL in req.features and Feature.SLIDING_WINDOW_POOL not in self.features:
            out.append("a sliding-window KV pool (feature sliding_window_pool) not supported")
        if layout_only:
            return out
        missing_modes = sorted(m.name for m in req.forward_modes - self.forward_modes)
        if missing_modes:
            out.append(f"forward modes {missing_modes} not supported")
        missing_features = sorted(f.value for f in req.features - self.features - {Feature.SLIDING_WINDOW_POOL})
        if missing_features:
            out.append(f"features {missing_features} not supported")
        if req.cuda_graph > self.cuda_graph:
            out.append(f"CUDA graphs at level {req.cuda_graph.name} not supported (max {self.cuda_graph.name})")
        return out

    def summary(self) -> str:
        """One line for listings."""
        parts = [
            "/".join(sorted(self.devices)),
            "/".join(sorted(self.archs)),
            "/".join(_short_dtype(d) for d in sorted(self.q_dtypes)),
            *(["kv " + "/".join(sorted(FP8_KV_DTYPES & self.kv_dtypes))] if FP8_KV_DTYPES & self.kv_dtypes else []),
            "pages " + ("any" if self.page_sizes is None else ",".join(map(str, sorted(self.page_sizes)))),
            "graphs " + self.cuda_graph.name.lower(),
        ]
        if self.features:
            parts.append(",".join(sorted(f.value for f in self.features)))
        return "; ".join(parts)


def _ranges(values: frozenset[int]) -> str:
    """Compact listing of a set of ints: "8..256 step 8" for arithmetic runs, else the sorted list."""
    v = sorted(values)
    if len(v) > 4 and len({b - a for a, b in zip(v, v[1:])}) == 1:
        return f"{v[0]}..{v[-1]} step {v[1] - v[0]}"
    return str(v)


def _cc(cc: tuple[int, ...]) -> str:
    return f"{cc[0]}.{cc[1]}"


def _short_dtype(name: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}.get(name, name)
