"""`KVPool`: the type of every KV pool attn's backends read and write through (`ForwardBatch.token_to_kv_pool`,
`BackendContext.token_to_kv_pool`, `AttentionBackend.kv_pool`), for annotations.

An `EngineKVPool` (engine-owned caches) and attn-sparse's `DoubleSparseKVPool` are `MHATokenToKVPool`s;
a `SlidingWindowKVPool` keeps window layers apart (`window_pool_of` tells it from the others).
"""

from __future__ import annotations

from typing import Union

from attn_core.memory.pools import MHATokenToKVPool, MLATokenToKVPool
from attn_core.memory.window_pool import SlidingWindowKVPool

KVPool = Union[MHATokenToKVPool, MLATokenToKVPool, SlidingWindowKVPool]
