"""attn_core.batching.batch_utils: the docstrings' worked examples, then random batches against plain-Python loops."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from attn_core.batching.batch_utils import (
    DecodeFirstSplit,
    DecodePrefillSplit,
    decode_first_order,
    decode_first_split,
    flatten_uniform_output,
    query_lens,
    reshape_query_for_uniform_batch,
    slice_batch,
    split_batch_by_requests,
    split_decodes_and_prefills,
    token_range,
    uniform_query_len,
)
from attn_core.contract.batch import ForwardBatch, SpecInfo
from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.forward_mode import ForwardMode

# ---- worked examples of the docstrings ---------------------------------------------------------------


def test_worked_examples():
    assert split_decodes_and_prefills([1, 1, 2, 5, 3]) == DecodePrefillSplit(2, 3, 2, 10)
    assert split_decodes_and_prefills([1, 1, 2, 5, 3], decode_threshold=2) == DecodePrefillSplit(3, 2, 4, 8)
    with pytest.raises(InvalidArgumentError, match="a decode at index 2"):
        split_decodes_and_prefills([1, 5, 1])
    assert decode_first_order([3, 1, 4, 1, 1, 2]) == [4, 1, 3, 2, 0, 5]
    assert token_range([2, 3, 4], 1, 3) == (2, 9)
    assert uniform_query_len([3, 3, 3, 3]) == 3 and uniform_query_len([1, 2]) is None and uniform_query_len([]) is None
    q = torch.arange(12 * 8 * 128, dtype=torch.float32).view(12, 8, 128)
    view = reshape_query_for_uniform_batch(q, 4)
    assert view.shape == (4, 3, 8, 128) and view.data_ptr() == q.data_ptr() and torch.equal(view[2, 1], q[7])
    assert torch.equal(flatten_uniform_output(view), q)
    b = _batch(ForwardMode.EXTEND, prefix=[3, 0, 6], ext=[2, 3, 4])
    part = slice_batch(b, 1, 3)
    assert part.seq_lens_cpu.tolist() == [3, 10] and part.extend_seq_lens_cpu.tolist() == [3, 4]
    assert part.extend_start_loc.tolist() == [0, 3] and part.seq_lens_sum == 13 and part.extend_num_tokens == 7
    assert torch.equal(part.out_cache_loc, b.out_cache_loc[2:9])
    assert [x.batch_size for x in split_batch_by_requests(_batch(ForwardMode.DECODE, [1] * 5, [1] * 5), [0, 2, 5])] == [
        2,
        3,
    ]


def test_typed_errors():
    with pytest.raises(InvalidArgumentError, match="decode_threshold"):
        split_decodes_and_prefills([1], decode_threshold=0)
    with pytest.raises(InvalidArgumentError, match="query_lens"):
        decode_first_order([1, -1])
    b = _batch(ForwardMode.EXTEND, prefix=[1, 2], ext=[1, 2])
    for start, end in [(1, 1), (-1, 2), (0, 3)]:
        with pytest.raises(InvalidArgumentError, match="start, end"):
            slice_batch(b, start, end)
    with pytest.raises(InvalidArgumentError, match="boundaries"):
        split_batch_by_requests(b, [0, 0, 2])
    with pytest.raises(InvalidArgumentError, match="query"):
        reshape_query_for_uniform_batch(torch.zeros(7, 2, 4), 2)
    with pytest.raises(InvalidArgumentError, match="extend_seq_lens_cpu"):
        query_lens(ForwardBatch(ForwardMode.EXTEND, 1, *([torch.zeros(1)] * 3), 0, torch.zeros(1), torch.zeros(1)))


# ---- random batches against plain loops --------------------------------------------------------------


def _min_swaps_brute_force(lens: list[int], threshold: int) -> int:
    """Fewest transpositions of any permutation leaving every decode before every prefill (n - cycles)."""
    n, best = len(lens), len(lens)
    for perm in itertools.permutations(range(n)):
        after = [lens[p] for p in perm]
        if any(after[i] > threshold and after[j] <= threshold for i in range(n) for j in range(i + 1, n)):
            continue
        seen, cycles = set(), 0
        for i in range(n):
            if i not in seen:
                cycles += 1
                while i not in seen:
                    seen.add(i)
                    i = perm[i]
        best = min(best, n - cycles)
    return best


@pytest.mark.parametrize("seed", range(120))
def test_decode_first_order_and_split_against_loops(seed):
    rng = random.Random(seed)
    n = rng.randint(0, 6 if seed < 60 else 40)
    threshold = rng.choice([1, 1, 2, 3])
    lens = [rng.choice([0, 1, 1, 1, 2, 3, rng.randint(1, 50)]) for _ in range(n)]
    order = decode_first_order(lens, threshold)
    assert sorted(order) == list(range(n))
    after = [lens[i] for i in order]
    moved = [i for i in range(n) if order[i] != i]
    assert all(order[order[i]] == i for i in range(n))  # disjoint swaps
    if n <= 6:
        assert len(moved) // 2 == _min_swaps_brute_force(lens, threshold)
    # plain loop: count the decode run and the tokens on each side
    d = 0
    for length in after:
        if length > threshold:
            break
        d += 1
    assert all(length > threshold for length in after[d:])
    split = split_decodes_and_prefills(after, threshold)
    assert split == DecodePrefillSplit(d, n - d, sum(after[:d]), sum(after[d:]))
    if d and d < n and after != lens:
        with pytest.raises(InvalidArgumentError):  # the unordered batch is refused when out of order
            bad = after[d:] + after[:d]
            split_decodes_and_prefills(bad, threshold)


def test_decode_first_split_worked_examples():
    split = decode_first_split([3, 1, 0, 1])
    assert split == DecodeFirstSplit(order=(3, 1, 2, 0), query_lens=(1, 1, 0, 3), num_decodes=2)
    assert not split.is_identity
    assert split.token_rows().tolist() == [4, 3, 0, 1, 2]
    assert split.requests(torch.tensor([3, 1, 0, 1])).tolist() == [1, 1, 0, 3]
    same = decode_first_split([1, 1, 5, 0])
    assert same.is_identity and same.num_decodes == 2 and same.token_rows().tolist() == [0, 1, 2, 3, 4, 5, 6]
    rows = split.to_device("cpu")  # RowOrder's docstring example
    q = torch.arange(5.0)[:, None] * 10
    assert rows.tokens(q).flatten().tolist() == [40, 30, 0, 10, 20]
    assert rows.tokens(q, first=2).flatten().tolist() == [0, 10, 20]
    assert torch.equal(rows.scatter_tokens(rows.tokens(q)), q)
    assert rows.requests(torch.tensor([3, 1, 0, 1])).tolist() == [1, 1, 0, 3]
    ident = same.to_device("cpu")
    assert ident.request_rows is None and ident.tokens(q).data_ptr() == q.data_ptr() and ident.scatter_tokens(q) is q


@pytest.mark.parametrize("seed", range(8))
def test_decode_first_split_against_loops(seed):
    rng = random.Random(seed)
    lens = [rng.choice([0, 1, 1, 2, 7]) for _ in range(rng.randint(1, 14))]
    split = decode_first_split(lens)
    assert [lens[r] for r in split.order] == list(split.query_lens)
    assert list(split.query_lens[: split.num_decodes]) == [1] * lens.count(1)
    assert all(n != 1 for n in split.query_lens[split.num_decodes :])
    assert split.order == tuple(decode_first_order([1 if n == 1 else 2 for n in lens]))  # the fewest swaps
    starts = [sum(lens[:r]) for r in range(len(lens))]
    expected = [starts[r] + j for r in split.order for j in range(lens[r])]
    assert split.token_rows().tolist() == expected
    x = torch.randn(sum(lens), 3)
    rows = split.to_device("cpu")
    assert torch.equal(rows.tokens(x), x[expected]) and torch.equal(rows.scatter_tokens(x[expected]), x)


def _batch(
    mode: ForwardMode,
    prefix: list[int],
    ext: list[int],
    encoder: list[int] | None = None,
    rng: random.Random | None = None,
) -> ForwardBatch:
    """A ForwardBatch with distinct random slots/positions (only what slicing reads; no pools)."""
    rng = rng or random.Random(0)
    bs, tokens = len(ext), sum(ext)
    seq = [p + e for p, e in zip(prefix, ext)]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    fields = dict(
        forward_mode=mode,
        batch_size=bs,
        req_pool_indices=i64(rng.sample(range(100), bs)),
        seq_lens=i32(seq),
        seq_lens_cpu=i32(seq),
        seq_lens_sum=sum(seq),
        out_cache_loc=i64(rng.sample(range(1, 10_000), tokens)),
        positions=i64([rng.randint(0, 500) for _ in range(tokens)]),
    )
    if mode.is_extend():
        start = [sum(ext[:r]) for r in range(bs)]
        fields.update(
            extend_prefix_lens=i32(prefix),
            extend_prefix_lens_cpu=i32(prefix),
            extend_seq_lens=i32(ext),
            extend_seq_lens_cpu=i32(ext),
            extend_start_loc=i32(start),
            extend_num_tokens=tokens,
        )
    if encoder is not None:
        enc_tokens = sum(e for e, p in zip(encoder, prefix) if p == 0)
        fields.update(
            encoder_lens=i32(encoder),
            encoder_lens_cpu=i32(encoder),
            encoder_out_cache_loc=i64(rng.sample(range(10_000, 20_000), enc_tokens)),
        )
    if mode.is_target_verify():
        masks = [torch.rand(ext[r], seq[r], generator=torch.Generator().manual_seed(r)) < 0.5 for r in range(bs)]
        indptr = [0]
        for m in masks:
            indptr.append(indptr[-1] + m.numel())
        fields["spec_info"] = SpecInfo(
            num_draft_tokens=ext[0], custom_mask=torch.cat([m.flatten() for m in masks]), mask_indptr=i32(indptr)
        )
    return ForwardBatch(**fields)


MODES = [ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND]


@pytest.mark.parametrize("seed", range(60))
def test_slice_batch_against_loops(seed):
    rng = random.Random(seed)
    mode = MODES[seed % len(MODES)]
    bs = rng.randint(1, 7)
    prefix = [rng.choice([0, rng.randint(1, 20)]) for _ in range(bs)]
    if mode is ForwardMode.DECODE:
        ext = [1] * bs
    elif mode is ForwardMode.TARGET_VERIFY:
        ext = [rng.randint(1, 4)] * bs
    else:
        ext = [rng.choice([0, 1, rng.randint(1, 9)]) for _ in range(bs)]
    encoder = [rng.randint(0, 5) for _ in range(bs)] if mode is ForwardMode.EXTEND and rng.random() < 0.5 else None
    b = _batch(mode, prefix, ext, encoder, rng)
    assert query_lens(b) == ext
    start = rng.randint(0, bs - 1)
    end = rng.randint(start + 1, bs)
    part = slice_batch(b, start, end)

    # plain loops over the parent
    tok_first = 0
    for r in range(start):
        tok_first += ext[r]
    tok_last = tok_first
    for r in range(start, end):
        tok_last += ext[r]
    assert token_range(b, start, end) == (tok_first, tok_last)
    assert part.forward_mode is mode and part.batch_size == end - start
    assert part.req_pool_indices.tolist() == b.req_pool_indices.tolist()[start:end]
    seq = [prefix[r] + ext[r] for r in range(start, end)]
    assert part.seq_lens.tolist() == seq and part.seq_lens_cpu.tolist() == seq and part.seq_lens_sum == sum(seq)
    assert part.out_cache_loc.tolist() == b.out_cache_loc.tolist()[tok_first:tok_last]
    assert part.positions.tolist() == b.positions.tolist()[tok_first:tok_last]
    assert query_lens(part) == ext[start:end]
    if mode.is_extend():
        starts, acc = [], 0
        for r in range(start, end):
            starts.append(acc)
            acc += ext[r]
        assert part.extend_start_loc.tolist() == starts and part.extend_num_tokens == acc
        assert part.extend_prefix_lens.tolist() == prefix[start:end] == part.extend_prefix_lens_cpu.tolist()
        assert part.extend_seq_lens.tolist() == ext[start:end]
    if encoder is not None:
        assert part.encoder_lens_cpu.tolist() == encoder[start:end]
        enc_first = 0
        for r in range(start):
            enc_first += encoder[r] if prefix[r] == 0 else 0
        enc_count = 0
        for r in range(start, end):
            enc_count += encoder[r] if prefix[r] == 0 else 0
        assert (
            part.encoder_out_cache_loc.tolist() == b.encoder_out_cache_loc.tolist()[enc_first : enc_first + enc_count]
        )
    if mode.is_target_verify():
        mask, indptr = b.spec_info.custom_mask, b.spec_info.mask_indptr.tolist()
        expect, ptr = [], [0]
        for r in range(start, end):
            expect += mask[indptr[r] : indptr[r + 1]].tolist()
            ptr.append(ptr[-1] + indptr[r + 1] - indptr[r])
        assert part.spec_info.custom_mask.tolist() == expect and part.spec_info.mask_indptr.tolist() == ptr
    # the pieces of a split put back together are the parent
    bounds = sorted({0, bs, *rng.sample(range(1, bs + 1), rng.randint(0, bs - 1))}) if bs > 1 else [0, 1]
    pieces = split_batch_by_requests(b, bounds)
    assert torch.equal(torch.cat([p.out_cache_loc for p in pieces]), b.out_cache_loc)
    assert torch.equal(torch.cat([p.seq_lens for p in pieces]), b.seq_lens)


@pytest.mark.parametrize("seed", range(20))
def test_uniform_reshape_against_loops(seed):
    rng = random.Random(seed)
    bs, q_len, heads, dim = rng.randint(1, 6), rng.randint(1, 5), rng.randint(1, 4), rng.choice([8, 16])
    q = torch.randn(bs * q_len, heads, dim, generator=torch.Generator().manual_seed(seed))
    view = reshape_query_for_uniform_batch(q, bs)
    for r in range(bs):
        for i in range(q_len):
            assert torch.equal(view[r, i], q[r * q_len + i])
    out = torch.randn(bs, q_len, heads * dim).transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous
    flat = flatten_uniform_output(out)
    for r in range(bs):
        for i in range(q_len):
            assert torch.equal(flat[r * q_len + i], out[r, i])
    verify = _batch(ForwardMode.TARGET_VERIFY, [rng.randint(0, 9) for _ in range(bs)], [q_len] * bs)
    assert uniform_query_len(verify) == q_len
