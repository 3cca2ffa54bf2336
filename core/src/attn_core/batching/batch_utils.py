"""Pure helpers that shape a batch for a backend: how many requests are decodes, reordering a batch
decode-first, slicing a batch into request ranges, and viewing the queries of a uniform batch (every
request the same number of new tokens, e.g. spec-decode verify) as `[batch, tokens, heads, dim]`.

Everything reads host data only (`*_cpu` copies and Python ints), so none of it waits for the device;
`RowOrder` applies a decode-first order to device tensors (gathers and one scatter, no sync).
A request's *query length* is the number of new tokens it brings this step: 1 in DECODE, its
`extend_seq_lens_cpu` entry in the extend-like modes (EXTEND, MIXED, TARGET_VERIFY, DRAFT_EXTEND,
SPLIT_PREFILL), 0 in IDLE / DUMMY_FIRST.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from attn_core.batching.tbo_split import TboSplit, split_forward_batch
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.errors import InvalidArgumentError

BatchOrLens = Union[ForwardBatch, Sequence[int]]


def query_lens(batch: BatchOrLens) -> list[int]:
    """Number of new tokens of each request, from host data.

    Example: a MIXED batch with `extend_seq_lens_cpu = [1, 1, 7]` gives `[1, 1, 7]`; a DECODE batch of
    3 requests gives `[1, 1, 1]`; a list of ints is returned as a list of ints (checked ≥ 0).
    """
    if not isinstance(batch, ForwardBatch):
        lens = [int(n) for n in batch]
        if any(n < 0 for n in lens):
            raise InvalidArgumentError("query_lens", "lengths >= 0", lens)
        return lens
    mode = batch.forward_mode
    if mode.is_decode():
        return [1] * batch.batch_size
    if mode.is_no_tokens():
        return [0] * batch.batch_size
    if batch.extend_seq_lens_cpu is None:
        raise InvalidArgumentError(
            "batch.extend_seq_lens_cpu", f"a host tensor of {batch.batch_size} lengths for {mode.name}", None
        )
    return [int(n) for n in batch.extend_seq_lens_cpu.tolist()]


def _check_threshold(decode_threshold: int) -> int:
    if isinstance(decode_threshold, bool) or not isinstance(decode_threshold, int) or decode_threshold < 1:
        raise InvalidArgumentError("decode_threshold", "an int >= 1", decode_threshold)
    return decode_threshold


@dataclass(frozen=True)
class DecodePrefillSplit:
    """The decode part (requests [0, num_decodes), tokens [0, num_decode_tokens)) and the prefill part
    (the rest) of a decode-first batch."""

    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int


def split_decodes_and_prefills(batch: BatchOrLens, decode_threshold: int = 1) -> DecodePrefillSplit:
    """Count the decodes and prefills of a batch ordered decode-first (see `decode_first_order`).

    A request is a decode when its query length is at most `decode_threshold` (1: plain decoding; k: a
    spec-decode verify of k tokens can use the decode kernel too). A request of length 0 counts as a
    decode. Raises `InvalidArgumentError` when a decode follows a prefill: reorder the batch first.

    Worked example: query lengths `[1, 1, 2, 5, 3]`
        decode_threshold=1: decodes are the first 2 requests (2 tokens), prefills the other 3
            (2 + 5 + 3 = 10 tokens) → DecodePrefillSplit(2, 3, 2, 10)
        decode_threshold=2: `[1, 1, 2]` are decodes → DecodePrefillSplit(3, 2, 4, 8)
    and `[1, 5, 1]` raises (the decode at index 2 follows the prefill at index 1).
    """
    threshold = _check_threshold(decode_threshold)
    lens = query_lens(batch)
    num_decodes = 0
    while num_decodes < len(lens) and lens[num_decodes] <= threshold:
        num_decodes += 1
    late = [i for i in range(num_decodes, len(lens)) if lens[i] <= threshold]
    if late:
        raise InvalidArgumentError(
            "batch",
            f"decodes (query length <= {threshold}) before every prefill (reorder with decode_first_order)",
            f"a decode at index {late[0]}",
        )
    decode_tokens = sum(lens[:num_decodes])
    return DecodePrefillSplit(num_decodes, len(lens) - num_decodes, decode_tokens, sum(lens) - decode_tokens)


def decode_first_order(batch: BatchOrLens, decode_threshold: int = 1) -> list[int]:
    """The permutation that puts every decode (query length ≤ `decode_threshold`) before every prefill
    with the fewest swaps: request `order[i]` moves to position i. The engine applies it.

    With D decodes, the decodes must fill positions [0, D). Each prefill found there swaps with a decode
    found in [D, n): k misplaced prefills cost exactly k swaps, the minimum (a swap fixes at most one
    misplaced prefill). The i-th misplaced prefill from the left pairs with the i-th misplaced decode
    from the right. `order` is its own inverse, and its swaps are the pairs (i, order[i]) with
    i < order[i]; every request already in place keeps its position.

    Worked example: query lengths `[3, 1, 4, 1, 1, 2]` (threshold 1) have D = 3 decodes; positions 0 and
    2 hold prefills, positions 3 and 4 hold decodes. Pairs: 0 ↔ 4, 2 ↔ 3 → order
    `[4, 1, 3, 2, 0, 5]`, lengths after `[1, 1, 1, 4, 3, 2]` (2 swaps).
    """
    threshold = _check_threshold(decode_threshold)
    lens = query_lens(batch)
    num_decodes = sum(1 for n in lens if n <= threshold)
    front_prefills = [i for i in range(num_decodes) if lens[i] > threshold]
    back_decodes = [i for i in range(len(lens) - 1, num_decodes - 1, -1) if lens[i] <= threshold]
    order = list(range(len(lens)))
    for p, d in zip(front_prefills, back_decodes):
        order[p], order[d] = d, p
    return order


@dataclass(frozen=True)
class DecodeFirstSplit:
    """A MIXED batch put decode-first for a backend that runs its one-token requests (decodes) through a
    decode kernel and the others through an extend kernel (see `decode_first_split`).

    order: request `order[i]` of the batch goes to position i (`decode_first_order`, fewest swaps);
    query_lens: each request's new tokens, in the new order; num_decodes: requests [0, num_decodes) of
    the new order have exactly one new token each (so they own q rows [0, num_decodes)). A request with
    no new token is not a decode here (a decode kernel reads exactly one query per request)."""

    order: tuple[int, ...]
    query_lens: tuple[int, ...]
    num_decodes: int

    @property
    def is_identity(self) -> bool:
        """Whether the batch is already decode-first (no request moves: nothing to gather per layer)."""
        return all(i == r for i, r in enumerate(self.order))

    def requests(self, x: torch.Tensor) -> torch.Tensor:
        """A per-request host tensor `[batch_size, ...]` in the decode-first order (x itself for an
        identity order). Example: order `(3, 1, 2, 0)`, x `[3, 1, 0, 1]` → `[1, 1, 0, 3]`."""
        return x if self.is_identity else x[torch.tensor(self.order, dtype=torch.int64)]

    def token_rows(self) -> torch.Tensor:
        """Rows of q (request after request, in the batch's order) in the decode-first order, as a host
        int64 `[num_tokens]` tensor: row i of the reordered q is row `token_rows()[i]` of the batch's.
        Vectorized (a step may carry thousands of tokens).

        Worked example: query lengths `[3, 1, 0, 1]` (request r owns rows 0-2, 3, none, 4), order
        `[3, 1, 2, 0]` → `tensor([4, 3, 0, 1, 2])`.
        """
        perm = torch.tensor(self.order, dtype=torch.int64)
        moved = torch.tensor(self.query_lens, dtype=torch.int64)
        lens = torch.empty_like(moved).index_copy_(0, perm, moved)  # the batch's own order
        starts = torch.cumsum(lens, 0) - lens  # first row of each request in the batch's q
        # row j of reordered request i: starts[order[i]] + j, at reordered position new_starts[i] + j
        shift = starts[perm] - (torch.cumsum(moved, 0) - moved)
        return torch.repeat_interleave(shift, moved) + torch.arange(int(moved.sum()))

    def to_device(self, device: Union[str, torch.device]) -> RowOrder:
        """The permutation on `device` (one host→device copy, none for an identity order), to gather the
        per-request and per-token tensors of the batch into the decode-first order and scatter outputs
        back."""
        if self.is_identity:
            return RowOrder(None, None)
        host = torch.cat([torch.tensor(self.order, dtype=torch.int64), self.token_rows()])
        both = host.to(device, non_blocking=True)
        n = len(self.order)
        return RowOrder(both[:n], both[n:])


def decode_first_split(batch: BatchOrLens) -> DecodeFirstSplit:
    """The decode-first order of a MIXED batch for a decode/extend split: decodes are the requests with
    exactly one new token (a request with none joins the extend part), moved first with the fewest
    swaps (`decode_first_order`).

    Worked example: query lengths `[3, 1, 0, 1]`: requests 1 and 3 are decodes; position 0 holds an
    extend request and position 3 a decode, so they swap → `DecodeFirstSplit(order=(3, 1, 2, 0),
    query_lens=(1, 1, 0, 3), num_decodes=2)`; `[1, 1, 5, 0]` is already decode-first (identity order,
    num_decodes 2).
    """
    lens = query_lens(batch)
    order = decode_first_order([1 if n == 1 else 2 for n in lens], decode_threshold=1)
    return DecodeFirstSplit(tuple(order), tuple(lens[r] for r in order), sum(1 for n in lens if n == 1))


@dataclass(frozen=True)
class RowOrder:
    """`DecodeFirstSplit`'s permutation on the device: requests (int64 `[batch_size]`) and tokens (int64
    `[num_tokens]`), both None when the batch is already decode-first (every method is then a view or
    the tensor itself, no copy).

    Example: order `[3, 1, 2, 0]` over query lengths `[3, 1, 0, 1]`: `requests(x)` of a per-request x
    is `x[[3, 1, 2, 0]]`; `tokens(q)` is `q[[4, 3, 0, 1, 2]]` and `tokens(q, first=2)` its last 3 rows
    (`q[[0, 1, 2]]`); `scatter_tokens(o)` puts row i of a decode-first o back at row `[4, 3, 0, 1, 2][i]`.
    """

    request_rows: Optional[torch.Tensor]
    token_rows: Optional[torch.Tensor]

    def requests(self, x: torch.Tensor) -> torch.Tensor:
        """A per-request device tensor `[batch_size, ...]` in the decode-first order (host tensors:
        `DecodeFirstSplit.requests`)."""
        return x if self.request_rows is None else x.index_select(0, self.request_rows)

    def tokens(self, x: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Rows [first, num_tokens) of a per-token tensor `[num_tokens, ...]` in the decode-first order
        (a view when the order is the identity, else one gather)."""
        return x[first:] if self.token_rows is None else x.index_select(0, self.token_rows[first:])

    def scatter_tokens(self, y: torch.Tensor) -> torch.Tensor:
        """A per-token result `[num_tokens, ...]` in the decode-first order, back in the batch's order
        (`y` itself when the order is the identity, else one scatter into a new tensor)."""
        return y if self.token_rows is None else torch.empty_like(y).index_copy_(0, self.token_rows, y)


