"""Request→slot table and per-layer KV pools.

Layouts (docs/design.md §3):
- `ReqToTokenPool.req_to_token`: int32 `[max_reqs, max_context_len]`, row r, column i = the KV slot of
  token i of the request in row r.
- `MHATokenToKVPool`: per layer K and V in one of two layouts (`kv_layout`, FlashInfer's names):
  "NHD" (default) K `[num_slots, Hkv, D]`, V `[num_slots, Hkv, Dv]` (token-major: one page is
  `[page_size, Hkv, D]`); "HND" K `[num_pages, Hkv, page_size, D]` (head-major within a page), V alike.
  Slot s is token s % page_size of page s // page_size in both; `token_rows` reads either by slot.
- `MLATokenToKVPool`: per layer one latent buffer `[num_slots, 1, kv_lora_rank + qk_rope_head_dim]`;
  the "value" is its first kv_lora_rank channels (a view).
num_slots = size + page_size: page 0 (slot 0 onwards) is the reserved padding dummy.

Every `set_kv_buffer` writes through `attn_core.ops.kv_write` (`slot_ids`, then `write_kv_rows`, which
stores a token whose value is not finite as K = NaN, V = 0: masked keys then add nothing on every
backend, docs/design.md §3.2): a slot outside the pool is never written where it points (on the CPU:
`InvalidArgumentError` before any write;
on an accelerator: written to the dummy slot 0 and recorded in the pool's `device_faults`), and slots a
step check already passed (`CheckedSlots`) are written with no further work (one type check a call).
"""

from __future__ import annotations

from typing import Optional, Protocol, Union

import torch

from attn_core.contract.errors import InvalidArgumentError, KVCacheError
from attn_core.memory.fp8 import check_scale, is_fp8
from attn_core.ops.device_faults import DeviceFaultFlags
from attn_core.ops.kv_write import CheckedSlots, SlotIds, slot_ids, write_kv_rows

Device = Union[str, torch.device]


class _HasLayerId(Protocol):
    """A layer as the pools read it (an `AttentionLayer` is one): only its `layer_id`."""

    @property
    def layer_id(self) -> int: ...


#: a layer as `set_kv_buffer` takes it: its id, or the layer itself (its `layer_id` is read)
LayerRef = Union[int, _HasLayerId]


def _layer_id(layer: LayerRef) -> int:
    return layer if isinstance(layer, int) else layer.layer_id


KV_LAYOUTS = ("NHD", "HND")


def check_kv_layout(kv_layout: str) -> str:
    if kv_layout not in KV_LAYOUTS:
        raise InvalidArgumentError("kv_layout", f"one of {list(KV_LAYOUTS)}", kv_layout)
    return kv_layout


def token_rows(buf: torch.Tensor, slots: torch.Tensor, kv_layout: str = "NHD", page_size: int = 1) -> torch.Tensor:
    """The K (or V) rows of `slots` from a layer buffer of either layout: `[*slots.shape, H, D]` (a gather).

    Example: page_size 2, HND buffer `[3, H, 2, D]`: slot 5 is `buf[2, :, 1]` (page 2, offset 1); in an
    NHD buffer `[6, H, D]` it is `buf[5]`.
    """
    if kv_layout == "NHD":
        return buf[slots]
    return buf[torch.div(slots, page_size, rounding_mode="floor"), :, slots % page_size]


