"""KV-cache memory: the request→slot table, slot allocators and per-layer KV pools."""

from attn_core.memory.allocator import KVSlotError, PagedTokenAllocator, PageTailError, TokenAllocator
from attn_core.memory.engine_pool import ENGINE_KV_ORDERS, EngineKVPool
from attn_core.memory.kv_pool import KVPool
from attn_core.memory.pools import (
    KV_LAYOUTS,
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
    check_pool_matches,
    kv_scales,
    token_rows,
)
from attn_core.memory.window_pool import SlidingWindowAllocator, SlidingWindowKVPool, window_pool_of

__all__ = [
    "ENGINE_KV_ORDERS",
    "EngineKVPool",
    "KV_LAYOUTS",
    "KVPool",
    "KVSlotError",
    "MHATokenToKVPool",
    "MLATokenToKVPool",
    "PagedTokenAllocator",
    "PageTailError",
    "ReqToTokenPool",
    "SlidingWindowAllocator",
    "SlidingWindowKVPool",
    "TokenAllocator",
    "check_pool_matches",
    "kv_scales",
    "token_rows",
    "window_pool_of",
]
