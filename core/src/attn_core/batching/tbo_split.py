"""The two-batch-overlap splitter: cut one `ForwardBatch` into two child batches whose attention,
run child A then child B layer by layer, equals the attention of the whole batch.

DECODE and TARGET_VERIFY batches split by requests: A takes the first ceil(bs/2). Extend-like batches
(EXTEND, MIXED, DRAFT_EXTEND, SPLIT_PREFILL) split to balance tokens: A takes the first ceil(T/2) new
tokens; when that boundary falls inside a request and cutting is allowed, the request is cut in two:
its first part stays in A, its second part becomes a request of B with a longer prefix (the first
part's tokens, whose K/V child A has written by the time B runs the same layer).

Worked example (EXTEND, requests as (prefix_len, extend_len) in rows 5, 2, 9):
    requests (4, 2), (0, 6), (10, 3): T = 11 new tokens, A takes ceil(11/2) = 6.
    Request 0 brings 2 tokens, request 1 would bring it to 8: request 1 is cut after 4 tokens.
    A: rows [5, 2], requests (4, 2), (0, 4), seq_lens [6, 4],   tokens 0..5
    B: rows [2, 9], requests (4, 2), (10, 3), seq_lens [6, 13], tokens 6..10
    split = TboSplit(seq_index=1, token_index=6, cut_len=4)
Per-token fields (out_cache_loc, positions) are sliced at token_index; per-request fields
(req_pool_indices, seq_lens, extend_*, encoder_lens) at the request boundary with the cut request's
lengths adjusted; encoder_out_cache_loc at the boundary of the encoder tokens A brings; a
TARGET_VERIFY custom mask and its mask_indptr at request seq_index (B's indptr rebased to 0).

All lengths come from the host copies (`*_cpu`), so splitting never waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import torch

from attn_core.batching.positions import extend_start_loc_from_lens
from attn_core.contract.batch import ForwardBatch, SpecInfo, batch_field
from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.forward_mode import ForwardMode


@dataclass(frozen=True)
class TboSplit:
    """Where a batch is cut. Child A holds requests [0, seq_index) (plus the first `cut_len` new tokens
    of request seq_index when cut_len > 0) and tokens [0, token_index); child B holds requests
    [seq_index, bs) (request seq_index without its first cut_len tokens) and the remaining tokens."""

    seq_index: int
    token_index: int
    cut_len: int = 0


def compute_tbo_split(mode: ForwardMode, extend_lens: Sequence[int], *, allow_cut: bool = True) -> Optional[TboSplit]:
    """Where to cut a batch of `mode` whose requests bring `extend_lens` new tokens (1 each for DECODE),
    or None when it cannot be cut into two children with at least one token each."""
    lens = [int(e) for e in extend_lens]
    total = sum(lens)
    if mode.is_no_tokens() or total < 2:
        return None
    if mode.is_decode() or mode.is_target_verify():
        if len(lens) < 2:
            return None
        s = (len(lens) + 1) // 2
        return TboSplit(seq_index=s, token_index=sum(lens[:s]))
    half = (total + 1) // 2
    r, cum = 0, 0
    while cum + lens[r] < half:  # r: the request holding the half-way token
        cum += lens[r]
        r += 1
    e = lens[r]
    if cum + e == half:
        return TboSplit(seq_index=r + 1, token_index=half)
    if allow_cut:
        return TboSplit(seq_index=r, token_index=half, cut_len=half - cum)
    # no cut: the request boundary nearer to the middle that leaves tokens on both sides
    options = [
        (abs(b_tokens - half), seq, b_tokens) for seq, b_tokens in ((r, cum), (r + 1, cum + e)) if 0 < b_tokens < total
    ]
    if not options:
        return None
    _, seq, tokens = min(options)
    return TboSplit(seq_index=seq, token_index=tokens)


def split_batch(forward_batch: ForwardBatch, *, allow_cut: bool = True) -> Optional[tuple[ForwardBatch, ForwardBatch]]:
    """`compute_tbo_split` + `split_forward_batch` for a batch, or None when it cannot be split."""
    split = compute_tbo_split(forward_batch.forward_mode, _extend_lens_cpu(forward_batch).tolist(), allow_cut=allow_cut)
    return None if split is None else split_forward_batch(forward_batch, split)


def _extend_lens_cpu(b: ForwardBatch) -> torch.Tensor:
    if b.forward_mode.is_decode():
        return torch.ones(b.batch_size, dtype=torch.int32)
    if b.forward_mode.is_no_tokens():
        return torch.zeros(b.batch_size, dtype=torch.int32)
    return batch_field(b.extend_seq_lens_cpu, "extend_seq_lens_cpu")


def _set_first(x: torch.Tensor, value: int) -> torch.Tensor:
    x = x.clone()
    x[0] = value
    return x


def _set_last(x: torch.Tensor, value: int) -> torch.Tensor:
    x = x.clone()
    x[-1] = value
    return x


def split_forward_batch(forward_batch: ForwardBatch, split: TboSplit) -> tuple[ForwardBatch, ForwardBatch]:
    """The two child batches of `split` (see the module docstring). Children share the parent's pools
    and hold views of its tensors where no length changes."""
    b = forward_batch
    mode = b.forward_mode
    n = b.batch_size
    s, t, c = split.seq_index, split.token_index, split.cut_len
    extend_cpu = _extend_lens_cpu(b)
    if not (0 <= s <= n and 0 <= t <= int(extend_cpu.sum())):
        raise InvalidArgumentError(
            "split", f"seq_index in [0, {n}] and token_index in [0, {int(extend_cpu.sum())}]", split
        )
    if c and not (mode.is_extend() and not mode.is_target_verify() and s < n and 0 < c < int(extend_cpu[s])):
        raise InvalidArgumentError(
            "split.cut_len", "0, or 0 < cut_len < extend_len of request seq_index in an extend batch", split
        )
    end_a = s + (1 if c else 0)
    seq_cpu = b.seq_lens_cpu
    prefix_cpu = seq_cpu - extend_cpu

    pos_a, pos_z = (None, None) if b.positions is None else (b.positions[:t], b.positions[t:])
    a: dict[str, Any] = dict(
        batch_size=end_a, req_pool_indices=b.req_pool_indices[:end_a], out_cache_loc=b.out_cache_loc[:t]
    )
    z: dict[str, Any] = dict(
        batch_size=n - s, req_pool_indices=b.req_pool_indices[s:], out_cache_loc=b.out_cache_loc[t:]
    )
    a["positions"], z["positions"] = pos_a, pos_z
    a["seq_lens"], a["seq_lens_cpu"] = b.seq_lens[:end_a], seq_cpu[:end_a]
    z["seq_lens"], z["seq_lens_cpu"] = b.seq_lens[s:], seq_cpu[s:]
    if c:  # A sees the cut request up to its first part only
        cut_seq = int(prefix_cpu[s]) + c
        a["seq_lens"], a["seq_lens_cpu"] = _set_last(a["seq_lens"], cut_seq), _set_last(a["seq_lens_cpu"], cut_seq)
    a["seq_lens_sum"], z["seq_lens_sum"] = int(a["seq_lens_cpu"].sum()), int(z["seq_lens_cpu"].sum())

    if mode.is_extend():
        for child, rows in ((a, slice(0, end_a)), (z, slice(s, n))):
            for f in ("extend_prefix_lens", "extend_prefix_lens_cpu", "extend_seq_lens", "extend_seq_lens_cpu"):
                child[f] = getattr(b, f)[rows]
        if c:
            e_s, p_s = int(extend_cpu[s]), int(prefix_cpu[s])
            a["extend_seq_lens"], a["extend_seq_lens_cpu"] = (
                _set_last(a["extend_seq_lens"], c),
                _set_last(a["extend_seq_lens_cpu"], c),
            )
            z["extend_seq_lens"], z["extend_seq_lens_cpu"] = (
                _set_first(z["extend_seq_lens"], e_s - c),
                _set_first(z["extend_seq_lens_cpu"], e_s - c),
            )
            z["extend_prefix_lens"] = _set_first(z["extend_prefix_lens"], p_s + c)
            z["extend_prefix_lens_cpu"] = _set_first(z["extend_prefix_lens_cpu"], p_s + c)
        a["extend_start_loc"] = batch_field(b.extend_start_loc, "extend_start_loc")[:end_a]
        z["extend_start_loc"] = extend_start_loc_from_lens(z["extend_seq_lens"])
        a["extend_num_tokens"], z["extend_num_tokens"] = t, batch_field(b.extend_num_tokens, "extend_num_tokens") - t

    if b.encoder_lens is not None:
        enc_cpu = batch_field(b.encoder_lens_cpu, "encoder_lens_cpu")
        # encoder tokens come with the requests that start now (prefix 0), in request order
        enc_a = int((enc_cpu[:end_a] * (prefix_cpu[:end_a] == 0)).sum())
        a["encoder_lens"], a["encoder_lens_cpu"] = b.encoder_lens[:end_a], enc_cpu[:end_a]
        z["encoder_lens"], z["encoder_lens_cpu"] = b.encoder_lens[s:], enc_cpu[s:]
        if b.encoder_out_cache_loc is not None:
            a["encoder_out_cache_loc"], z["encoder_out_cache_loc"] = (
                b.encoder_out_cache_loc[:enc_a],
                b.encoder_out_cache_loc[enc_a:],
            )

    spec = b.spec_info
    if spec is not None and spec.custom_mask is not None:
        if c:
            raise InvalidArgumentError("split.cut_len", "0 for a batch with a custom mask", c)
        off = spec.num_draft_tokens * int(seq_cpu[:s].sum())
        indptr = batch_field(spec.mask_indptr, "spec_info.mask_indptr")
        a["spec_info"] = replace(spec, custom_mask=spec.custom_mask[:off], mask_indptr=indptr[: s + 1])
        z["spec_info"] = replace(spec, custom_mask=spec.custom_mask[off:], mask_indptr=indptr[s:] - off)
    return replace(b, **a), replace(b, **z)


def split_spec_info_for_graph(
    spec: Optional[SpecInfo], half: int, seq_lens_cpu: torch.Tensor
) -> tuple[Optional[SpecInfo], Optional[SpecInfo]]:
    """The spec info of the two halves of a graph batch of `len(seq_lens_cpu)` requests split after
    request `half` (`seq_lens_cpu`: host lengths of the padded batch; the mask buffers may be longer
    than the batch needs); unchanged when there is no custom mask."""
    if spec is None or spec.custom_mask is None:
        return spec, spec
    bs = seq_lens_cpu.shape[0]
    off = spec.num_draft_tokens * int(seq_lens_cpu[:half].sum())
    end = off + spec.num_draft_tokens * int(seq_lens_cpu[half:].sum())
    indptr = batch_field(spec.mask_indptr, "spec_info.mask_indptr")
    first = replace(spec, custom_mask=spec.custom_mask[:off], mask_indptr=indptr[: half + 1])
    second = replace(spec, custom_mask=spec.custom_mask[off:end], mask_indptr=indptr[half : bs + 1] - off)
    return first, second