class ReqToTokenPool:
    """Rows of the request→slot table; one row per running request."""

    def __init__(self, size: int, max_context_len: int, device: Device = "cpu"):
        if size < 1:
            raise InvalidArgumentError("size", "at least 1 request row", size)
        if max_context_len < 1:
            raise InvalidArgumentError("max_context_len", "at least 1", max_context_len)
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        self.clear()

    def clear(self) -> None:
        self._free = list(range(self.size - 1, -1, -1))
        self._is_free = [True] * self.size

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, need_size: int) -> Optional[list[int]]:
        """`need_size` free rows, or None (nothing changes) when there are not enough."""
        if need_size < 0:
            raise InvalidArgumentError("need_size", "a non-negative count", need_size)
        if need_size > len(self._free):
            return None
        rows = [self._free.pop() for _ in range(need_size)]
        for r in rows:
            self._is_free[r] = False
        return rows

    def free(self, rows: Union[int, list[int], torch.Tensor]) -> None:
        if isinstance(rows, torch.Tensor):
            rows = rows.reshape(-1).tolist()
        elif isinstance(rows, int):
            rows = [rows]
        bad = [r for r in rows if not 0 <= r < self.size]
        if bad:
            raise KVCacheError(f"free: request rows out of range [0, {self.size}): {bad[:8]}")
        if len(set(rows)) != len(rows) or any(self._is_free[r] for r in rows):
            raise KVCacheError(f"free: request row(s) already free (double free): {rows[:8]}")
        for r in rows:
            self._is_free[r] = True
        self._free.extend(reversed(rows))

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Set the slots of tokens start .. start+len(slots)-1 of the request in `row`."""
        end = start + slots.numel()
        if end > self.max_context_len:
            raise InvalidArgumentError(
                "slots", f"at most max_context_len={self.max_context_len} tokens per request", end
            )
        self.req_to_token[row, start:end] = slots.to(self.req_to_token)


class _KVPoolBase:
    """Shared plumbing of the KV pools: sizes, dtype, store dtype for fp8."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, layer_num: int, device: Device):
        if size < 1 or size % page_size:
            raise InvalidArgumentError("size", f"a positive multiple of page_size={page_size}", size)
        if layer_num < 1:
            raise InvalidArgumentError("layer_num", "at least 1 layer", layer_num)
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        # index_put does not support float8 everywhere: keep fp8 caches as raw bytes.
        self.store_dtype = torch.uint8 if is_fp8(dtype) else dtype
        self.layer_num = layer_num
        self.device = torch.device(device)
        self.num_slots = size + page_size
        self._device_faults: Optional[DeviceFaultFlags] = None

    @property
    def device_faults(self) -> DeviceFaultFlags:
        """The fault word of writes made through this pool with raw slot tensors on an accelerator (slots
        outside [1, num_slots) go to the dummy slot 0 and are recorded here); backends write pre-checked
        slots and record their own faults. Read it with `poll()` / `poll_fault()` (one sync)."""
        if self._device_faults is None:
            self._device_faults = DeviceFaultFlags(self.device)
        return self._device_faults

    def _fault_word(self, loc) -> Optional[torch.Tensor]:
        """The fault word a raw-slot write on an accelerator records into (None on the CPU, which raises)."""
        return None if self.device.type == "cpu" or not isinstance(loc, torch.Tensor) else self.device_faults.buffer

    def resolve_slots(self, loc: SlotIds) -> torch.Tensor:
        """The slot ids (a tensor) a write of this pool uses for `loc` (`attn_core.ops.kv_write.slot_ids`):
        a step's `CheckedSlots` as they are, raw slots checked (CPU: `InvalidArgumentError`) or guarded
        (accelerators: outside the pool -> the dummy slot 0, recorded in `device_faults`). A subclass that
        writes per-slot data of its own next to the K/V indexes it with these."""
        if type(loc) is CheckedSlots and loc.num_slots == self.num_slots:
            return loc.slots
        return slot_ids(loc, self.num_slots, self._fault_word(loc))

    def _check_layer(self, layer_id: int) -> int:
        if not 0 <= layer_id < self.layer_num:
            raise InvalidArgumentError("layer_id", f"0 <= layer_id < {self.layer_num}", layer_id)
        return layer_id

    def _view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf if self.store_dtype == self.dtype else buf.view(self.dtype)

    def _check_rows(
        self, name: str, x: Optional[torch.Tensor], loc: torch.Tensor, tail: tuple[int, ...]
    ) -> torch.Tensor:
        if loc.dim() != 1:
            raise InvalidArgumentError("loc", "a 1-D tensor of slot ids", tuple(loc.shape))
        if x is None:
            raise InvalidArgumentError(name, f"a tensor of shape {(loc.shape[0], *tail)}", None)
        if x.dim() == 2 and x.shape[1] == _prod(tail):
            x = x.reshape(x.shape[0], *tail)
        if tuple(x.shape) != (loc.shape[0], *tail):
            raise InvalidArgumentError(name, f"shape {(loc.shape[0], *tail)}", tuple(x.shape))
        return x


def _prod(t: tuple[int, ...]) -> int:
    out = 1
    for v in t:
        out *= v
    return out


