"""`AttentionLayer`: the per-layer attention settings a model holds; calls the batch's backend."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from attn_core.contract.errors import InvalidArgumentError

if TYPE_CHECKING:  # annotations only
    from attn_core.contract.batch import ForwardBatch


class AttentionType(str, enum.Enum):
    """How a layer's queries see the keys of their own request (SGLang's names).

    - DECODER: causal, a query at position p sees the keys at positions <= p;
    - DECODER_BIDIRECTIONAL: causal, except inside the batch's per-request bidirectional span [a, b)
      (`ForwardBatch.bidirectional_spans`), whose positions see each other (an image's tokens in a
      multimodal prefix-LM); a batch without spans runs it causally; `Feature.BIDIRECTIONAL_SPAN`;
    - ENCODER_ONLY: non-causal, every query sees every key its request has in the step (encoder-only
      embedding / reranker models); `Feature.NON_CAUSAL`.
    """

    DECODER = "decoder"
    DECODER_BIDIRECTIONAL = "decoder_bidirectional"
    ENCODER_ONLY = "encoder_only"


class AttentionLayer(torch.nn.Module):
    """One attention layer's fixed settings (head counts per rank).

    `sliding_window_size` W lets a query at position p see keys p-W+1 … p; None means full attention.
    `attention_chunk_size` C (chunked local attention, Llama-4 style) lets it see keys (p // C) * C … p
    only (see `attn_core.batching.local_attention`); it excludes a sliding window and cross attention.
    `logit_cap` c > 0 maps scaled scores s to c·tanh(s/c). Cross-attention layers attend to the
    request's encoder keys without a causal mask. `k_scale` / `v_scale` dequantize an fp8 KV cache.
    `attn_type` (`AttentionType` or its value) makes a self-attention layer non-causal (encoder-only) or
    bidirectional inside the batch's spans; either excludes a sliding window, a chunk size and cross
    attention.
    """

    def __init__(
        self,
        layer_id: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: Optional[float] = None,
        v_head_dim: Optional[int] = None,
        logit_cap: float = 0.0,
        sliding_window_size: Optional[int] = None,
        is_cross_attention: bool = False,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        attention_chunk_size: Optional[int] = None,
        attn_type: Union[AttentionType, str] = AttentionType.DECODER,
    ):
        super().__init__()
        if layer_id < 0:
            raise InvalidArgumentError("layer_id", ">= 0", layer_id)
        if num_q_heads < 1 or num_kv_heads < 1 or num_q_heads % num_kv_heads:
            raise InvalidArgumentError(
                "num_q_heads", f"a positive multiple of num_kv_heads={num_kv_heads}", num_q_heads
            )
        if head_dim < 1:
            raise InvalidArgumentError("head_dim", ">= 1", head_dim)
        if logit_cap < 0:
            raise InvalidArgumentError("logit_cap", ">= 0 (0 disables)", logit_cap)
        if sliding_window_size is not None and sliding_window_size < 1:
            raise InvalidArgumentError("sliding_window_size", "None or >= 1", sliding_window_size)
        if attention_chunk_size is not None:
            if (
                isinstance(attention_chunk_size, bool)
                or not isinstance(attention_chunk_size, int)
                or attention_chunk_size < 1
            ):
                raise InvalidArgumentError("attention_chunk_size", "None or an int >= 1", attention_chunk_size)
            if sliding_window_size is not None or is_cross_attention:
                raise InvalidArgumentError(
                    "attention_chunk_size", "None for a sliding-window or cross-attention layer", attention_chunk_size
                )
        try:
            attn_type = AttentionType(attn_type)
        except ValueError:
            raise InvalidArgumentError("attn_type", f"one of {[t.value for t in AttentionType]}", attn_type) from None
        others = dict(sliding_window_size=sliding_window_size, attention_chunk_size=attention_chunk_size)
        restricted = any(x is not None for x in others.values()) or is_cross_attention
        if attn_type is not AttentionType.DECODER and restricted:
            expected = f"'decoder' for a sliding-window, chunked local or cross layer, not {attn_type.value!r}"
            raise InvalidArgumentError("attn_type", expected, {**others, "cross": is_cross_attention})
        self.attn_type = attn_type
        self.layer_id = layer_id
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.scaling = head_dim**-0.5 if scaling is None else scaling
        self.logit_cap = float(logit_cap)
        self.sliding_window_size = sliding_window_size
        self.is_cross_attention = is_cross_attention
        self.k_scale = k_scale
        self.v_scale = v_scale
        self.attention_chunk_size = attention_chunk_size

    def forward(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **extras: Any,
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Attention of the batch's new tokens; output `[T, num_q_heads * v_head_dim]`
        (with `return_lse=True`: the output and the natural-log LSE `[T, num_q_heads]`)."""
        backend = forward_batch.attn_backend
        if backend is None:
            raise InvalidArgumentError("forward_batch.attn_backend", "a backend (set it before running layers)", None)
        return backend.forward(q, k, v, self, forward_batch, save_kv_cache=save_kv_cache, **extras)

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, q_heads={self.num_q_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, logit_cap={self.logit_cap}, "
            f"window={self.sliding_window_size}, chunk={self.attention_chunk_size}, cross={self.is_cross_attention}"
            + ("" if self.attn_type is AttentionType.DECODER else f", attn_type={self.attn_type.value}")
        )
