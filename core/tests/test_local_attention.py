"""Chunked local attention helpers: the docstrings' worked examples, random batches against a plain
per-token loop, typed errors, and the layer/context options."""

import random

import pytest
import torch

from attn_core import (
    AttentionLayer,
    BackendContext,
    Feature,
    ForwardMode,
    InvalidArgumentError,
    UnsupportedFeatureError,
)
from attn_core.batching.local_attention import local_decode_starts, make_local_attention_virtual_batches
from attn_core.memory import MHATokenToKVPool, PagedTokenAllocator, ReqToTokenPool
from attn_core.testing.batch_builder import build_forward_batch


def test_worked_example_chunk_multiple_of_page():
    vb = make_local_attention_virtual_batches(4, [3, 1], [6, 9], page_size=2)
    assert vb.req_indices == (0, 0, 1)
    assert vb.q_lens == (1, 2, 1)
    assert vb.q_start_loc == (0, 1, 3)
    assert vb.kv_starts == (0, 4, 8)
    assert vb.kv_lens == (4, 2, 1)
    assert vb.page_starts == (0, 2, 4)
    assert vb.page_offsets == (0, 0, 0)
    assert vb.num_pages == (2, 1, 1)
    table = torch.tensor([[7, 3, 9, 0, 0], [4, 5, 6, 8, 2]])
    assert vb.page_table(table).tolist() == [[7, 3], [9, 0], [2, 0]]


def test_worked_example_chunk_not_multiple_of_page():
    vb = make_local_attention_virtual_batches(3, [3, 1], [6, 9], page_size=2)
    assert (vb.req_indices, vb.q_lens, vb.q_start_loc) == ((0, 1), (3, 1), (0, 3))
    assert (vb.kv_starts, vb.kv_lens) == ((3, 6), (3, 3))
    assert (vb.page_starts, vb.page_offsets, vb.num_pages) == ((1, 3), (1, 0), (2, 2))


def test_decode_starts_example():
    assert local_decode_starts(4, torch.tensor([6, 9, 4])).tolist() == [4, 8, 0]