def slice_batch(batch: ForwardBatch, start: int, end: int) -> ForwardBatch:
    """The batch of requests [start, end) of `batch`: per-request fields sliced, per-token fields
    (q/k/v rows, `out_cache_loc`, `positions`) cut at those requests' token boundaries,
    `extend_start_loc` and a verify mask's `mask_indptr` rebased to 0, `seq_lens_sum` and
    `extend_num_tokens` recomputed. Tensors are views of the parent's where no value changes. Built
    on the two-batch-overlap splitter (`attn_core.batching.tbo_split`), cutting at request boundaries.

    Worked example: an EXTEND batch with query lengths `[2, 3, 4]`, seq_lens `[5, 3, 10]`:
    `slice_batch(b, 1, 3)` holds requests 1 and 2 (seq_lens `[3, 10]`, extend_seq_lens `[3, 4]`,
    extend_start_loc `[0, 3]`, seq_lens_sum 13, 7 tokens: `out_cache_loc[2:9]` of the parent).
    The matching q rows of the parent are `q[2:9]` (`token_range(b, 1, 3)`).
    """
    n = batch.batch_size
    if not (0 <= start < end <= n):
        raise InvalidArgumentError("start, end", f"0 <= start < end <= batch_size={n}", (start, end))
    lens = query_lens(batch)
    head = batch if end == n else split_forward_batch(batch, TboSplit(end, sum(lens[:end])))[0]
    return head if start == 0 else split_forward_batch(head, TboSplit(start, sum(lens[:start])))[1]


