"""A hybrid KV pool for models that interleave sliding-window and full-attention layers.

A window layer (sliding window W) never reads a key more than W-1 positions behind its query, so it
need not keep full-length KV. `SlidingWindowAllocator` gives every token one slot in the *full* pool
(the slot `req_to_token` and `out_cache_loc` name, used by the full-attention layers) and one in a
smaller *window* pool, and owns the full→window translation: `full_to_window[full_slot]` is the token's
window slot, 0 (the window pool's reserved dummy) once it has none. `release_out_of_window` frees the
window slots of tokens that slid out of every window (positions < next query position - W + 1), so the
window pool holds about W + new tokens per running request instead of the whole context.

`SlidingWindowKVPool` stores the full layers' K/V in an `MHATokenToKVPool` sized like the full
allocator and the window layers' in one sized like the window allocator; `get_key_buffer(layer_id)`
returns the right buffer and `set_kv_buffer` translates `out_cache_loc` for window layers. A backend
serving window layers from it translates the key slots it gathers for them (`window_slots`) and must not
read keys outside the layer's window (they may already be released: their translation is the dummy slot);
it declares `Feature.SLIDING_WINDOW_POOL`.

Both pools use the same page size; the window allocator lays a request's tokens out page by page as
the full one does (token i at page offset i % page_size in both), so page-table kernels work on either.
MHA only.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch

from attn_core.contract.errors import InvalidArgumentError, KVCacheError
from attn_core.memory.allocator import IntSeq, PagedTokenAllocator, _as_list
from attn_core.memory.pools import MHATokenToKVPool
from attn_core.ops.kv_write import CheckedSlots, SlotIds, slot_ids

Device = Union[str, torch.device]


class SlidingWindowAllocator:
    """Full slots and window slots for every token, with the full→window translation (see module doc).

    `size` / `window_size`: usable slots of the full and window pools (multiples of page_size);
    `window`: the largest sliding window of the window layers (tokens). The interface of
    `PagedTokenAllocator` (alloc, alloc_extend, alloc_decode, free, available_size) hands out and frees
    *full* slots; window slots follow them. Copy-on-write prefix forks (`fork_partial_page`) are not
    offered: a fork of a windowed request would need its window slots copied too.
    """

    def __init__(self, size: int, window_size: int, window: int, page_size: int = 1, device: Device = "cpu"):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InvalidArgumentError(
                "window", "an int >= 1 (the largest sliding window of the window layers)", window
            )
        self.full = PagedTokenAllocator(size, page_size, device)
        self.window_alloc = PagedTokenAllocator(window_size, page_size, device)
        self.window = window
        self.size = size
        self.window_size = window_size
        self.page_size = page_size
        self.device = torch.device(device)
        n = size + page_size
        #: window slot of each full slot (int32, on the device; 0: none). Written in place: graphs may read it.
        self.full_to_window = torch.zeros(n, dtype=torch.int32, device=self.device)
        self._host_map = torch.zeros(n, dtype=torch.int64)  # host mirror: bookkeeping without device reads

    def clear(self) -> None:
        self.full.clear()
        self.window_alloc.clear()
        self.full_to_window.zero_()
        self._host_map.zero_()

    def available_size(self) -> int:
        """Free full slots."""
        return self.full.available_size()

    def window_available_size(self) -> int:
        """Free window slots."""
        return self.window_alloc.available_size()

    def _map(self, full: Optional[torch.Tensor], window: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Record the pairs, or undo the full allocation when the window pool ran out (None)."""
        if full is None:
            return None
        if window is None:
            self.full.free(full)
            return None
        f, w = full.cpu().to(torch.int64), window.cpu().to(torch.int64)
        self._host_map[f] = w
        self.full_to_window[full.to(self.device, torch.int64)] = window.to(self.device, torch.int32)
        return full

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """`need_size` full slots in whole pages, each with a window slot (None: either pool is out)."""
        full = self.full.alloc(need_size)
        window = self.window_alloc.alloc(need_size) if full is not None else None
        return self._map(full, window)

    def alloc_extend(self, prefix_lens: IntSeq, seq_lens: IntSeq, last_loc: IntSeq) -> Optional[torch.Tensor]:
        """`PagedTokenAllocator.alloc_extend` on the full pool; the window pool continues each request's
        window page from the window slot of `last_loc` (its last token is always inside the window)."""
        prefix, last = _as_list(prefix_lens), _as_list(last_loc)
        ps = self.page_size
        full = self.full.alloc_extend(prefix_lens, seq_lens, last_loc)
        if full is None:
            return None
        win_last = [int(self._host_map[loc]) if p % ps else 0 for p, loc in zip(prefix, last)]
        try:
            window = self.window_alloc.alloc_extend(prefix_lens, seq_lens, win_last)
        except KVCacheError:
            self.full.free(full)
            raise
        return self._map(full, window)

    def alloc_decode(self, seq_lens: IntSeq, last_loc: IntSeq) -> Optional[torch.Tensor]:
        seq = _as_list(seq_lens)
        return self.alloc_extend([s - 1 for s in seq], seq, last_loc)

    def _release(self, full_slots: torch.Tensor) -> int:
        """Free the window slots of these full slots (int64 host tensor, in range) still mapped; returns how many."""
        w = self._host_map[full_slots]
        live = w != 0
        n = int(live.sum())
        if n:
            self.window_alloc.free(w[live])
            self._host_map[full_slots[live]] = 0
            self.full_to_window[full_slots[live].to(self.device)] = 0
        return n

    def free(self, free_index: IntSeq) -> None:
        """Free full slots (and their window slots, where not released already)."""
        slots = _as_list(free_index.reshape(-1).cpu()) if isinstance(free_index, torch.Tensor) else _as_list(free_index)
        limit = self._host_map.numel()
        bad = [s for s in slots if not 0 <= s < limit]
        if bad:
            raise InvalidArgumentError("free_index", f"slots in [0, {limit})", bad[:8])
        owned = [s for s in slots if self.full.is_allocated(s)]
        self.full.free(slots)  # validates (double free, reserved page) before anything changes
        self._release(torch.tensor(owned, dtype=torch.int64))

    def release_out_of_window(self, token_slots: IntSeq, next_query_pos: int, first_pos: int = 0) -> int:
        """Free the window slots of a request's tokens that no later query can see. `token_slots` are
        full slots of the request's consecutive decoder tokens, the first at position `first_pos` (its
        whole `req_to_token` row with first_pos 0, or only the part not released yet); its next query sits
        at position `next_query_pos` (its seq_len before the step's new tokens). Tokens at positions
        < next_query_pos - window + 1 slid out of every window. Returns how many window slots were freed
        (already released ones are skipped).

        Example (window 4): a request of 10 tokens whose next query is at position 10 releases the
        window slots of tokens 0..6 (the query at position 10 sees 7..10): 7 slots; a later call with
        next_query_pos 12 releases tokens 7 and 8 (2), whether it passes the whole row or, with
        first_pos 7, the row from token 7 on.
        """
        dead = max(next_query_pos - self.window + 1 - first_pos, 0)
        slots = (
            token_slots[:dead] if isinstance(token_slots, torch.Tensor) else torch.tensor(_as_list(token_slots)[:dead])
        )
        slots = slots.reshape(-1).cpu().to(torch.int64)
        limit = self._host_map.numel()
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= limit):
            raise InvalidArgumentError(
                "token_slots", f"full slots in [0, {limit})", slots[(slots < 0) | (slots >= limit)][:8].tolist()
            )
        return self._release(slots)


