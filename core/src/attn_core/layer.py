"""`AttentionLayer`: the per-layer attention settings a model holds; calls the batch's backend."""

from __future__ import annotations

from typing import Optional

import torch

from attn_core.errors import InvalidArgumentError


class AttentionLayer(torch.nn.Module):
    """One attention layer's fixed settings (head counts per rank).

    `sliding_window_size` W lets a query at position p see keys p-W+1 … p; None means full attention.
    `attention_chunk_size` C (chunked local attention, Llama-4 style) lets it see keys (p // C) * C … p
    only (see `attn_core.local_attention`); it excludes a sliding window and cross attention.
    `logit_cap` c > 0 maps scaled scores s to c·tanh(s/c). Cross-attention layers attend to the
    request's encoder keys without a causal mask. `k_scale` / `v_scale` dequantize an fp8 KV cache.
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
    ):
        super().__init__()
        if layer_id < 0:
            raise InvalidArgumentError("layer_id", ">= 0", layer_id)
        if num_q_heads < 1 or num_kv_heads < 1 or num_q_heads % num_kv_heads:
            raise InvalidArgumentError("num_q_heads", f"a positive multiple of num_kv_heads={num_kv_heads}", num_q_heads)
        if head_dim < 1:
            raise InvalidArgumentError("head_dim", ">= 1", head_dim)
        if logit_cap < 0:
            raise InvalidArgumentError("logit_cap", ">= 0 (0 disables)", logit_cap)
        if sliding_window_size is not None and sliding_window_size < 1:
            raise InvalidArgumentError("sliding_window_size", "None or >= 1", sliding_window_size)
        if attention_chunk_size is not None:
            if isinstance(attention_chunk_size, bool) or not isinstance(attention_chunk_size, int) or attention_chunk_size < 1:
                raise InvalidArgumentError("attention_chunk_size", "None or an int >= 1", attention_chunk_size)
            if sliding_window_size is not None or is_cross_attention:
                raise InvalidArgumentError(
                    "attention_chunk_size", "None for a sliding-window or cross-attention layer", attention_chunk_size
                )
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

    def forward(self, q, k, v, forward_batch, save_kv_cache: bool = True, **extras):
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
        )