def token_range(batch: BatchOrLens, start: int, end: int) -> tuple[int, int]:
    """The rows [first, last) of q/k/v that requests [start, end) own.

    Example: query lengths `[2, 3, 4]`: requests [1, 3) own rows (2, 9).
    """
    lens = query_lens(batch)
    if not (0 <= start <= end <= len(lens)):
        raise InvalidArgumentError("start, end", f"0 <= start <= end <= {len(lens)}", (start, end))
    first = sum(lens[:start])
    return first, first + sum(lens[start:end])


def split_batch_by_requests(batch: ForwardBatch, boundaries: Sequence[int]) -> list[ForwardBatch]:
    """`slice_batch` for each consecutive pair of `boundaries` (increasing request indices from 0 to
    batch_size), e.g. micro-batches, or the decode and prefill parts of `split_decodes_and_prefills`.

    Example: a batch of 5 requests with boundaries `[0, 2, 5]` gives requests [0, 2) and [2, 5).
    """
    bounds = [int(b) for b in boundaries]
    if (
        len(bounds) < 2
        or bounds[0] != 0
        or bounds[-1] != batch.batch_size
        or any(a >= b for a, b in zip(bounds, bounds[1:]))
    ):
        raise InvalidArgumentError(
            "boundaries", f"strictly increasing request indices from 0 to batch_size={batch.batch_size}", bounds
        )
    return [slice_batch(batch, a, b) for a, b in zip(bounds, bounds[1:])]


