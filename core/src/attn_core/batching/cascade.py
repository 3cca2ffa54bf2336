"""Cascade attention: many requests over one shared cached prefix.

When every request of a step starts with the same P cached tokens (same KV slots: a shared system
prompt, parallel sampling), attention splits into two passes whose results are merged by LSE
(`attn_core.ops.merge_state`): a *prefix pass* where all the step's queries, as one non-causal group,
attend to the P shared keys (read once instead of once per request), and a *suffix pass* where each
request's queries attend causally to its own keys P … seq_len-1. The engine asks for it per step by
setting `ForwardBatch.cascade_prefix_len` = P (0: off), typically when `use_cascade_attention` says it
pays; a backend serves it when it declares `Feature.CASCADE`.

The two passes see disjoint key sets whose union is the causal key set of every query (every query
sits at a position >= P), so the merge is exact. Layers with a sliding window, a chunked local window,
attention sinks or cross attention do not split this way; backends run them unsplit in the same step.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from attn_core.batching.batch_utils import query_lens
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.errors import InvalidArgumentError

#: defaults of `use_cascade_attention` (the prefix and query-length bounds from the H200 run in
#: docs/dev/perf-notebook.md, "Cascade attention": 64 decodes over a 4096-token prefix 0.89x, over 32768 tokens
#: 1.14x; 64 requests of 256 new tokens over 4096 0.86x)
MIN_PREFIX = 16384
MIN_REQUESTS = 8
MIN_SAVING_RATIO = 4.0
MAX_MEAN_QUERY = 16


def shared_prefix_len(
    rows: Union[torch.Tensor, Sequence[Sequence[int]]], prefix_lens: Sequence[int], page_size: int = 1
) -> int:
    """The longest P such that every request's first P key slots are the same slots, at most each
    request's cached prefix (`prefix_lens[r]`: keys before its first new token), rounded down to a
    multiple of `page_size` (page-table kernels read whole pages). `rows`: the requests' `req_to_token`
    rows on the host (`[bs, >= max prefix]`). 0 for fewer than two requests.

    Example: rows `[[5, 6, 7, 9], [5, 6, 7, 3], [5, 6, 8, 1]]` with prefix_lens `[4, 4, 3]` give 2
    (slots 5, 6 shared; the third request's token 2 is slot 8); with page_size 2 also 2, page_size 4: 0.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise InvalidArgumentError("page_size", "an int >= 1", page_size)
    lens = [int(n) for n in prefix_lens]
    if len(lens) < 2:
        return 0
    t = rows if isinstance(rows, torch.Tensor) else torch.tensor([list(r) for r in rows])
    if t.dim() != 2 or t.shape[0] != len(lens) or t.shape[1] < max(lens):
        raise InvalidArgumentError("rows", f"[{len(lens)}, >= {max(lens)}] slot rows", tuple(t.shape))
    limit = min(lens)
    same = (t[:, :limit] == t[:1, :limit]).all(dim=0)
    differ = (~same).nonzero()
    p = int(differ[0]) if differ.numel() else limit
    return p // page_size * page_size


def use_cascade_attention(
    cascade_prefix_len: int,
    batch: Union[ForwardBatch, Sequence[int]],
    *,
    min_prefix: int = MIN_PREFIX,
    min_requests: int = MIN_REQUESTS,
    min_saving_ratio: float = MIN_SAVING_RATIO,
    max_mean_query: float = MAX_MEAN_QUERY,
) -> bool:
    """Whether a step should run cascade attention over a shared prefix of `cascade_prefix_len` keys.

    The plain path reads the prefix's K/V once per request, bs * P key reads; cascade reads them once
    and pays an extra pass and an LSE merge whose traffic grows with the T new tokens. A bandwidth rule:
    cascade is chosen when P >= `min_prefix` (a shorter shared prefix stays in the GPU's L2 cache, so the
    plain path's repeated reads are cheap: 4096 tokens of bf16 K/V at 8 heads × 128 are 16 MiB per
    layer), the step is decode-like (T / bs <= `max_mean_query`: longer query rows are compute-bound and
    the prefix pass does the same arithmetic as the plain path), bs >= `min_requests`, and the key reads
    saved, (bs - 1) * P, are at least `min_saving_ratio` * T. `benchmarks/cascade_attention.py` measures
    it on a GPU. `batch`: a ForwardBatch or the requests' query lengths.

    Example: 64 requests decoding (T = 64) over a 32768-token prefix: 63 * 32768 >= 4 * 64 → True;
    over 4096 tokens → False (below 16384); 4 requests → False (fewer than 8); 64 requests of 256 new
    tokens over 32768 → False (256 per request > 16).
    """
    q = query_lens(batch)
    bs, tokens = len(q), sum(q)
    if cascade_prefix_len < min_prefix or bs < min_requests or tokens > max_mean_query * bs:
        return False
    return (bs - 1) * cascade_prefix_len >= min_saving_ratio * tokens


def check_cascade_prefix(batch: ForwardBatch, req_to_token: Optional[torch.Tensor] = None) -> int:
    """`batch.cascade_prefix_len` after the host checks every backend applies: an int >= 0, at most each
    request's cached prefix (its first new token comes after the shared keys), no encoder tokens and no
    verify custom mask with a nonzero value. With `req_to_token` (validation "full", and always on the
    CPU) also that every request's first P slots are the first request's (one comparison of the rows;
    on an accelerator at "basic" the step check does it on the device, `attn_core.ops.step_checks`,
    fault CASCADE). Raises `InvalidArgumentError` naming `forward_batch.cascade_prefix_len`."""
    p = batch.cascade_prefix_len
    if isinstance(p, bool) or not isinstance(p, int) or p < 0:
        raise InvalidArgumentError("forward_batch.cascade_prefix_len", "an int >= 0", p)
    if p == 0 or batch.forward_mode.is_no_tokens():
        return p
    q = query_lens(batch)
    seq = [int(n) for n in batch.seq_lens_cpu.tolist()]
    short = [i for i, (n, s) in enumerate(zip(q, seq)) if s - n < p]
    if short:
        i = short[0]
        raise InvalidArgumentError(
            "forward_batch.cascade_prefix_len", f"<= every request's cached prefix (request {i} has {seq[i] - q[i]})", p
        )
    if batch.encoder_lens is not None:
        raise InvalidArgumentError("forward_batch.cascade_prefix_len", "0 for a batch with encoder tokens", p)
    spec = batch.spec_info
    if batch.forward_mode.is_target_verify() and spec is not None and spec.custom_mask is not None:
        raise InvalidArgumentError("forward_batch.cascade_prefix_len", "0 for a verify step with a custom mask", p)
    if req_to_token is not None:
        rows = batch.req_pool_indices.to(torch.int64)
        ok = (rows >= 0) & (rows < req_to_token.shape[0])  # the batch validation refused bad rows already
        prefix = req_to_token[rows.clamp(0, req_to_token.shape[0] - 1), :p]
        differ = ((prefix != prefix[:1]).any(1) & ok).nonzero()
        if differ.numel():
            i = int(differ[0])
            raise InvalidArgumentError(
                "forward_batch.cascade_prefix_len", f"a prefix every request shares (request {i}'s first {p} differ)", p
            )
    return p


def splits_into_cascade(layer) -> bool:
    """Whether `layer` runs as prefix pass + suffix pass in a cascade step (plain causal self attention,
    logit cap allowed); other layers run unsplit.

    Example: `AttentionLayer(0, 8, 2, 64)` → True; the same with `sliding_window_size=128`, with
    `attention_chunk_size=256`, with `is_cross_attention=True` or with an `attn_type` other than
    "decoder" (encoder-only, bidirectional spans) → False."""
    if getattr(layer, "attn_type", "decoder") != "decoder":
        return False
    return not (
        layer.is_cross_attention or layer.sliding_window_size is not None or layer.attention_chunk_size is not None
    )
