"""KV-cache memory: the request→slot table, slot allocators and per-layer KV pools."""

from attn_core.memory.allocator import KVSlotError, PagedTokenAllocator, PageTailError, TokenAllocator
from attn_core.memory.pools import KVPool, MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool, check_pool_matches

__all__ = [
    "KVPool",
    "KVSlotError",
    "MHATokenToKVPool",
    "MLATokenToKVPool",
    "PagedTokenAllocator",
    "PageTailError",
    "ReqToTokenPool",
    "TokenAllocator",
    "check_pool_matches",
]
