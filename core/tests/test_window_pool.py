"""SlidingWindowAllocator / SlidingWindowKVPool: translation, release of slots that slid out of every
window, page layout in the window pool, typed errors, and the base class's window-pool checks."""

import random

import pytest
import torch

from attn_core import (
    AttentionLayer,
    BackendContext,
    Feature,
    ForwardMode,
    IncompatibleBackendError,
    InvalidArgumentError,
    UnsupportedFeatureError,
)
from attn_core.memory import KVSlotError, ReqToTokenPool, SlidingWindowAllocator, SlidingWindowKVPool
from attn_core.testing.batch_builder import build_forward_batch


def _check_invariants(a: SlidingWindowAllocator, live_full: set[int]):
    """Every mapped full slot is allocated, window slots are distinct and allocated, host and device maps agree."""
    host = a._host_map
    assert torch.equal(host.to(torch.int32), a.full_to_window.cpu())
    mapped = host.nonzero().flatten().tolist()
    assert set(mapped) <= live_full
    w = host[mapped].tolist()
    assert len(set(w)) == len(w)
    assert all(a.window_alloc.is_allocated(x) for x in w)


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_steps_release_and_reuse(page_size):
    """Requests decode for many steps; after each step the engine releases what slid out of the window.
    The window pool never holds more than (window + page) tokens per request plus one page, and tokens
    keep page offsets i % page_size in the window pool."""
    window, ps = 5, page_size
    rng = random.Random(page_size)
    a = SlidingWindowAllocator(4096, 3 * ps * (-(-(window + 3) // ps) + 1), window, ps)
    rows = {r: [] for r in range(3)}  # request -> full slots in position order
    live: set[int] = set()
    for step in range(60):
        for slots in rows.values():
            n = rng.randint(1, 3) if step % 7 == 0 else 1
            last = slots[-1] if slots else 0
            new = a.alloc_extend([len(slots)], [len(slots) + n], [last])
            assert new is not None, f"window pool ran out at step {step}"
            for i, s in enumerate(new.tolist()):
                pos = len(slots) + i
                assert s % ps == pos % ps
                ws = int(a.full_to_window[s])
                assert ws != 0 and ws % ps == pos % ps
            slots.extend(new.tolist())
            live.update(new.tolist())
            freed = a.release_out_of_window(slots, len(slots))
            assert freed >= 0
            dead = max(len(slots) - window + 1, 0)
            assert all(int(a.full_to_window[s]) == 0 for s in slots[:dead])
            assert all(int(a.full_to_window[s]) != 0 for s in slots[dead:])
        _check_invariants(a, live)
    # full slots stay allocated; freeing a request frees its full slots and its remaining window slots
    before = a.window_available_size()
    kept = sum(1 for s in rows[0] if int(a.full_to_window[s]))
    a.free(torch.tensor(rows[0]))
    live -= set(rows[0])
    assert a.window_available_size() >= before + kept - ps  # whole pages come back (the last may be shared)
    _check_invariants(a, live)
    with pytest.raises(KVSlotError):
        a.free(torch.tensor(rows[0][:1]))  # double free: typed, nothing changes
    _check_invariants(a, live)


def test_release_example_from_docstring():
    a = SlidingWindowAllocator(64, 32, 4)
    slots = a.alloc_extend([0], [10], [0]).tolist()
    assert a.release_out_of_window(slots, 10) == 7
    a.alloc_extend([10], [12], [slots[-1]])
    assert a.release_out_of_window(slots[7:], 12, first_pos=7) == 2
    assert a.release_out_of_window(slots, 12) == 0


def test_exhausted_window_pool_is_all_or_nothing():
    a = SlidingWindowAllocator(256, 8, 4)
    assert a.alloc_extend([0], [9], [0]) is None
    assert a.available_size() == 256 and a.window_available_size() == 8
    assert not a._host_map.any()


def test_pool_routes_layers_and_translates_writes():
    a = SlidingWindowAllocator(64, 16, 4)
    a.window_alloc.alloc(1)  # window slots differ from full slots
    pool = SlidingWindowKVPool(a, torch.float32, 2, 8, 3, window_layers=[0, 2])
    assert pool.get_key_buffer(0).shape[0] == 17 and pool.get_key_buffer(1).shape[0] == 65
    loc = a.alloc(3)
    k = torch.randn(3, 2, 8)
    pool.set_kv_buffer(0, loc, k, k)
    pool.set_kv_buffer(1, loc, k + 1, k + 1)
    w = pool.window_slots(loc).long()
    assert not torch.equal(w, loc)
    assert torch.equal(pool.get_key_buffer(0)[w], k) and torch.equal(pool.get_key_buffer(1)[loc], k + 1)
    with pytest.raises(InvalidArgumentError, match="window_layers"):
        SlidingWindowKVPool(a, torch.float32, 2, 8, 3, window_layers=[3])
    with pytest.raises(InvalidArgumentError, match="layer_id"):
        pool.get_key_buffer(3)
    with pytest.raises(InvalidArgumentError, match="window"):
        SlidingWindowAllocator(64, 16, 0)


def _window_env():
    a = SlidingWindowAllocator(128, 64, 4)
    pool = SlidingWindowKVPool(a, torch.float32, 2, 32, 2, window_layers=[0])
    r2t = ReqToTokenPool(2, 64)
    ctx = BackendContext(
        "cpu", torch.float32, 4, 2, 32, req_to_token_pool=r2t, token_to_kv_pool=pool, sliding_window_size=4
    )
    b = build_forward_batch(ForwardMode.DECODE, [(6, 1)], req_to_token_pool=r2t, allocator=a, token_to_kv_pool=pool)
    return ctx, b


def test_context_requires_the_feature_and_layers_are_checked():
    from attn_core.backends.torch_native.backend import TorchNativeBackend

    ctx, b = _window_env()
    assert Feature.SLIDING_WINDOW_POOL in ctx.requirements().features
    be = TorchNativeBackend(ctx)
    b.attn_backend = be
    be.init_forward_metadata(b)
    q, k = torch.zeros(1, 4, 32), torch.zeros(1, 2, 32)
    with pytest.raises(InvalidArgumentError, match="sliding_window_size"):  # a full layer in the window pool
        AttentionLayer(0, 4, 2, 32)(q, k, k, b)
    with pytest.raises(InvalidArgumentError, match="sliding_window_size"):  # a window wider than the pool's
        AttentionLayer(0, 4, 2, 32, sliding_window_size=5)(q, k, k, b)

    class NoPool(TorchNativeBackend):
        name = "no_pool"
        capabilities = TorchNativeBackend.capabilities.__class__(
            **{
                **TorchNativeBackend.capabilities.__dict__,
                "features": TorchNativeBackend.capabilities.features - {Feature.SLIDING_WINDOW_POOL},
            }
        )

    with pytest.raises(IncompatibleBackendError, match="sliding-window KV pool"):  # refused at construction
        NoPool(ctx)
    plain = BackendContext(
        "cpu", torch.float32, 4, 2, 32, req_to_token_pool=ctx.req_to_token_pool, sliding_window_size=4
    )
    be = NoPool(plain)  # the pool comes with the batch only: refused at the layer, before any write
    b.attn_backend = be
    be.init_forward_metadata(b)
    with pytest.raises(UnsupportedFeatureError, match="sliding-window KV pool"):
        AttentionLayer(0, 4, 2, 32, sliding_window_size=4)(q, k, k, b)
    AttentionLayer(1, 4, 2, 32)(q, k, k, b)  # a full layer is served from the full pool
