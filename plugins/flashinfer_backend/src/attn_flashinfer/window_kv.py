"""Key lists of window layers kept in a `SlidingWindowKVPool` (plain torch, no FlashInfer: runs on CPU).

A window layer's K/V live in the pool's smaller window pool; the window slots of keys that slid out of
every window are released (their translation is the dummy slot 0). Its key list per request is therefore
the request's keys from position `start = max(0, first new position - window + 1)` to its last, each
translated to its window slot (`SlidingWindowKVPool.window_slots`), at token granularity (page_size 1,
the window pool viewed as one-token pages): the first kept key need not sit at a page start. FlashInfer's
causal mask and `window_left` are placed relative to the end of the key list it is given, so dropping
keys older than every query's window leaves the result exact.

Worked example (window 3, decoder-only, full slot = 10 * (row + 1) + position, and the window pool's
`full_to_window` sends full slot s to s + 100): two requests in rows 1 and 0, with seq_lens [6, 2] and
query lengths [2, 2] (new tokens at positions 4, 5 and 0, 1):
    starts  = [max(0, 4 - 3 + 1), max(0, 0 - 3 + 1)] = [2, 0]
    kv_lens = [6 - 2, 2 - 0]                       = [4, 2]
    indptr  = [0, 4, 6], last_page_len = [1, 1]
    indices = [122, 123, 124, 125, 110, 111]   (full slots 22..25 of row 1 and 10, 11 of row 0, translated)
"""

from __future__ import annotations

from typing import Optional

import torch

from attn_core.memory.window_pool import SlidingWindowKVPool
from attn_flashinfer.indices import DeviceOut, PagedKV, build_paged_kv


def window_key_starts(seq_lens: torch.Tensor, q_lens: Optional[torch.Tensor], window: int) -> torch.Tensor:
    """Decoder position of the first key a window layer keeps per request: `max(0, seq_len - q_len -
    window + 1)`, the oldest key the first new token can see (`q_lens` None: one new token each, DECODE).
    Same device and dtype as `seq_lens` (no sync), int `[bs]`.

    Example: window 3, seq_lens [6, 2, 9], q_lens [2, 2, 1] -> [2, 0, 6]."""
    first = seq_lens - 1 if q_lens is None else seq_lens - q_lens
    return (first - window + 1).clamp_min(0)


def build_window_kv(
    pool: SlidingWindowKVPool,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_host: torch.Tensor,
    q_lens: Optional[torch.Tensor] = None,
    q_lens_host: Optional[torch.Tensor] = None,
    encoder_lens: Optional[torch.Tensor] = None,
    out: Optional[DeviceOut] = None,
    fault: Optional[torch.Tensor] = None,
) -> PagedKV:
    """The window-pool key list of a step (see the module docstring): a token-granularity `PagedKV` whose
    page ids are window slots, its device arrays written now (not deferred).

    seq_lens / q_lens / encoder_lens: device int `[bs]` (q_lens None: DECODE, one new token each;
    encoder_lens: encoder tokens before the decoder tokens in each `req_to_token` row); seq_lens_host /
    q_lens_host: the same numbers on the host. `out` / `fault`: as in `indices.build_paged_kv` (every full
    slot is checked against the full pool's `num_slots` before translation, so every window slot read
    stays inside the window pool)."""
    w = pool.window
    starts_host = window_key_starts(
        seq_lens_host.to(torch.int64), None if q_lens is None else q_lens_host.to(torch.int64), w
    )
    lens_host = (seq_lens_host.to(torch.int64) - starts_host).to(torch.int32)
    starts = window_key_starts(seq_lens, q_lens, w)
    lens = (seq_lens - starts).to(torch.int32)
    col = (starts if encoder_lens is None else starts + encoder_lens).to(torch.int32)
    kv = build_paged_kv(
        req_to_token,
        req_pool_indices,
        lens,
        lens_host,
        1,
        kv_start=col,
        out=out,
        defer=False,
        num_slots=pool.num_slots,
        fault=fault,
    )
    # entries the index kernel refused to write (a fault it recorded) may hold stale ids: clamp them into
    # the translation table so the gather stays in bounds (valid full slots are unchanged)
    ids = kv.indices.clamp_(0, pool.allocator.full_to_window.numel() - 1)
    ids.copy_(pool.window_slots(ids))
    return kv
