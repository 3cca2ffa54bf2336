"""Dummy attention heads for vision towers (SGLang's `vision_utils` helpers): a tensor-parallel size that
does not divide a ViT's head count (InternViT's 25 heads on 2, 4 or 8 ranks) is served by appending zero
"dummy" heads until it does. A dummy head's q, k and v are 0 (zero weights and biases), so its attention
output is 0, and the output projection's columns for it are 0: the model computes exactly what it did.

`update_vit_attn_dummy_heads_config(config, tp_size)` writes `head_dim` and `num_dummy_heads` into a
transformers config; `pad_vit_attn_dummy_heads(config, name, weight)` pads one checkpoint tensor by its
parameter name as `attn_core.VisionAttention` names them (`...attn.qkv_proj.weight` / `.bias`: fused
`[q | k | v]`; `...attn.q_proj` / `k_proj` / `v_proj`; `...attn.proj.weight`; `...attn.q_norm.weight` /
`k_norm.weight` over all heads, while a per-head norm's `[head_dim]` weight needs none); every other tensor
comes back unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from attn_core.contract.errors import InvalidArgumentError


def _vision_config(config):
    """The config's `vision_config` (a multimodal model's), else the config itself (a vision model's)."""
    return getattr(config, "vision_config", None) or config


def update_vit_attn_dummy_heads_config(config: Any, tp_size: int) -> None:
    """Set `head_dim` (hidden_size // heads) and `num_dummy_heads` (the fewest zero heads that make the head
    count a multiple of `tp_size`) on the vision config of `config` (its `vision_config`, else itself),
    whose head count is `num_heads` or `num_attention_heads`.

    Example: hidden_size 3200, 25 heads, tp_size 4 → head_dim 128, num_dummy_heads 3 (28 = 4 x 7);
    tp_size 5 → 0."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise InvalidArgumentError("tp_size", "an int >= 1", tp_size)
    vision = _vision_config(config)
    heads = getattr(vision, "num_heads", None) or getattr(vision, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        raise InvalidArgumentError("config", "a vision config with num_heads or num_attention_heads >= 1", heads)
    head_dim = vision.hidden_size // heads
    dummy = -heads % tp_size
    vision.head_dim = head_dim
    vision.num_dummy_heads = dummy


def _pad_heads(x: torch.Tensor, head_dim: int, dummy: int, name: str) -> torch.Tensor:
    """`x` (its first dim heads x head_dim) with `dummy` zero heads appended along that dim."""
    if x.shape[0] % head_dim:
        raise InvalidArgumentError(name, f"a first dim that is a multiple of head_dim={head_dim}", tuple(x.shape))
    return torch.cat([x, x.new_zeros((dummy * head_dim, *x.shape[1:]))], dim=0)


def pad_vit_attn_dummy_heads(config: Any, name: str, loaded_weight: torch.Tensor) -> torch.Tensor:
    """`loaded_weight` (checkpoint parameter `name`) padded for the `num_dummy_heads` zero heads of the vision
    config of `config` (set by `update_vit_attn_dummy_heads_config`): each of q, k and v of a fused
    `qkv_proj` gets its zero heads after its own heads; a `q_proj` / `k_proj` / `v_proj` weight or bias, and
    an all-heads `q_norm` / `k_norm` weight, gets them after its heads; `proj.weight` (out features x heads · head_dim)
    gets zero columns. Other tensors (and every tensor when there are no dummy heads) come back as they are.

    Example (head_dim 2, one dummy head): a qkv_proj bias [1, 2 | 3, 4 | 5, 6] becomes
    [1, 2, 0, 0 | 3, 4, 0, 0 | 5, 6, 0, 0]; a proj weight [[1, 2]] becomes [[1, 2, 0, 0]]."""
    vision = _vision_config(config)
    dummy = getattr(vision, "num_dummy_heads", 0)
    if not dummy:
        return loaded_weight
    head_dim = vision.head_dim
    parts = name.split(".")
    module, param = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
    if param not in ("weight", "bias"):
        return loaded_weight
    if module == "qkv_proj":
        if loaded_weight.shape[0] % 3:
            raise InvalidArgumentError(
                name, "a fused [q | k | v] tensor (first dim a multiple of 3)", tuple(loaded_weight.shape)
            )
        return torch.cat([_pad_heads(x, head_dim, dummy, name) for x in loaded_weight.chunk(3, dim=0)], dim=0)
    if module in ("q_proj", "k_proj", "v_proj"):
        return _pad_heads(loaded_weight, head_dim, dummy, name)
    if (
        module in ("q_norm", "k_norm") and param == "weight" and loaded_weight.numel() != head_dim
    ):  # not a per-head norm
        return _pad_heads(loaded_weight, head_dim, dummy, name)
    if module == "proj" and param == "weight":
        if loaded_weight.dim() != 2 or loaded_weight.shape[1] % head_dim:
            raise InvalidArgumentError(
                name, f"[out, heads x head_dim] with head_dim={head_dim}", tuple(loaded_weight.shape)
            )
        return torch.cat([loaded_weight, loaded_weight.new_zeros((loaded_weight.shape[0], dummy * head_dim))], dim=1)
    return loaded_weight


__all__ = ["pad_vit_attn_dummy_heads", "update_vit_attn_dummy_heads_config"]
