"""attn_core.batching.chunk_plan: the worked example, random batches against a plain per-token loop, slots, errors."""

import random

import pytest
import torch

from attn_core.batching.chunk_plan import chunk_slots, plan_prefix_chunks
from attn_core.contract.errors import InvalidArgumentError


def test_worked_example():
    plan = plan_prefix_chunks([5, 0, 9], 10)
    assert plan.chunk_len == 3
    got = [
        (c.starts.tolist(), c.lens.tolist(), c.cu_seqlens.tolist(), c.positions.tolist(), c.request.tolist())
        for c in plan.chunks
    ]
    assert got == [
        ([0, 0, 0], [3, 0, 3], [0, 3, 3, 6], [0, 1, 2, 0, 1, 2], [0, 0, 0, 2, 2, 2]),
        ([3, 3, 3], [2, 0, 3], [0, 2, 2, 5], [3, 4, 3, 4, 5], [0, 0, 2, 2, 2]),
        ([6, 6, 6], [0, 0, 3], [0, 0, 0, 3], [6, 7, 8], [2, 2, 2]),
    ]
    assert [c.max_len for c in plan.chunks] == [3, 3, 3] and [c.num_tokens for c in plan.chunks] == [6, 5, 3]


def _loop_plan(prefix_lens, capacity):
    """The same plan, one token at a time: token t of request b goes to chunk t // (capacity // bs)."""
    bs = len(prefix_lens)
    n = capacity // bs
    chunks = {}
    for b, p in enumerate(prefix_lens):
        for t in range(p):
            chunks.setdefault(t // n, []).append((b, t))
    out = []
    for c in range(max(chunks) + 1 if chunks else 0):
        toks = sorted(chunks.get(c, []))
        out.append(
            ([b for b, _ in toks], [t for _, t in toks], [sum(1 for b2, _ in toks if b2 == b) for b in range(bs)])
        )
    return n, out


@pytest.mark.parametrize("seed", range(40))
def test_random_batches_match_a_plain_loop(seed):
    rng = random.Random(seed)
    bs = rng.randint(1, 7)
    lens = [rng.choice([0, rng.randint(1, 5), rng.randint(1, 200)]) for _ in range(bs)]
    capacity = rng.randint(bs, 300)
    plan = plan_prefix_chunks(torch.tensor(lens, dtype=torch.int32), capacity)
    n, want = _loop_plan(lens, capacity)
    assert plan.chunk_len == n and len(plan.chunks) == len(want)
    for c, (chunk, (req, pos, per_req)) in enumerate(zip(plan.chunks, want)):
        assert chunk.index == c
        assert chunk.request.tolist() == req and chunk.positions.tolist() == pos and chunk.lens.tolist() == per_req
        assert chunk.starts.tolist() == [c * n] * bs
        assert chunk.cu_seqlens.tolist() == [sum(per_req[:i]) for i in range(bs + 1)]
        assert chunk.num_tokens == len(req) <= capacity and chunk.max_len == max(per_req)
        assert all(
            t.dtype == torch.int32 for t in (chunk.starts, chunk.lens, chunk.cu_seqlens, chunk.positions, chunk.request)
        )


def test_no_prefix_no_chunks_and_empty_batch():
    assert plan_prefix_chunks([0, 0], 8).chunks == ()
    assert plan_prefix_chunks([], 8).chunks == ()


@pytest.mark.parametrize(
    ("lens", "capacity", "arg"), [([3, -1], 8, "prefix_lens"), ([3, 4, 5], 2, "capacity"), ([3], 0, "capacity")]
)
def test_bad_input_is_a_typed_error(lens, capacity, arg):
    with pytest.raises(InvalidArgumentError, match=arg):
        plan_prefix_chunks(lens, capacity)


def test_chunk_slots_reads_each_token_of_its_row():
    r2t = torch.arange(10 * 12, dtype=torch.int32).reshape(10, 12) + 1000
    rows = torch.tensor([4, 9, 2])
    plan = plan_prefix_chunks([7, 2, 12], 9)
    for chunk in plan.chunks:
        want = [1000 + 12 * int(rows[b]) + int(t) for b, t in zip(chunk.request, chunk.positions)]
        got = chunk_slots(r2t, rows, chunk)
        assert got.dtype == torch.int64 and got.tolist() == want


@pytest.mark.parametrize("seed", range(6))
def test_chunked_prefix_attention_equals_attention_over_the_whole_sequence(seed):
    """attend_with_prefix_chunks with plain passes (the float64 reference per request: causal over the new
    tokens, no mask over each chunk) against the reference over prefix + new tokens at once."""
    from attn_core.batching.chunk_plan import attend_with_prefix_chunks
    from attn_core.testing.reference import reference_attention

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    bs, H, D, Dv = rng.randint(1, 4), 3, 8, 5
    reqs = [(rng.choice([0, rng.randint(1, 40)]), rng.randint(1, 6)) for _ in range(bs)]
    capacity = rng.randint(bs, 30)
    prefix_k = [torch.randn(p, H, D, generator=g, dtype=torch.float64) for p, _ in reqs]
    prefix_v = [torch.randn(p, H, Dv, generator=g, dtype=torch.float64) for p, _ in reqs]
    T = sum(e for _, e in reqs)
    q, k = (torch.randn(T, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(T, H, Dv, generator=g, dtype=torch.float64)
    starts = [sum(e for _, e in reqs[:b]) for b in range(bs)]
    scale = 0.3

    def passes(keys_of, causal):
        o, lse = torch.zeros(T, H, Dv, dtype=torch.float64), torch.full((T, H), float("-inf"), dtype=torch.float64)
        for b, (_, e) in enumerate(reqs):
            kb, vb = keys_of(b)
            if kb.shape[0] == 0:  # no key of this request in the pass: output 0, LSE -inf
                continue
            rows = slice(starts[b], starts[b] + e)
            o[rows], lse[rows] = reference_attention(
                q[rows], kb, vb, q_positions=torch.arange(e), scale=scale, causal=causal
            )
        return o, lse.float()  # merge_state takes float32 LSEs

    def attend_new():
        return passes(
            lambda b: (k[starts[b] : starts[b] + reqs[b][1]], v[starts[b] : starts[b] + reqs[b][1]]), causal=True
        )

    def attend_chunk(chunk):
        def keys_of(b):
            s, n = int(chunk.starts[b]), int(chunk.lens[b])
            return prefix_k[b][s : s + n], prefix_v[b][s : s + n]

        return passes(keys_of, causal=False)

    plan = plan_prefix_chunks([p for p, _ in reqs], capacity)
    o, lse = attend_with_prefix_chunks(plan.chunks, attend_new, attend_chunk)
    for b, (p, e) in enumerate(reqs):
        rows = slice(starts[b], starts[b] + e)
        keys = torch.cat([prefix_k[b], k[rows]])
        vals = torch.cat([prefix_v[b], v[rows]])
        ref, ref_lse = reference_attention(q[rows], keys, vals, q_positions=torch.arange(p, p + e), scale=scale)
        assert torch.allclose(o[rows], ref, atol=1e-5) and torch.allclose(lse[rows].double(), ref_lse, atol=1e-5)