def uniform_query_len(batch: BatchOrLens) -> Optional[int]:
    """The query length every request shares, or None when they differ (or there is no request).

    Example: a TARGET_VERIFY batch of 4 requests with 3 draft tokens each gives 3; lengths `[1, 2]`
    give None.
    """
    lens = query_lens(batch)
    return shared_query_len(len(lens), sum(lens), longest=max(lens, default=0))


def shared_query_len(
    batch_size: int, num_tokens: int, *, longest: Optional[int] = None, lens: Optional[torch.Tensor] = None
) -> Optional[int]:
    """The number of new tokens every one of `batch_size` requests carries, when they all carry the same,
    else None (and None for no request); from host numbers only, for per-step code (`uniform_query_len`
    takes a batch or a list). 0 when every request carries none: callers that need tokens test the
    result's truth.

    With `longest` (the longest request's count, which the caller often has already) the rule is O(1):
    the counts are all equal exactly when num_tokens == batch_size * longest (none exceeds the longest,
    so equality of the sum forces all of them); a CUDA-graph batch, every request padded to the captured
    count, passes the same test. With `lens` (host int tensor `[batch_size]`) each count is compared. A
    DECODE step, where the caller has no lengths at all, carries 1 each (`shared_query_len(bs, bs,
    longest=1)`).

    Examples: (3, 12, longest=4) -> 4; (3, 10, longest=4) -> None (counts 4, 4, 2);
    (2, 6, lens=[3, 3]) -> 3; (2, 3, lens=[1, 2]) -> None; (2, 0, longest=0) -> 0; (0, 0, longest=0) -> None.
    """
    if batch_size < 1 or num_tokens % batch_size:
        return None
    n = num_tokens // batch_size
    if longest is not None:
        return n if longest == n else None
    if lens is None:
        raise InvalidArgumentError("lens", "the host query lengths when `longest` is not given", None)
    return n if bool((lens.numpy() == n).all()) else None


def reshape_query_for_uniform_batch(query: torch.Tensor, batch_size: int) -> torch.Tensor:
    """View the flattened queries of a uniform batch, `[batch_size * L, ...]` (request after request,
    as attention receives them), as `[batch_size, L, ...]`. No copy; `flatten_uniform_output` undoes it.

    Example: q of shape `[12, 8, 128]` (4 requests verifying 3 draft tokens, 8 heads of 128) and
    batch_size 4 give a view `[4, 3, 8, 128]` whose `[r, i]` is q row `3 * r + i`.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgumentError("batch_size", "an int >= 1", batch_size)
    if query.dim() < 1 or query.shape[0] % batch_size:
        raise InvalidArgumentError(
            "query", f"a leading dimension divisible by batch_size={batch_size}", tuple(query.shape)
        )
    return query.view(batch_size, query.shape[0] // batch_size, *query.shape[1:])


def flatten_uniform_output(output: torch.Tensor) -> torch.Tensor:
    """`[batch_size, L, ...]` → `[batch_size * L, ...]` (request after request), a view when `output` is
    contiguous in its first two dimensions, else a copy.

    Example: an output `[4, 3, 8, 128]` becomes `[12, 8, 128]`, row `3 * r + i` being `output[r, i]`.
    """
    if output.dim() < 2:
        raise InvalidArgumentError("output", "a tensor [batch_size, L, ...]", tuple(output.shape))
    return output.reshape(output.shape[0] * output.shape[1], *output.shape[2:])
