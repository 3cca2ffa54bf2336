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
from typing import Optional

import torch

from attn_core.contract.forward_mode import ForwardMode


@dataclass
class SpecInfo:
    """Speculative-decoding inputs of a step.

    TARGET_VERIFY: every request scores `num_draft_tokens` draft tokens; `custom_mask` is the
    concatenation over requests of a row-major bool `[num_draft_tokens, seq_len]` mask (True = may
    attend), `mask_indptr[r]` the offset of request r's mask. When a custom mask is given it alone
    decides which keys a draft token sees.
    """

    num_draft_tokens: int = 0
    custom_mask: Optional[torch.Tensor] = None
    mask_indptr: Optional[torch.Tensor] = None
    topk: int = 1


@dataclass
class ForwardBatch:
    """The batch of one forward step (see the module docstring for conventions)."""

    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    seq_lens_sum: int
    out_cache_loc: torch.Tensor
    positions: Optional[torch.Tensor] = None
    req_to_token_pool: object = None
    token_to_kv_pool: object = None
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
    attn_backend: object = None
    #: cascade attention (`attn_core.batching.cascade`): the first cascade_prefix_len keys of every request are the
    #: same slots (a shared cached prefix) and backends declaring Feature.CASCADE attend to them once for
    #: all queries; 0: off. Host int; at most every request's cached prefix.
    cascade_prefix_len: int = 0
    #: the requests a `build_step` batch was built from (`attn_core.engine.requests.RequestGuard`): the backend
    #: refuses the batch once one of them changed (`StaleRequestError`); None for batches built otherwise
    request_guard: object = None
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
        return self.seq_lens.device

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens_cpu.max()) if self.batch_size else 0
