"""The MLA backend's checks and fixed buffers, free of FlashInfer (so they run and are tested on CPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attn_core.contract.batch import SpecInfo
from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode


@dataclass(frozen=True)
class MLADims:
    """Per-rank query heads, the latent's two parts and the dtype every plan repeats."""

    num_heads: int
    kv_lora_rank: int  # 512 for DeepSeek: the compressed KV, also the value / output width
    qk_rope_head_dim: int  # 64: the rope part of the latent
    dtype: torch.dtype


@dataclass(frozen=True)
class MLAGraphBuffers:
    """Fixed device buffers a CUDA-graph MLA wrapper holds (sliced to the captured batch size). The MLA
    kernel reads only `kv_indices` (and the scheduler's work list in the wrapper's own workspace); the
    other three receive FlashInfer's copies when a graph wrapper gets its first (public) plan."""

    qo_indptr: torch.Tensor  # int32 [bs+1]
    kv_indptr: torch.Tensor  # int32 [bs+1]
    kv_indices: torch.Tensor  # int32 [max pages]
    kv_lens: torch.Tensor  # int32 [bs]


def check_mla_context(ctx, name: str) -> None:
    """Typed errors for what the capabilities cannot say (the base class refuses the rest: device, MHA,
    page sizes, the q/KV dtype mix, a pool of another layout): absorbed MLA needs v_head_dim ==
    kv_lora_rank, and there is no cross attention."""
    if ctx.v_head_dim != ctx.kv_lora_rank:
        raise InvalidArgumentError(
            "ctx.v_head_dim", f"kv_lora_rank ({ctx.kv_lora_rank}) for absorbed MLA", ctx.v_head_dim
        )
    if ctx.is_encoder_decoder:
        raise UnsupportedFeatureError(name, "encoder-decoder models (cross attention)")


def refuse_tree_mask(name: str, mode: ForwardMode, spec_info: Optional[SpecInfo]) -> None:
    """FlashInfer's MLA kernels take no custom mask: a TARGET_VERIFY step with a tree mask (speculative
    topk > 1) is refused; chains (topk 1, no mask) run causally."""
    if mode.is_target_verify() and spec_info is not None and spec_info.custom_mask is not None:
        raise UnsupportedFeatureError(
            name, "custom masks (TARGET_VERIFY tree masks, speculative topk > 1): chains only"
        )


def check_capacity(what: str, need: int, have: int) -> None:
    """A fixed buffer must hold a step's entries (CUDA-graph index buffers)."""
    if need > have:
        raise InvalidArgumentError(
            what, f"at most {have} entries (sized by init_cuda_graph_state from ctx.max_context_len)", need
        )
