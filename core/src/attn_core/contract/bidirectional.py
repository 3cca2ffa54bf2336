"""Per-request bidirectional spans in the paged path (`ForwardBatch.bidirectional_spans`): their rule,
their validation and the visibility they give.

A request r with span (a, b) runs its `attn_type="decoder_bidirectional"` layers with this visibility
between a query at decoder position p and a key at position j:

    visible(p, j) = j <= p  or  (a <= p < b and a <= j < b)

so the span's positions see each other and every other position stays causal; (0, 0) (or any a == b)
is no span. A query inside the span needs every key of the span: whenever one of the step's queries
(positions seq_len - q_len … seq_len - 1) lies in [a, b), b <= seq_len must hold, so a chunked prefill
must not cut a span. Spans never apply under a TARGET_VERIFY custom mask (the mask alone decides; a
batch with both is refused). In DECODE the one query is the request's last position, which sees every
key anyway: spans change nothing there.

`check_bidirectional_spans` is the rule as a validation (run by `AttentionBackend.init_forward_metadata`
for every backend); `span_visible` the visibility as a tensor expression; `bidirectional_span_mask` the
per-request `[q_len, seq_len]` masks of a step flattened as FlashInfer's custom masks are.
"""

from __future__ import annotations

import torch

from attn_core.contract.batch import ForwardBatch, batch_field
from attn_core.contract.errors import InvalidBatchError

_FIELD = "forward_batch.bidirectional_spans"


def check_bidirectional_spans(b: ForwardBatch, device: torch.device, full: bool = False) -> None:
    """Raise `InvalidBatchError` naming `bidirectional_spans` unless batch `b`'s spans follow the rule of
    the module docstring: both copies or neither; the device copy int32 `[bs, 2]` on `device`, the host
    copy int32/int64 `[bs, 2]` on the CPU; 0 <= a <= b per request; b <= seq_len when a query of the step
    lies in [a, b); no TARGET_VERIFY custom mask. Host copies only (no sync), unless `full`: then also
    the device copy against the host copy (one sync).

    Example: a request with seq_len 10 and 4 new tokens (queries at 6..9) accepts spans (2, 10), (0, 6),
    (12, 20), (0, 0) and refuses (5, 11) (a query at 6..9 inside it, key 10 not in the step)."""
    spans, host = b.bidirectional_spans, b.bidirectional_spans_cpu
    if spans is None and host is None:
        return
    bs = b.batch_size
    if spans is None or host is None:
        raise InvalidBatchError(
            _FIELD, "the device tensor and its host copy bidirectional_spans_cpu together", "only one"
        )
    if spans.dtype != torch.int32 or tuple(spans.shape) != (bs, 2) or spans.device != device:
        raise InvalidBatchError(
            _FIELD, f"an int32 tensor of shape ({bs}, 2) on {device}", (spans.dtype, tuple(spans.shape), spans.device)
        )
    if host.dtype not in (torch.int32, torch.int64) or tuple(host.shape) != (bs, 2) or host.device.type != "cpu":
        found = (host.dtype, tuple(host.shape), host.device)
        raise InvalidBatchError(f"{_FIELD}_cpu", f"an int32/int64 CPU tensor of shape ({bs}, 2)", found)
    mode = b.forward_mode
    if mode.is_target_verify() and b.spec_info is not None and b.spec_info.custom_mask is not None:
        raise InvalidBatchError(
            _FIELD, "None in a TARGET_VERIFY step with a custom mask (the mask alone decides)", "spans"
        )
    if bs == 0 or mode.is_no_tokens():
        return
    h = host.to(torch.int64)
    a, e = h[:, 0], h[:, 1]
    seq = b.seq_lens_cpu.to(torch.int64)
    q_lens = (
        torch.ones_like(seq)
        if mode.is_decode()
        else batch_field(b.extend_seq_lens_cpu, "extend_seq_lens_cpu").to(torch.int64)
    )
    if bool((a < 0).any()) or bool((e < a).any()):
        raise InvalidBatchError(f"{_FIELD}_cpu", "0 <= a <= b for every span (a, b)", h.tolist())
    first_query = seq - q_lens
    queried = (a < e) & (a < seq) & (e > first_query)  # a query position of the step lies in [a, b)
    cut = queried & (e > seq)
    if bool(cut.any()):
        r = int(cut.nonzero()[0])
        where = f"request {r}: span {tuple(h[r].tolist())}, keys 0..{int(seq[r]) - 1} in the step"
        raise InvalidBatchError(
            f"{_FIELD}_cpu", "b <= seq_len for a span holding a query of the step (no chunk may cut a span)", where
        )
    if full and not torch.equal(spans.cpu().to(torch.int64), h):
        raise InvalidBatchError(_FIELD, f"the values of its host copy {h.tolist()}", spans.cpu().tolist())


def span_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """The visibility of the module docstring, broadcast: bool `k_pos <= q_pos or (start <= q_pos < end and
    start <= k_pos < end)` over tensors of broadcastable shapes (positions and span bounds as integers).

    Example: q_pos [[3], [6]], k_pos [[0, 4, 5]], span (2, 5) → [[T, T, F], [T, T, T]] (query 3 sees key 4,
    inside its span; query 6 sees everything before it)."""
    in_q = (q_pos >= start) & (q_pos < end)
    in_k = (k_pos >= start) & (k_pos < end)
    return (k_pos <= q_pos) | (in_q & in_k)


def bidirectional_span_mask(
    spans: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor, total: int
) -> torch.Tensor:
    """Every request's visibility `[q_len, seq_len]` (row-major, its queries the last q_len of its seq_len
    keys) flattened and concatenated, as a flat bool tensor of `total` = sum(q_len · seq_len) entries (a
    host int: no sync) on the tensors' device. spans `[bs, 2]`, seq_lens / q_lens `[bs]` (integers).

    Example: one request, seq_len 4, q_len 2, span (1, 4): queries at 2, 3 →
    [[T, T, T, T], [T, T, T, T]] flattened; with span (0, 0): [[T, T, T, F], [T, T, T, T]]."""
    dev = seq_lens.device
    seq, q = seq_lens.to(torch.int64), q_lens.to(torch.int64)
    sizes = q * seq
    offsets = torch.cumsum(sizes, 0) - sizes
    r = torch.repeat_interleave(torch.arange(seq.shape[0], device=dev), sizes, output_size=total)
    local = torch.arange(total, device=dev) - offsets[r]
    row, col = local // seq[r].clamp_min(1), local % seq[r].clamp_min(1)
    q_pos = seq[r] - q[r] + row
    s = spans.to(torch.int64)
    return span_visible(q_pos, col, s[r, 0], s[r, 1])


__all__ = ["bidirectional_span_mask", "check_bidirectional_spans", "span_visible"]
