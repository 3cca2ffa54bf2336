"""The inputs of one CUDA-graph capture or replay (`CudaGraphStep`) and the one rule for padding a batch
to a captured size (`graph_padding`).

An engine captures one graph per (mode, batch size) and runs a batch of bs real requests in the graph
of the smallest captured size B >= bs. The B - bs padding rows are harmless requests that read and
write only reserved memory: request row 0 of `req_to_token`, KV slot 0 (the reserved dummy) for each of
their new tokens, and `fill - 1` cached keys before their new tokens, where `fill` is the backend's
`get_cuda_graph_seq_len_fill_value()` (>= 1). Every request of a graph batch has the same number of new
tokens: 1 in DECODE, the draft count in TARGET_VERIFY. A padding row's `seq_len` is therefore
`fill + t - 1` for t new tokens: its prefix is never negative and it always attends at least `fill`
keys. The graph runner, the conformance kit, the draft wrapper and the tests all pad with
`graph_padding`.

Backends receive a `CudaGraphStep` in `capture_cuda_graph_metadata` / `replay_cuda_graph_metadata`;
the SGLang-named `init_forward_metadata_capture_cuda_graph(...)` and
`init_forward_metadata_replay_cuda_graph(...)` of `AttentionBackend` build one from their positional
arguments.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from attn_core.contract.batch import ForwardBatch, SpecInfo
from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.validation import host_length_stats


def graph_tokens_per_request(mode: ForwardMode, num_draft_tokens: int = 0) -> Optional[int]:
    """New tokens of every request in a graph batch of `mode`: 1 in DECODE, `num_draft_tokens` in
    TARGET_VERIFY (None when that is not > 0), None for modes without a fixed count (extend-like).

    Example: `graph_tokens_per_request(ForwardMode.TARGET_VERIFY, 4) == 4`,
    `graph_tokens_per_request(ForwardMode.DECODE) == 1`.
    """
    if mode.is_decode():
        return 1
    if mode.is_target_verify():
        return num_draft_tokens if num_draft_tokens > 0 else None
    return None


@dataclass(frozen=True)
class GraphPadding:
    """How `bs` real requests run in the graph captured for `padded_bs` requests.

    Rows bs..padded_bs-1 are padding: request row 0, `seq_len` keys (the last `tokens_per_request` of
    them their own new tokens, written to KV slot 0), an all-True verify mask when masks are used.
    """

    bs: int
    padded_bs: int
    tokens_per_request: int
    #: keys a padding row has cached before its new tokens (fill - 1)
    prefix_len: int

    @property
    def seq_len(self) -> int:
        """seq_len of a padding row: its cached keys plus its own new tokens."""
        return self.prefix_len + self.tokens_per_request

    @property
    def num_padding(self) -> int:
        return self.padded_bs - self.bs

    @property
    def num_tokens(self) -> int:
        """New tokens of the padded graph batch."""
        return self.padded_bs * self.tokens_per_request


def graph_padding(
    mode: ForwardMode, bs: int, captured_sizes: Sequence[int], fill: int, num_draft_tokens: int = 0
) -> GraphPadding:
    """The padding of a batch of `bs` real requests (0 at capture time: all padding) of `mode` to the
    smallest size in `captured_sizes` that holds it; `fill` is the backend's
    `get_cuda_graph_seq_len_fill_value()`; `num_draft_tokens` the draft tokens per request in
    TARGET_VERIFY. Raises `InvalidArgumentError` naming the argument when no captured size fits, the
    mode has no fixed token count, or `fill` < 1.

    Example (TARGET_VERIFY, 3 draft tokens, fill 1, captures [2, 4], 3 requests):
    `graph_padding(ForwardMode.TARGET_VERIFY, 3, [2, 4], 1, 3)` is
    `GraphPadding(bs=3, padded_bs=4, tokens_per_request=3, prefix_len=0)`: one padding row with
    seq_len 3 (its 3 draft tokens, no cached keys), 12 tokens in the graph batch.
    """
    if fill < 1:
        raise InvalidArgumentError("fill", "a CUDA-graph seq_len fill value >= 1", fill)
    t = graph_tokens_per_request(mode, num_draft_tokens)
    if t is None:
        raise InvalidArgumentError(
            "forward_mode",
            "DECODE, or TARGET_VERIFY with num_draft_tokens > 0 (a fixed token count)",
            (mode.name, num_draft_tokens),
        )
    padded = min((int(s) for s in captured_sizes if int(s) >= max(bs, 1)), default=None)
    if bs < 0 or padded is None:
        raise InvalidArgumentError(
            "bs", f"0..{max(captured_sizes, default=0)} requests (the largest captured size)", bs
        )
    return GraphPadding(bs=bs, padded_bs=padded, tokens_per_request=t, prefix_len=fill - 1)


@dataclass(frozen=True)
class CudaGraphStep:
    """The graph batch a backend captures metadata for, or refreshes its graph buffers with at replay.

    All tensors are on the backend's device unless said; the batch is already padded to `bs` rows
    (see `graph_padding`). Construction checks the fields and trims the tensors to their first `bs`
    rows (views: no copy, graph-safe), so a caller may pass whole persistent buffers.

    - `forward_mode`: DECODE or TARGET_VERIFY (backends at `CudaGraphLevel.ALWAYS` may take others).
    - `bs`: requests in the graph batch, padding included (the captured size), >= 1.
    - `req_pool_indices`: int32/int64 `[bs]`, rows of `req_to_token` (padding rows: 0).
    - `seq_lens`: int32 `[bs]`, keys of each request including its new tokens.
    - `num_tokens`: new tokens of the batch, `bs * t` (t per request: 1 in DECODE, the draft count in
      TARGET_VERIFY). Derived when not given; None only when it cannot be (a replay of an extend-like
      mode, or TARGET_VERIFY without `spec_info.num_draft_tokens`): backends then use the count
      captured for (bs, forward_mode).
    - `seq_lens_cpu`: host copy of `seq_lens` `[bs]`, or None (capture; a replay without it costs a
      device sync in backends that plan on the host).
    - `seq_lens_sum`: int, the sum of `seq_lens` (in keys); derived from `seq_lens_cpu` when not given,
      None when neither is known (capture).
    - `encoder_lens`: int32 `[bs]` encoder keys per request (encoder-decoder contexts), or None.
    - `spec_info`: TARGET_VERIFY's `SpecInfo` (draft count; `custom_mask` over the `bs` rows, bool,
      `mask_indptr` int64 `[bs + 1]`), else None.

    Example: `CudaGraphStep(forward_mode=ForwardMode.DECODE, bs=2, req_pool_indices=rows,
    seq_lens=lens)` has `num_tokens == 2` and `seq_lens_sum is None`.
    """

    forward_mode: ForwardMode
    bs: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    num_tokens: Optional[int] = None
    seq_lens_cpu: Optional[torch.Tensor] = None
    seq_lens_sum: Optional[int] = None
    encoder_lens: Optional[torch.Tensor] = None
    spec_info: Optional[SpecInfo] = None

    def __post_init__(self) -> None:
        try:
            mode = ForwardMode.parse(self.forward_mode)
        except ValueError:
            raise InvalidArgumentError(
                "forward_mode", f"a ForwardMode among {[m.name for m in ForwardMode]}", self.forward_mode
            ) from None
        try:
            bs = operator.index(self.bs)
        except TypeError:
            bs = None
        if bs is None or isinstance(self.bs, bool) or bs < 1:
            raise InvalidArgumentError("bs", "a graph batch size >= 1 (an integer)", self.bs)
        rows = {}
        for name in ("req_pool_indices", "seq_lens", "seq_lens_cpu", "encoder_lens"):
            x = getattr(self, name)
            if x is None:
                if name in ("req_pool_indices", "seq_lens"):
                    raise InvalidArgumentError(name, f"a tensor of at least {bs} entries", None)
                continue
            if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.shape[0] < bs:
                raise InvalidArgumentError(
                    name, f"a 1-D tensor of at least {bs} entries", getattr(x, "shape", type(x).__name__)
                )
            if x.shape[0] != bs:
                rows[name] = x[:bs]
        host = rows.get("seq_lens_cpu", self.seq_lens_cpu)
        if host is not None and host.device.type != "cpu":
            raise InvalidArgumentError("seq_lens_cpu", "a host (CPU) tensor", host.device)
        nd = self.spec_info.num_draft_tokens if self.spec_info is not None else 0
        t = graph_tokens_per_request(mode, nd)
        num_tokens = self.num_tokens
        if num_tokens is None:
            num_tokens = None if t is None else bs * t
        elif not (mode.is_decode() or mode.is_target_verify()):
            if num_tokens < bs:
                raise InvalidArgumentError("num_tokens", f">= bs={bs} for {mode.name}", num_tokens)
        elif num_tokens % bs or (t is not None and num_tokens != bs * t):
            want = f"bs * {t} = {bs * t}" if t is not None else f"a multiple of bs={bs}"
            raise InvalidArgumentError("num_tokens", f"{want} for {mode.name}", num_tokens)
        seq_sum = self.seq_lens_sum
        if host is not None:
            host_sum = host_length_stats(host)[2]  # builtins for a list-sized batch (per-replay host time)
            if seq_sum is not None and int(seq_sum) != host_sum:
                raise InvalidArgumentError("seq_lens_sum", f"the sum of seq_lens_cpu[:{bs}] = {host_sum}", seq_sum)
            seq_sum = host_sum
        object.__setattr__(self, "forward_mode", mode)
        object.__setattr__(self, "bs", bs)
        object.__setattr__(self, "num_tokens", num_tokens)
        object.__setattr__(self, "seq_lens_sum", None if seq_sum is None else int(seq_sum))
        for name, x in rows.items():
            object.__setattr__(self, name, x)

    @classmethod
    def from_batch(cls, batch: ForwardBatch, *, with_host_lens: bool = True) -> CudaGraphStep:
        """The graph step of an already padded `batch` (its mode, rows, lengths, encoder lengths and
        spec info); `with_host_lens=False` leaves out `seq_lens_cpu` / `seq_lens_sum`, as a capture has
        none."""
        return cls(
            forward_mode=batch.forward_mode,
            bs=batch.batch_size,
            num_tokens=batch.num_tokens,
            req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens,
            seq_lens_cpu=batch.seq_lens_cpu if with_host_lens else None,
            seq_lens_sum=batch.seq_lens_sum if with_host_lens else None,
            encoder_lens=batch.encoder_lens,
            spec_info=batch.spec_info,
        )

    @property
    def tokens_per_request(self) -> Optional[int]:
        """New tokens per request (`num_tokens // bs`), None when `num_tokens` is unknown."""
        return None if self.num_tokens is None else self.num_tokens // self.bs

    def host_seq_lens(self) -> torch.Tensor:
        """`seq_lens_cpu`, or a host copy of `seq_lens` (one device sync) when the caller gave none."""
        return self.seq_lens_cpu if self.seq_lens_cpu is not None else self.seq_lens.cpu()
