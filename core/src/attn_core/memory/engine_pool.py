"""`EngineKVPool`: a KV pool over tensors the engine allocated, read and written in place (zero-copy).

An engine that owns its KV memory (vLLM allocates one tensor per layer in a layout it resolves) hands
attn views of it. Each layer's K (and V) is given as a 4-D tensor of pages in one of two index orders:

- "HND": `[num_pages, Hkv, page_size, D]` (vLLM's logical per-layer view `[blocks, heads, tokens, ...]`),
- "NHD": `[num_pages, page_size, Hkv, D]` (token-major pages),

with any strides whose last dimension is contiguous: the order names how the tensor is *indexed*, the
strides say where each element lives, so one index order covers every memory layout. Slot s is token
s % page_size of page s // page_size (the engine's slot mapping: block · block_size + offset); page 0
is the dummy page (vLLM's null block).

The pool checks every tensor once (4-D, one dtype, one device, shapes agreeing, the last dimension
contiguous, no element reachable twice, K not V) and raises `InvalidArgumentError` naming the tensor;
it never copies or reallocates. What backends see (`get_key_buffer`, `kv_layout`):

- "NHD" `[num_slots, Hkv, D]` (a strided view) when every buffer's pages are one run of slots (page
  stride = page_size × token stride: vLLM's LBNHC layout, `[2, blocks, page, H, D]` caches);
- "HND" `[num_pages, Hkv, page_size, D]` (a strided view) otherwise (vLLM's CPU and LBHNC layouts,
  layer-interleaved pages, `[blocks, 2, page, H, D]` caches: token-major memory read through an HND
  view — attn names a buffer by its index order, not by its bytes).

A backend serves it when its `Capabilities.engine_kv_layouts` lists the pool's `kv_layout`; the context
says so (`Requirements.engine_kv`), so an undeclared one is refused at construction.

Worked example (vLLM 0.32's per-layer view, K and V side by side in the last dimension):

    caches = [torch.zeros(blocks, hkv, 16, 2 * d) for _ in range(layers)]   # [B, H, N, 2D]
    pool = EngineKVPool.from_fused(caches, kv_order="HND")                     # K = [..., :d], V = [..., d:]
    pool.kv_layout == "HND"; pool.num_slots == blocks * 16; nothing was copied
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from attn_core.contract.errors import InvalidArgumentError
from attn_core.memory.fp8 import is_fp8
from attn_core.memory.pools import MHATokenToKVPool, _KVPoolBase

#: index orders `EngineKVPool` takes a layer's K / V in
ENGINE_KV_ORDERS = ("HND", "NHD")


def has_internal_overlap(x: torch.Tensor) -> bool:
    """Whether two index tuples of `x` may reach one memory element: sorted by stride, some dimension's
    stride is smaller than the span of the dimensions inside it (dimensions of size 1 are ignored).

    Example: `torch.empty(4, 2, 8)` has none; `torch.empty(40).as_strided((4, 2, 8), (8, 4, 1))` has
    (the two middle rows 4 elements apart each hold 8).
    """
    dims = sorted((s, n) for s, n in zip(x.stride(), x.shape) if n > 1)
    span = 0  # largest offset reachable through the dimensions seen so far
    for stride, size in dims:
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def check_page_tensor(name: str, x, order: str, like: Optional[torch.Tensor], last_dim: Optional[int]) -> torch.Tensor:
    """`x` as the pool's HND-ordered view `[num_pages, Hkv, page_size, D]`, after the checks of the module
    docstring; `like` (the first tensor seen) fixes dtype, device and the page grid, `last_dim` the width D.
    Raises `InvalidArgumentError` naming `name`."""
    if not isinstance(x, torch.Tensor):
        raise InvalidArgumentError(name, f"a 4-D tensor of pages ({order} order)", type(x).__name__)
    if x.dim() != 4:
        raise InvalidArgumentError(name, f"a 4-D tensor of pages ({order} order)", tuple(x.shape))
    hnd = x if order == "HND" else x.permute(0, 2, 1, 3)
    if x.stride(-1) != 1:
        raise InvalidArgumentError(f"{name}.stride()", "a contiguous last dimension (stride 1)", tuple(x.stride()))
    if has_internal_overlap(x):
        raise InvalidArgumentError(
            f"{name}.stride()", "strides that reach every element once (no overlap)", tuple(x.stride())
        )
    if like is not None:
        if x.dtype != like.dtype:
            raise InvalidArgumentError(f"{name}.dtype", f"{like.dtype} as the first layer's K", x.dtype)
        if x.device != like.device:
            raise InvalidArgumentError(f"{name}.device", f"{like.device} as the first layer's K", x.device)
        if hnd.shape[:3] != like.shape[:3]:
            want = tuple(like.shape[:3])
            raise InvalidArgumentError(
                f"{name}.shape", f"(num_pages, Hkv, page_size) = {want} as the first layer's K", tuple(hnd.shape)
            )
    if last_dim is not None and hnd.shape[3] != last_dim:
        raise InvalidArgumentError(f"{name}.shape", f"head dim {last_dim} in the last dimension", tuple(x.shape))
    return hnd


def slot_view(hnd: torch.Tensor) -> Optional[torch.Tensor]:
    """The `[num_slots, Hkv, D]` view of an HND-ordered buffer whose pages are one run of slots (page
    stride = page_size × token stride), else None. Example: a contiguous `[6, 2, 4, 8]` (HND) buffer has
    none (its token stride 8 times 4 is not its page stride 64); its NHD twin `[6, 4, 2, 8]` permuted to
    HND order has one: `[24, 2, 8]` with strides (16, 8, 1)."""
    pages, heads, page_size, dim = hnd.shape
    sp, sh, st, _ = hnd.stride()
    if page_size > 1 and pages > 1 and sp != page_size * st:
        return None
    return hnd.as_strided((pages * page_size, heads, dim), (st, sh, 1))


class EngineKVPool(MHATokenToKVPool):
    """An MHA KV pool over the engine's own per-layer K and V tensors (see the module docstring).

    `k_caches[i]` / `v_caches[i]`: layer i's K `[num_pages, Hkv, page_size, D]` and V (`Dv` last) in
    `kv_order` "HND", or `[num_pages, page_size, Hkv, D]` in "NHD", any strides (last dimension
    contiguous). `set_kv_buffer` writes into them in place (the pool's masked, checked write); nothing is
    ever copied or reallocated. The dtype may be float8_e4m3fn (kept as byte views, like attn's pools).
    """

    #: the buffers are the engine's (strided views): backends declare `Capabilities.engine_kv_layouts`
    engine_owned = True

    def __init__(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor], *, kv_order: str = "HND"):
        if kv_order not in ENGINE_KV_ORDERS:
            raise InvalidArgumentError("kv_order", f"one of {list(ENGINE_KV_ORDERS)}", kv_order)
        if len(k_caches) < 1 or len(k_caches) != len(v_caches):
            raise InvalidArgumentError(
                "k_caches/v_caches",
                "one K and one V tensor per layer (at least one layer)",
                (len(k_caches), len(v_caches)),
            )
        first = check_page_tensor("k_caches[0]", k_caches[0], kv_order, None, None)
        num_pages, heads, page_size, head_dim = first.shape
        if num_pages < 2:
            raise InvalidArgumentError(
                "k_caches[0].shape", "at least 2 pages (page 0 is the reserved dummy page)", tuple(k_caches[0].shape)
            )
        v_dim = v_caches[0].shape[-1] if isinstance(v_caches[0], torch.Tensor) else None
        ks, vs = [], []
        for i, (k, v) in enumerate(zip(k_caches, v_caches)):
            ks.append(check_page_tensor(f"k_caches[{i}]", k, kv_order, first, head_dim))
            vs.append(check_page_tensor(f"v_caches[{i}]", v, kv_order, first, v_dim))
            if k.data_ptr() == v.data_ptr():
                raise InvalidArgumentError(
                    f"v_caches[{i}]", f"a tensor apart from k_caches[{i}]", "the same memory (V aliases K)"
                )
        _KVPoolBase.__init__(self, (num_pages - 1) * page_size, page_size, first.dtype, len(ks), first.device)
        self.head_num, self.head_dim, self.v_head_dim = heads, head_dim, v_dim
        self.kv_order = kv_order
        #: the tensors the engine gave, as given (identity checks: `is_view_of`)
        self.engine_tensors = (tuple(k_caches), tuple(v_caches))
        views = [slot_view(x) for x in ks + vs]
        flat = [f for f in views if f is not None]
        self.kv_layout = "NHD" if len(flat) == len(views) else "HND"
        bufs = flat if self.kv_layout == "NHD" else list(ks + vs)
        if is_fp8(self.dtype):  # stored as bytes, like attn's own fp8 pools (`_KVPoolBase.store_dtype`)
            bufs = [b.view(torch.uint8) for b in bufs]
        self.k_buffer, self.v_buffer = list(bufs[: len(ks)]), list(bufs[len(ks) :])

    @classmethod
    def from_fused(cls, caches: Sequence[torch.Tensor], *, kv_order: str = "HND") -> EngineKVPool:
        """A pool over per-layer tensors holding K and V side by side in the last dimension,
        `[num_pages, Hkv, page_size, 2 * D]` ("HND" order; vLLM 0.32's per-layer view in any layout it
        resolves) or `[num_pages, page_size, Hkv, 2 * D]` ("NHD"): K is `[..., :D]`, V `[..., D:]`."""
        ks, vs = [], []
        for i, c in enumerate(caches):
            if not isinstance(c, torch.Tensor) or c.dim() != 4 or c.shape[-1] % 2:
                found = tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__
                raise InvalidArgumentError(
                    f"caches[{i}]", "a 4-D tensor whose last dimension holds K then V (even width)", found
                )
            d = c.shape[-1] // 2
            ks.append(c[..., :d])
            vs.append(c[..., d:])
        return cls(ks, vs, kv_order=kv_order)

    @classmethod
    def from_stacked(cls, caches: Sequence[torch.Tensor], *, kv_dim: int, kv_order: str = "NHD") -> EngineKVPool:
        """A pool over per-layer 5-D tensors with a K/V axis of size 2 at `kv_dim`: vLLM's FlashAttention
        layout `[2, num_blocks, block_size, Hkv, D]` (kv_dim 0) or FlashInfer's `[num_blocks, 2,
        block_size, Hkv, D]` (kv_dim 1), NHD order; K is index 0 of that axis, V index 1."""
        ks, vs = [], []
        for i, c in enumerate(caches):
            if not isinstance(c, torch.Tensor) or c.dim() != 5 or not 0 <= kv_dim < 5 or c.shape[kv_dim] != 2:
                found = tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__
                raise InvalidArgumentError(
                    f"caches[{i}]", f"a 5-D tensor with a K/V axis of size 2 at dim {kv_dim}", found
                )
            ks.append(c.select(kv_dim, 0))
            vs.append(c.select(kv_dim, 1))
        return cls(ks, vs, kv_order=kv_order)

    def is_view_of(self, layer_id: int, tensor: torch.Tensor) -> bool:
        """Whether layer `layer_id`'s K buffer still lies in `tensor`'s memory (the engine handed the
        same cache again: no copy in between). One pointer comparison, no device work."""
        k = self.engine_tensors[0][self._check_layer(layer_id)]
        return k.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()

    def describe(self) -> str:
        """One line: layout, pages, heads, dims, dtype and each buffer's strides."""
        k, v = self.k_buffer[0], self.v_buffer[0]
        return (
            f"EngineKVPool {self.kv_layout} ({self.kv_order} given): {self.num_slots // self.page_size} pages of "
            f"{self.page_size}, {self.head_num} KV heads, D {self.head_dim}/{self.v_head_dim}, {self.dtype}, "
            f"{self.layer_num} layers; K strides {tuple(k.stride())}, V strides {tuple(v.stride())}"
        )