class MHATokenToKVPool(_KVPoolBase):
    """Per-layer K and V buffers for multi-head / grouped-query attention."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: Device = "cpu",
        v_head_dim: Optional[int] = None,
        kv_layout: str = "NHD",
    ):
        super().__init__(size, page_size, dtype, layer_num, device)
        self.kv_layout = check_kv_layout(kv_layout)
        self.head_num = head_num
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.k_buffer = [
            torch.zeros(self._shape(head_dim), dtype=self.store_dtype, device=self.device) for _ in range(layer_num)
        ]
        self.v_buffer = [
            torch.zeros(self._shape(self.v_head_dim), dtype=self.store_dtype, device=self.device)
            for _ in range(layer_num)
        ]

    def _shape(self, dim: int) -> tuple[int, ...]:
        if self.kv_layout == "NHD":
            return (self.num_slots, self.head_num, dim)
        return (self.num_slots // self.page_size, self.head_num, self.page_size, dim)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.k_buffer[self._check_layer(layer_id)])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.v_buffer[self._check_layer(layer_id)])

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(
        self,
        layer: LayerRef,
        loc: SlotIds,
        cache_k: torch.Tensor,
        cache_v: Optional[torch.Tensor],
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        *,
        clean_inputs: bool = False,
    ) -> None:
        """Write K/V of `loc.numel()` tokens (`[T, Hkv, D]` or `[T, Hkv*D]`) to slots `loc` (a 1-D int
        tensor, or a step's `CheckedSlots`) through `attn_core.ops.kv_write` (see the module docstring); an fp8 pool
        stores e4m3(x / scale) saturated (`attn_core.memory.fp8.quantize_kv`; None means 1). A token whose
        value is not finite is stored as K = NaN, V = 0; with `clean_inputs`, in cache_k / cache_v too
        (`write_kv_rows`)."""
        lid = self._check_layer(_layer_id(layer))
        k_scale, v_scale = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
        slots = self.resolve_slots(loc)
        cache_k = self._check_rows("cache_k", cache_k, slots, (self.head_num, self.head_dim))
        cache_v = self._check_rows("cache_v", cache_v, slots, (self.head_num, self.v_head_dim))
        write_kv_rows(
            self._view(self.k_buffer[lid]),
            self._view(self.v_buffer[lid]),
            slots,
            cache_k,
            cache_v,
            k_scale=k_scale,
            v_scale=v_scale,
            layout=self.kv_layout,
            page_size=self.page_size,
            clean_inputs=clean_inputs,
        )


class MLATokenToKVPool(_KVPoolBase):
    """Per-layer latent buffer for multi-head latent attention (one KV "head")."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: Device = "cpu",
    ):
        super().__init__(size, page_size, dtype, layer_num, device)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_layout = "NHD"
        self.head_num = 1
        self.head_dim = kv_lora_rank + qk_rope_head_dim
        self.v_head_dim = kv_lora_rank
        self.kv_buffer = [
            torch.zeros((self.num_slots, 1, self.head_dim), dtype=self.store_dtype, device=self.device)
            for _ in range(layer_num)
        ]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.kv_buffer[self._check_layer(layer_id)])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.get_key_buffer(layer_id)[..., : self.kv_lora_rank]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(
        self,
        layer: LayerRef,
        loc: SlotIds,
        cache_k: torch.Tensor,
        cache_v: Optional[torch.Tensor] = None,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        *,
        clean_inputs: bool = False,
    ) -> None:
        """Write latent rows `[T, 1, kv_lora_rank + qk_rope_head_dim]` to slots `loc` through `attn_core.ops.kv_write`
        (cache_v is ignored: the value is part of the latent; an fp8 pool stores e4m3(latent / k_scale)
        saturated). A latent whose value part is not finite is stored with that part 0 and the rest NaN;
        `clean_inputs` is accepted for the pools' common signature and leaves cache_k as it is."""
        lid = self._check_layer(_layer_id(layer))
        k_scale = check_scale("k_scale", k_scale)
        slots = self.resolve_slots(loc)
        cache_k = self._check_rows("cache_k", cache_k, slots, (1, self.head_dim))
        buf = self._view(self.kv_buffer[lid])
        write_kv_rows(buf, None, slots, cache_k, k_scale=k_scale, value_cols=self.kv_lora_rank)

    def set_mla_kv_buffer(self, layer: LayerRef, loc: SlotIds, k_nope: torch.Tensor, k_rope: torch.Tensor) -> None:
        """Write the latent from its two parts `[T, 1, kv_lora_rank]` and `[T, 1, qk_rope_head_dim]`."""
        self.set_kv_buffer(
            layer,
            loc,
            torch.cat([k_nope.reshape(-1, 1, self.kv_lora_rank), k_rope.reshape(-1, 1, self.qk_rope_head_dim)], dim=-1),
        )


def kv_scales(layer, pool) -> tuple[float, float]:
    """(k, v) dequantization factors a reader multiplies `pool`'s stored K and V by for `layer`:
    (layer.k_scale, layer.v_scale) as floats, None meaning 1.0; an MLA pool's value is a slice of the
    latent, which `set_kv_buffer` quantized with k_scale, so there both are k_scale. Raises
    InvalidArgumentError naming `layer.k_scale` / `layer.v_scale` unless each is None or finite > 0.

    Example: a layer with k_scale=0.5, v_scale=None gives (0.5, 1.0) on an MHA pool, (0.5, 0.5) on an
    MLA pool."""
    k = check_scale("layer.k_scale", getattr(layer, "k_scale", None))
    if isinstance(pool, MLATokenToKVPool):
        return k, k
    return k, check_scale("layer.v_scale", getattr(layer, "v_scale", None))


def check_pool_matches(pool: Union[MHATokenToKVPool, MLATokenToKVPool], allocator) -> None:
    """An allocator must hand out slots that exist in the pool, in pages of the same size; raises
    `KVCacheError` otherwise (`build_forward_batch` asks before allocating). Example: a
    `PagedTokenAllocator(size=4096, page_size=16)` fits an `MHATokenToKVPool(size=4096, page_size=16, ...)`
    and is refused for a pool of page_size 1 or of size 2048."""
    if allocator.page_size != pool.page_size:
        raise KVCacheError(f"allocator page_size {allocator.page_size} != KV pool page_size {pool.page_size}")
    if allocator.size > pool.size:
        raise KVCacheError(f"allocator size {allocator.size} exceeds KV pool size {pool.size}")
