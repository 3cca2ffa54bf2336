"""`BackendContext`: everything a backend may know at construction. It replaces an engine's
model runner: a backend never sees the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

import torch

from attn_core.contract.capabilities import ARCH_MHA, ARCH_MLA, CudaGraphLevel, Feature, Requirements
from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.validation import BASIC, VALIDATION_LEVELS

if TYPE_CHECKING:  # annotations only
    from attn_core.memory.kv_pool import KVPool
    from attn_core.memory.pools import ReqToTokenPool


@dataclass
class BackendContext:
    """Construction-time facts for one model on one device (head counts are per rank).

    `features`, `forward_modes` and `cuda_graph` say what the engine will ask for; sliding window,
    chunked local attention, a sliding-window KV pool, cross attention, deterministic mode and
    speculative settings add their features and modes automatically (see `requirements`).
    The engine builds it once per model and device and passes it to `create_backend`; construction
    checks every field (`InvalidArgumentError` naming it) and fills the derived ones.

    - `device`: the device every tensor of a step lives on (str or `torch.device`; "cuda" becomes the
      current CUDA device).
    - `dtype`: dtype of q/k/v and of the output (e.g. torch.bfloat16).
    - `num_q_heads` / `num_kv_heads`: query and KV heads of this rank, >= 1 (num_q_heads a multiple of
      num_kv_heads; 1 KV head for MLA).
    - `head_dim`: channels of q and k per head (MLA: kv_lora_rank + qk_rope_head_dim).
    - `kv_dtype`: dtype the KV pool stores (an fp8 dtype for an fp8 cache); None: `dtype`.
    - `v_head_dim`: channels of v and of the output per head; None: `head_dim` (MLA: kv_lora_rank).
    - `page_size`: KV slots per page (tokens), >= 1, the pool's and the allocator's.
    - `max_batch_size`: the most requests one step carries (graph buffers and scratch are sized by it).
    - `max_context_len`: the most keys (encoder + decoder tokens) one request attends to; the width of
      `req_to_token`.
    - `req_to_token_pool`: the engine's request→slot table (`ReqToTokenPool`, int32
      `[rows, max_context_len]` on `device`), used when a batch carries none; needed for CUDA graphs.
    - `token_to_kv_pool`: the KV pool (`attn_core.memory.KVPool`), used when a batch carries none;
      checked against `kv_dtype`, `page_size` and the head shape at backend construction.
    - `sliding_window_size`: keys a sliding-window layer sees (the model's window), or None.
    - `attention_chunk_size`, `kv_layout`, `validation`: below.
    - `attention_arch`: "mha" (MHA/GQA/MQA) or "mla"; MLA also sets `kv_lora_rank` (latent width, > 0)
      and `qk_rope_head_dim` (rope channels).
    - `is_encoder_decoder`: cross-attention layers are used (adds `Feature.CROSS_ATTENTION`).
    - `speculative_num_steps` / `speculative_topk` / `speculative_num_draft_tokens`: the engine's
      speculative settings (draft steps, drafts per position, tokens verified per request); any of them
      set asks for TARGET_VERIFY and DRAFT_EXTEND.
    - `deterministic`: results must not depend on the batch's other requests (`Feature.DETERMINISTIC`).
    - `features` / `forward_modes` / `cuda_graph`: what the engine will ask for beyond the above
      (`Feature`s, `ForwardMode`s, a `CudaGraphLevel`).

    Example: `BackendContext(device="cpu", dtype=torch.float32, num_q_heads=8, num_kv_heads=2,
    head_dim=64)` has `v_head_dim == 64`, `kv_dtype == torch.float32` and `gqa_group_size == 4`.
    """

    device: Union[str, torch.device]
    dtype: torch.dtype
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: Optional[torch.dtype] = None
    v_head_dim: Optional[int] = None
    page_size: int = 1
    max_batch_size: int = 256
    max_context_len: int = 8192
    req_to_token_pool: Optional[ReqToTokenPool] = None
    token_to_kv_pool: Optional[KVPool] = None
    sliding_window_size: Optional[int] = None
    #: chunk size of the model's chunked local layers (`AttentionLayer.attention_chunk_size`), so that
    #: backends can build their per-step local metadata once; None: the model has no such layer
    attention_chunk_size: Optional[int] = None
    attention_arch: str = ARCH_MHA
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    is_encoder_decoder: bool = False
    speculative_num_steps: int = 0
    speculative_topk: int = 0
    speculative_num_draft_tokens: int = 0
    deterministic: bool = False
    features: frozenset[Feature] = field(default_factory=frozenset)
    forward_modes: frozenset[ForwardMode] = field(
        default_factory=lambda: frozenset({ForwardMode.EXTEND, ForwardMode.DECODE})
    )
    cuda_graph: CudaGraphLevel = CudaGraphLevel.NEVER
    #: layout of the KV pool's buffers ("NHD" or "HND"); taken from `token_to_kv_pool` when it has one
    kv_layout: str = "NHD"
    #: batch validation in init_forward_metadata: "basic" (host copies only, no sync) or "full" (also
    #: the device tensors, one sync per step); see attn_core.contract.validation
    validation: str = BASIC

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.kv_dtype is None:
            self.kv_dtype = self.dtype
        if self.validation not in VALIDATION_LEVELS:
            raise InvalidArgumentError("validation", f"one of {VALIDATION_LEVELS}", self.validation)
        if self.attention_arch not in (ARCH_MHA, ARCH_MLA):
            raise InvalidArgumentError("attention_arch", f"{ARCH_MHA!r} or {ARCH_MLA!r}", self.attention_arch)
        if self.attention_arch == ARCH_MLA:
            if self.kv_lora_rank <= 0:
                raise InvalidArgumentError("kv_lora_rank", "> 0 for MLA", self.kv_lora_rank)
            if self.head_dim != self.kv_lora_rank + self.qk_rope_head_dim:
                raise InvalidArgumentError(
                    "head_dim",
                    f"kv_lora_rank + qk_rope_head_dim = {self.kv_lora_rank + self.qk_rope_head_dim} for MLA",
                    self.head_dim,
                )
            if self.num_kv_heads != 1:
                raise InvalidArgumentError("num_kv_heads", "1 for MLA (one latent per token)", self.num_kv_heads)
            if self.v_head_dim is None:
                self.v_head_dim = self.kv_lora_rank
        if self.v_head_dim is None:
            self.v_head_dim = self.head_dim
        for name in ("num_q_heads", "num_kv_heads", "head_dim", "page_size", "max_batch_size", "max_context_len"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(name, ">= 1", getattr(self, name))
        if self.num_q_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                "num_q_heads", f"a multiple of num_kv_heads={self.num_kv_heads}", self.num_q_heads
            )
        if self.sliding_window_size is not None and self.sliding_window_size < 1:
            raise InvalidArgumentError("sliding_window_size", "None or >= 1", self.sliding_window_size)
        if self.attention_chunk_size is not None and self.attention_chunk_size < 1:
            raise InvalidArgumentError("attention_chunk_size", "None or >= 1", self.attention_chunk_size)
        pool = self.token_to_kv_pool
        if pool is not None and getattr(pool, "page_size", self.page_size) != self.page_size:
            raise InvalidArgumentError("page_size", f"the KV pool's page_size {pool.page_size}", self.page_size)
        if pool is not None and hasattr(pool, "kv_layout"):
            self.kv_layout = pool.kv_layout
        if self.kv_layout not in ("NHD", "HND"):
            raise InvalidArgumentError("kv_layout", "'NHD' or 'HND'", self.kv_layout)
        self.features = frozenset(Feature(f) for f in self.features)
        self.forward_modes = frozenset(ForwardMode.parse(m) for m in self.forward_modes)
        self.cuda_graph = CudaGraphLevel(self.cuda_graph)

    @property
    def is_mla(self) -> bool:
        return self.attention_arch == ARCH_MLA

    @property
    def gqa_group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def requirements(self) -> Requirements:
        """What this context asks of a backend, as torch-free data for capability matching."""
        features = set(self.features)
        modes = set(self.forward_modes)
        if self.sliding_window_size is not None:
            features.add(Feature.SLIDING_WINDOW)
        if self.attention_chunk_size is not None:
            features.add(Feature.CHUNKED_LOCAL_ATTENTION)
        if getattr(self.token_to_kv_pool, "window_layers", None):
            features.add(Feature.SLIDING_WINDOW_POOL)
        if self.is_encoder_decoder:
            features.add(Feature.CROSS_ATTENTION)
        if self.deterministic:
            features.add(Feature.DETERMINISTIC)
        if self.speculative_num_draft_tokens or self.speculative_num_steps:
            modes |= {ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND}
            features.add(Feature.CUSTOM_MASK)
        if self.speculative_topk > 1:
            features.add(Feature.SPEC_TOPK_GT1)
        device = torch.device(self.device)  # a torch.device since construction
        cc = None
        if device.type == "cuda" and torch.cuda.is_available():
            cc = torch.cuda.get_device_capability(device)
        cpu_flags = None
        if device.type == "cpu":
            from attn_core.discovery.probes import cpu_flags as read_cpu_flags

            cpu_flags = read_cpu_flags()
        return Requirements(
            device_type=device.type,
            compute_capability=cc,
            cpu_flags=cpu_flags,
            q_dtype=dtype_name(self.dtype),
            kv_dtype=dtype_name(self.kv_dtype or self.dtype),
            head_dim=self.head_dim,
            page_size=self.page_size,
            arch=self.attention_arch,
            features=frozenset(features),
            forward_modes=frozenset(modes),
            cuda_graph=self.cuda_graph,
            kv_layout=self.kv_layout,
            engine_kv=bool(getattr(self.token_to_kv_pool, "engine_owned", False)),
        )


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a torch dtype as `Capabilities` and `Requirements` spell it: its torch attribute
    name. `dtype_name(torch.bfloat16) == "bfloat16"`, `dtype_name(torch.float8_e4m3fn) == "float8_e4m3fn"`."""
    return str(dtype).removeprefix("torch.")
