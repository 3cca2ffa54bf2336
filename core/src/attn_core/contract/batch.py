"""`ForwardBatch`: one step's batch as the engine hands it to attention, and `SpecInfo` for
speculative steps.

Conventions (every backend relies on them):
- `seq_lens[r]` counts every self-attention key request r attends to in this step, the new tokens
  included (prefix_len + extend_len; for TARGET_VERIFY the draft tokens too).
- In `req_to_token`, a request's row holds its encoder tokens first (`encoder_lens[r]` of them, only
  for encoder-decoder models) and then its decoder tokens: decoder token i sits at column
  encoder_lens[r] + i.
- New tokens are flattened request after request: request r owns rows
  extend_start_loc[r] … extend_start_loc[r] + extend_seq_lens[r] - 1 of q/k/v (one row each in DECODE).
- dtypes: req_pool_indices, out_cache_loc, positions int64; lengths and offsets int32.
- `positions` is the engine's: the position of every new token, its input to RoPE (which the engine
  applies to q and k before calling attention). No backend reads it; it may be None. `build_step`
  fills it (`attn_core.positions_from_lens`).
- `bidirectional_spans[r] = (a, b)`: request r's decoder positions a … b-1 see each other in layers of
  `attn_type="decoder_bidirectional"` (every other position stays causal); (0, 0) for none. The span's
  keys must all be in the step (b <= seq_len) whenever one of its positions is a query of the step,
  so chunked prefill must not cut a span (`attn_core.contract.bidirectional`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol, TypeVar, Union

import torch

from attn_core.contract.capabilities import Capabilities
from attn_core.contract.errors import InvalidBatchError
from attn_core.contract.forward_mode import ForwardMode

if TYPE_CHECKING:  # annotations only
    from attn_core.engine.requests import RequestGuard
    from attn_core.memory.kv_pool import KVPool
    from attn_core.memory.pools import ReqToTokenPool


@dataclass
class SpecInfo:
    """Speculative-decoding inputs of a step.

    TARGET_VERIFY: every request scores `num_draft_tokens` draft tokens; `custom_mask` is the
    concatenation over requests of a row-major bool `[num_draft_tokens, seq_len]` mask (True = may
    attend), `mask_indptr[r]` the offset of request r's mask. When a custom mask is given it alone
    decides which keys a draft token sees.

    - `num_draft_tokens`: host int, draft tokens per request (TARGET_VERIFY; 0 in other modes). Set by
      the engine (`build_step` from its work list).
    - `custom_mask`: bool `[sum over r of num_draft_tokens * seq_lens[r]]` on the backend's device, flat,
      or None (no mask: causal over prefix and drafts, i.e. a chain of drafts). Checked at "basic".
    - `mask_indptr`: int32/int64 `[bs + 1]` on the device, offsets into `custom_mask` (0, then the
      running total of num_draft_tokens * seq_lens[r]); None exactly when `custom_mask` is.
    - `topk`: host int >= 1, drafts proposed per position (> 1: a tree of drafts, needs
      `Feature.SPEC_TOPK_GT1`).

    Example (2 requests, seq_lens [5, 3], 2 draft tokens): `custom_mask` has 2*5 + 2*3 = 16 entries and
    `mask_indptr` is [0, 10, 16].
    """

    num_draft_tokens: int = 0
    custom_mask: Optional[torch.Tensor] = None
    mask_indptr: Optional[torch.Tensor] = None
    topk: int = 1


T = TypeVar("T")


def batch_field(value: Optional[T], name: str) -> T:
    """`value` (a `ForwardBatch` field the step's mode needs, e.g. `extend_seq_lens` in an extend-like mode)
    when it is given, else `InvalidBatchError` naming `forward_batch.<name>`; one `is None` test. Validation
    checks these fields up front; code that reads them after uses this instead of assuming them.

    Example: `batch_field(b.extend_seq_lens_cpu, "extend_seq_lens_cpu")` is the tensor; on a DECODE batch
    (None) it raises `InvalidBatchError` with argument "forward_batch.extend_seq_lens_cpu"."""
    if value is None:
        raise InvalidBatchError(f"forward_batch.{name}", "a value for this step's mode", None)
    return value


class StepBackend(Protocol):
    """What a batch's `attn_backend` offers the helpers that read it (every `AttentionBackend` is one; a
    Protocol so that this module need not import the backend's, which imports it): its capabilities, its
    CUDA-graph padding fill value (`graph_padding`), its per-step metadata entry point and the per-layer
    `forward` (`AttentionLayer.forward` calls it)."""

    @property
    def capabilities(self) -> Capabilities: ...

    def get_cuda_graph_seq_len_fill_value(self) -> int: ...

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: Any,  # an AttentionLayer (which imports this module)
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **extras: Any,
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]: ...


@dataclass
class ForwardBatch:
    """The batch of one forward step (see the module docstring for the conventions). The engine builds
    it (`attn_core.build_step`, `attn_core.EngineBatches.build`, or field by field) and hands the same
    object to `init_forward_metadata` and then to every layer's `forward`; `bs` below is `batch_size`,
    `T` the step's new tokens (`num_tokens`). "Device" means the backend's device
    (`BackendContext.device`); every rule here is checked by `attn_core.contract.validation` before any
    KV write (host copies at "basic", device tensors at "full").

    - `forward_mode`: the step's `ForwardMode` (EXTEND, DECODE, MIXED, TARGET_VERIFY, DRAFT_EXTEND, or a
      mode with no tokens: IDLE, DUMMY_FIRST).
    - `batch_size`: host int >= 0, requests in the step (bs).
    - `req_pool_indices`: int32/int64 `[bs]` on the device, each request's row of
      `req_to_token_pool.req_to_token`.
    - `seq_lens`: int32 `[bs]` on the device, keys each request attends to in this step, its new tokens
      included (in tokens; >= 1 in DECODE).
    - `seq_lens_cpu`: the host copy of `seq_lens`, int32/int64 `[bs]` on the CPU (plans read it: no sync).
    - `seq_lens_sum`: host int, `sum(seq_lens_cpu)` (in keys).
    - `out_cache_loc`: int32/int64 `[T]` on the device, the KV slot each new token's K/V is written to,
      in [1, num_slots) (slot 0 is the reserved dummy); token t of request r is column
      encoder_lens[r] + seq_lens[r] - q_len[r] + t of its `req_to_token` row.
    - `positions`: int64 `[T]` on the device, each new token's position (RoPE's input, applied by the
      engine), or None. No backend reads it; `build_step` fills it (`positions_from_lens`).
    - `req_to_token_pool`: the request→slot table (`ReqToTokenPool`; its `req_to_token` is int32
      `[rows, max_context_len]` on the device), or None to use the context's.
    - `token_to_kv_pool`: the KV pool the step reads and writes (`attn_core.memory.KVPool`: an
      `MHATokenToKVPool` (or `EngineKVPool`), `MLATokenToKVPool` or `SlidingWindowKVPool`, with the
      context's dtype, page size and heads), or None to use the context's.
    - `extend_prefix_lens` / `extend_seq_lens` / `extend_start_loc`: int32 `[bs]` on the device, per
      request its cached keys before the step, its new tokens (q_len) and the row of its first new
      token in q/k/v (the exclusive running sum of `extend_seq_lens`). Required in extend-like modes
      (EXTEND, MIXED, TARGET_VERIFY, DRAFT_EXTEND), None in DECODE.
    - `extend_prefix_lens_cpu` / `extend_seq_lens_cpu`: their host copies, int32/int64 `[bs]` on the
      CPU; with the device tensors.
    - `extend_num_tokens`: host int, T in extend-like modes (`sum(extend_seq_lens_cpu)`); None in DECODE.
    - `encoder_lens`: int32 `[bs]` on the device, encoder keys per request (encoder-decoder models:
      they sit first in each `req_to_token` row), or None; `encoder_lens_cpu` its host copy (int32/int64
      `[bs]`, CPU), given with it.
    - `encoder_out_cache_loc`: int32/int64 `[E]` on the device, the KV slots a cross-attention layer
      writes the k/v rows it is given (E of them: the encoder tokens stored this step) to, or None
      (cross-attention layers then write nothing).
    - `spec_info`: `SpecInfo` for TARGET_VERIFY / DRAFT_EXTEND steps, else None.
    - `attn_backend`: the `AttentionBackend` the engine runs this step on (typed `StepBackend`), or None;
      set by the engine (`build_step(attn_backend=...)`, the graph runner). Read by helpers that need the backend's
      capabilities or CUDA-graph fill value (decode context parallelism), never by the backend itself.
    - `cascade_prefix_len`, `request_guard`, `bidirectional_spans`, `bidirectional_spans_cpu`: below.

    Example (`build_step`, requests A with 5 cached keys and a new B, work [(A, 1), (B, 3)]): MIXED,
    batch_size 2, seq_lens [6, 3], seq_lens_sum 9, extend_prefix_lens [5, 0], extend_seq_lens [1, 3],
    extend_start_loc [0, 1], extend_num_tokens 4, out_cache_loc 4 slots, positions [5, 0, 1, 2].
    """

    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    seq_lens_sum: int
    out_cache_loc: torch.Tensor
    positions: Optional[torch.Tensor] = None
    req_to_token_pool: Optional[ReqToTokenPool] = None
    token_to_kv_pool: Optional[KVPool] = None
    extend_prefix_lens: Optional[torch.Tensor] = None
    extend_prefix_lens_cpu: Optional[torch.Tensor] = None
    extend_seq_lens: Optional[torch.Tensor] = None
    extend_seq_lens_cpu: Optional[torch.Tensor] = None
    extend_start_loc: Optional[torch.Tensor] = None
    extend_num_tokens: Optional[int] = None
    encoder_lens: Optional[torch.Tensor] = None
    encoder_lens_cpu: Optional[torch.Tensor] = None
    encoder_out_cache_loc: Optional[torch.Tensor] = None
    spec_info: Optional[SpecInfo] = None
    attn_backend: Optional[StepBackend] = None
    #: cascade attention (`attn_core.batching.cascade`): the first cascade_prefix_len keys of every request are the
    #: same slots (a shared cached prefix) and backends declaring Feature.CASCADE attend to them once for
    #: all queries; 0: off. Host int; at most every request's cached prefix.
    cascade_prefix_len: int = 0
    #: the requests a `build_step` batch was built from (`attn_core.engine.requests.RequestGuard`): the backend
    #: refuses the batch once one of them changed (`StaleRequestError`); None for batches built otherwise
    request_guard: Optional[RequestGuard] = None
    #: per-request bidirectional spans, int32 `[bs, 2]` on the device, and their host copy (CPU, int32 or
    #: int64); both None: none (see the module docstring and `attn_core.contract.bidirectional`)
    bidirectional_spans: Optional[torch.Tensor] = None
    bidirectional_spans_cpu: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        """Rows of q/k/v this step carries."""
        if self.forward_mode.is_no_tokens():
            return 0
        if self.forward_mode.is_decode():
            return self.batch_size
        return int(self.extend_num_tokens or 0)

    @property
    def device(self) -> torch.device:
        """The device of the batch's tensors (`seq_lens`'s)."""
        return self.seq_lens.device

    @property
    def max_seq_len(self) -> int:
        """The longest `seq_lens_cpu` entry (0 for an empty batch); host only, no sync."""
        return int(self.seq_lens_cpu.max()) if self.batch_size else 0