class SlidingWindowKVPool:
    """K/V of full layers in a pool sized like `allocator.full`, K/V of `window_layers` in one sized like
    the window allocator (see the module docstring). Layer ids are the model's, 0 .. layer_num-1."""

    def __init__(
        self,
        allocator: SlidingWindowAllocator,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        window_layers: Iterable[int],
        device: Device = "cpu",
        v_head_dim: Optional[int] = None,
        kv_layout: str = "NHD",
    ):
        window_layers = frozenset(int(i) for i in window_layers)
        bad = sorted(i for i in window_layers if not 0 <= i < layer_num)
        if bad:
            raise InvalidArgumentError("window_layers", f"layer ids in [0, {layer_num})", bad)
        if not window_layers:
            raise InvalidArgumentError("window_layers", "at least one window layer (else use MHATokenToKVPool)", [])
        self.allocator = allocator
        self.window_layers = window_layers
        self.window = allocator.window
        self.layer_num = layer_num
        ps = allocator.page_size
        full_ids = [i for i in range(layer_num) if i not in window_layers]
        win_ids = sorted(window_layers)
        n_full = max(len(full_ids), 1)
        self.full = MHATokenToKVPool(
            allocator.size, ps, dtype, head_num, head_dim, n_full, device, v_head_dim, kv_layout
        )
        self.window_pool = MHATokenToKVPool(
            allocator.window_size, ps, dtype, head_num, head_dim, len(win_ids), device, v_head_dim, kv_layout
        )
        self.kv_layout = kv_layout
        # model layer id -> (pool, index in it)
        self._where = {i: (self.full, k) for k, i in enumerate(full_ids)} | {
            i: (self.window_pool, k) for k, i in enumerate(win_ids)
        }
        f = self.full
        self.size, self.page_size, self.dtype, self.store_dtype, self.device = (
            f.size,
            f.page_size,
            f.dtype,
            f.store_dtype,
            f.device,
        )
        self.head_num, self.head_dim, self.v_head_dim, self.num_slots = (
            f.head_num,
            f.head_dim,
            f.v_head_dim,
            f.num_slots,
        )

    def _locate(self, layer_id: int):
        if layer_id not in self._where:
            raise InvalidArgumentError("layer_id", f"0 <= layer_id < {self.layer_num}", layer_id)
        return self._where[layer_id]

    def is_window_layer(self, layer_id: int) -> bool:
        return layer_id in self.window_layers

    def window_slots(self, full_slots: torch.Tensor) -> torch.Tensor:
        """Window slots (int32, same shape) of full slots (any int tensor on the pool's device); 0 where a
        token has none (released or never allocated). One gather, no sync."""
        return self.allocator.full_to_window[full_slots.long()]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        pool, k = self._locate(layer_id)
        return pool.get_key_buffer(k)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        pool, k = self._locate(layer_id)
        return pool.get_value_buffer(k)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    @property
    def device_faults(self):
        """The fault word of raw-slot writes through this pool (the full pool's; see `MHATokenToKVPool`)."""
        return self.full.device_faults

    def set_kv_buffer(
        self, layer, loc: SlotIds, cache_k, cache_v, k_scale=None, v_scale=None, *, clean_inputs: bool = False
    ) -> None:
        """Write K/V of the tokens at full slots `loc` (window layers: at their window slots). The full
        slots are checked first (`attn_core.ops.kv_write.slot_ids`: a slot outside the full pool is never
        translated), so the window slots come out checked: a refused token writes the dummy slot 0."""
        lid = layer if isinstance(layer, int) else layer.layer_id
        pool, k = self._locate(lid)
        if lid in self.window_layers:
            fault = self.full._fault_word(loc)
            full = slot_ids(loc, self.num_slots, fault)
            loc = CheckedSlots(self.window_slots(full).long(), self.window_pool.num_slots)
        pool.set_kv_buffer(k, loc, cache_k, cache_v, k_scale, v_scale, clean_inputs=clean_inputs)


def window_pool_of(pool) -> Optional[SlidingWindowKVPool]:
    """`pool` when it is a `SlidingWindowKVPool`, else None (e.g. an `MHATokenToKVPool` gives None), so a
    backend can write `if (wp := window_pool_of(ctx.token_to_kv_pool)) is not None: ...` for window layers."""
    return pool if isinstance(pool, SlidingWindowKVPool) else None