def _loop_reference(chunk, q_lens, seq_lens, ps):
    """Per token: group consecutive new tokens of a request by chunk; each group is a virtual request."""
    virtual = []
    row = 0
    for r, (n, s) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(s - n, s):
            c = pos // chunk
            if virtual and virtual[-1]["req"] == r and virtual[-1]["chunk"] == c:
                virtual[-1]["q"] += 1
            else:
                virtual.append({"req": r, "chunk": c, "q": 1, "row": row})
            virtual[-1]["last"] = pos
            row += 1
    out = []
    for v in virtual:
        start = v["chunk"] * chunk
        kv_len = v["last"] + 1 - start
        keys = list(range(start, start + kv_len))
        pages = sorted({k // ps for k in keys})
        out.append((v["req"], v["q"], v["row"], start, kv_len, pages[0], start - pages[0] * ps, len(pages)))
    return out


@pytest.mark.parametrize("page_size", [1, 16])
def test_random_batches_match_loop(page_size):
    rng = random.Random(page_size)
    for _ in range(200):
        bs = rng.randint(0, 6)
        chunk = rng.choice([1, 3, 5, 16, 24, 40, rng.randint(1, 70)])
        q_lens = [rng.choice([0, 1, rng.randint(1, 60)]) for _ in range(bs)]
        seq_lens = [n + rng.randint(0, 90) for n in q_lens]
        vb = make_local_attention_virtual_batches(chunk, q_lens, seq_lens, page_size=page_size)
        got = list(
            zip(
                vb.req_indices,
                vb.q_lens,
                vb.q_start_loc,
                vb.kv_starts,
                vb.kv_lens,
                vb.page_starts,
                vb.page_offsets,
                vb.num_pages,
            )
        )
        assert got == _loop_reference(chunk, q_lens, seq_lens, page_size), (chunk, q_lens, seq_lens)
        assert sum(vb.q_lens) == sum(q_lens) and vb.num_keys == sum(vb.kv_lens)
        # the page form names the request's pages holding exactly the virtual request's keys
        max_pages = max([-(-s // page_size) for s in seq_lens] + [1])
        table = torch.randint(1, 1000, (max(bs, 1), max_pages))
        pt = vb.page_table(table)
        for v in range(vb.num_virtual):
            first = vb.kv_starts[v] // page_size
            last = (vb.kv_starts[v] + vb.kv_lens[v] - 1) // page_size
            want = table[vb.req_indices[v], first : last + 1].tolist()
            assert pt[v, : len(want)].tolist() == want and not pt[v, len(want) :].any()
        # decode starts agree with the single virtual request of a one-token query
        if bs:
            s = torch.tensor([max(x, 1) for x in seq_lens])
            one = make_local_attention_virtual_batches(chunk, [1] * bs, s.tolist())
            assert local_decode_starts(chunk, s).tolist() == list(one.kv_starts)


def test_from_forward_batch():
    pool = ReqToTokenPool(4, 64)
    alloc = PagedTokenAllocator(256, 16)
    kv = MHATokenToKVPool(256, 16, torch.float32, 1, 8, 1)
    b = build_forward_batch(
        ForwardMode.EXTEND, [(5, 4), (0, 3)], req_to_token_pool=pool, allocator=alloc, token_to_kv_pool=kv
    )
    vb = make_local_attention_virtual_batches(4, b, page_size=16)
    assert vb == make_local_attention_virtual_batches(4, [4, 3], [9, 3], page_size=16)
    assert vb.req_indices == (0, 0, 1) and vb.q_lens == (3, 1, 3)


@pytest.mark.parametrize(
    "args",
    [
        dict(attn_chunk_size=0, batch=[1], seq_lens=[1]),
        dict(attn_chunk_size=True, batch=[1], seq_lens=[1]),
        dict(attn_chunk_size=4, batch=[1], seq_lens=None),
        dict(attn_chunk_size=4, batch=[1, 2], seq_lens=[3]),
        dict(attn_chunk_size=4, batch=[5], seq_lens=[3]),
        dict(attn_chunk_size=4, batch=[1], seq_lens=[3], page_size=0),
    ],
)
def test_bad_arguments(args):
    with pytest.raises(InvalidArgumentError):
        make_local_attention_virtual_batches(**args)


def test_page_table_too_narrow():
    vb = make_local_attention_virtual_batches(4, [3], [9], page_size=2)
    with pytest.raises(InvalidArgumentError, match="page_table"):
        vb.page_table(torch.zeros(1, 3, dtype=torch.int64))


def test_layer_and_context_options():
    with pytest.raises(InvalidArgumentError, match="attention_chunk_size"):
        AttentionLayer(0, 4, 2, 32, attention_chunk_size=0)
    with pytest.raises(InvalidArgumentError, match="attention_chunk_size"):
        AttentionLayer(0, 4, 2, 32, attention_chunk_size=8, sliding_window_size=4)
    with pytest.raises(InvalidArgumentError, match="attention_chunk_size"):
        BackendContext("cpu", torch.float32, 4, 2, 32, attention_chunk_size=0)
    ctx = BackendContext("cpu", torch.float32, 4, 2, 32, attention_chunk_size=8)
    assert Feature.CHUNKED_LOCAL_ATTENTION in ctx.requirements().features


def test_backend_without_feature_refuses_chunk_layer():
    from attn_core.backends.torch_native.backend import TorchNativeBackend

    class NoChunk(TorchNativeBackend):
        name = "no_chunk"
        capabilities = TorchNativeBackend.capabilities.__class__(
            **{
                **TorchNativeBackend.capabilities.__dict__,
                "features": TorchNativeBackend.capabilities.features - {Feature.CHUNKED_LOCAL_ATTENTION},
            }
        )

    pool = ReqToTokenPool(2, 32)
    kv = MHATokenToKVPool(64, 1, torch.float32, 2, 32, 1)
    alloc = PagedTokenAllocator(64, 1)
    ctx = BackendContext("cpu", torch.float32, 4, 2, 32, req_to_token_pool=pool, token_to_kv_pool=kv)
    b = build_forward_batch(ForwardMode.DECODE, [(3, 1)], req_to_token_pool=pool, allocator=alloc, token_to_kv_pool=kv)
    be = NoChunk(ctx)
    b.attn_backend = be
    be.init_forward_metadata(b)
    layer = AttentionLayer(0, 4, 2, 32, attention_chunk_size=2)
    with pytest.raises(UnsupportedFeatureError, match="attention_chunk_size"):
        layer(torch.zeros(1, 4, 32), torch.zeros(1, 2, 32), torch.zeros(1, 2, 32), b)
