"""`DoubleSparseKVPool`: an MHA KV pool that also keeps double sparsity's label cache.

For every layer l, KV head g and slot s the label cache holds the key's heavy channels,
label[l][s, g, c] = K[l][s, g, heavy_channels[l, g, c]] (C channels per head, chosen offline per layer and
head: `attn_sparse.double_sparsity.calibrate`). The labels live and die with the K/V:

- allocated with the pool: one `[num_slots, Hkv, C]` buffer per layer, indexed by the same slots;
- written with the K/V: `set_kv_buffer` (which every backend's save path calls) writes the labels of the
  new keys in the same call, so a label never disagrees with its key;
- freed with the K/V: a slot the allocator takes back is not read by anyone until its next
  `set_kv_buffer`, which rewrites both.

Worked example: head_dim 8, heavy_channels[0] = [[6, 1]] (one KV head, C = 2): writing a key
[10, 11, 12, 13, 14, 15, 16, 17] to slot 5 of layer 0 stores label [16, 11] at label_buffer[0][5, 0].
"""

from __future__ import annotations

from typing import Optional

import torch

from attn_core.contract.errors import InvalidArgumentError
from attn_core.memory import MHATokenToKVPool
from attn_core.memory.fp8 import is_fp8
from attn_core.memory.pools import Device


class DoubleSparseKVPool(MHATokenToKVPool):
    """`MHATokenToKVPool` plus the label cache of the module docstring. `heavy_channels`: integer
    `[layer_num, head_num, C]`, entries in [0, head_dim) (C >= 1); kept on the pool's device as int64."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        heavy_channels: torch.Tensor,
        device: Device = "cpu",
        v_head_dim: Optional[int] = None,
        kv_layout: str = "NHD",
    ):
        if is_fp8(dtype):
            raise InvalidArgumentError(
                "dtype", "a 16- or 32-bit float KV dtype (the label cache has no fp8 scales)", dtype
            )
        channels = check_heavy_channels(heavy_channels, layer_num, head_num, head_dim)
        super().__init__(size, page_size, dtype, head_num, head_dim, layer_num, device, v_head_dim, kv_layout)
        self.heavy_channels = channels.to(self.device, torch.int64).contiguous()
        self.heavy_channel_num = channels.shape[2]
        self.label_buffer = [
            torch.zeros((self.num_slots, head_num, self.heavy_channel_num), dtype=dtype, device=self.device)
            for _ in range(layer_num)
        ]

    def get_label_buffer(self, layer_id: int) -> torch.Tensor:
        """Layer `layer_id`'s labels `[num_slots, Hkv, C]`."""
        if not 0 <= layer_id < self.layer_num:
            raise InvalidArgumentError("layer_id", f"0 <= layer_id < {self.layer_num}", layer_id)
        return self.label_buffer[layer_id]

    def set_kv_buffer(
        self,
        layer,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        *,
        clean_inputs: bool = False,
    ) -> None:
        """Write K/V of `loc.numel()` tokens to slots `loc` (`MHATokenToKVPool.set_kv_buffer`, which checks
        the arguments first) and their labels: the heavy channels of the keys as stored."""
        super().set_kv_buffer(layer, loc, cache_k, cache_v, k_scale, v_scale, clean_inputs=clean_inputs)
        lid = layer if isinstance(layer, int) else layer.layer_id
        keys = cache_k.reshape(-1, self.head_num, self.head_dim).to(self.dtype)
        index = self.heavy_channels[lid].unsqueeze(0).expand(keys.shape[0], -1, -1)
        # the slots the K/V went to (a step's checked slots, or raw ones checked / guarded): attn-core's
        # one checked write (attn_core.ops.kv_write)
        self.label_buffer[lid][self.resolve_slots(loc)] = torch.gather(keys, 2, index)


def check_heavy_channels(channels, layer_num: int, head_num: int, head_dim: int) -> torch.Tensor:
    """`channels` as a tensor after checking it is integer `[layer_num, head_num, C]` with C >= 1 and every
    entry in [0, head_dim); else `InvalidArgumentError` naming `heavy_channels`. One host copy (construction
    time only). Example: for 2 layers, 1 KV head, head_dim 8, [[[0, 5]], [[7, 7]]] passes (C = 2)."""
    if not isinstance(channels, torch.Tensor):
        try:
            channels = torch.as_tensor(channels)
        except (TypeError, ValueError, RuntimeError):
            raise InvalidArgumentError(
                "heavy_channels", "an integer tensor [layer_num, head_num, C]", type(channels).__name__
            ) from None
    if channels.dtype.is_floating_point or channels.dtype.is_complex or channels.dtype == torch.bool:
        raise InvalidArgumentError("heavy_channels", "an integer tensor", channels.dtype)
    if channels.dim() != 3 or tuple(channels.shape[:2]) != (layer_num, head_num) or channels.shape[2] < 1:
        raise InvalidArgumentError(
            "heavy_channels", f"shape ({layer_num}, {head_num}, C) with C >= 1", tuple(channels.shape)
        )
    host = channels.cpu()
    if bool(((host < 0) | (host >= head_dim)).any()):
        raise InvalidArgumentError(
            "heavy_channels", f"channel indices in [0, {head_dim})", (int(host.min()), int(host.max()))
        )
    return channels
