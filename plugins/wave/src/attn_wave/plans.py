"""Per-step metadata of the wave backend: slot lists in the layout Wave's templates read, built once per
step from the batch's host copies with one host-to-device copy and attn-core's index builder.

- DECODE -> `DecodePlan`: `kv_indptr` `[bs + 1]` over each request's keys, `kv_indices` their slots, and
  the float32 split buffers the two decode phases share (unwritten splits kept at logits 0 / max -inf:
  the merge phase reads splits 0..min(L, U) - 1, and a sequence of L keys in U splits of ceil(L / U)
  leaves some empty, e.g. L = 9, U = 8: splits 5..7).
- extend-like steps -> `ExtendPlan`: `qo_indptr` over the requests with new tokens, `kv_indptr` /
  `kv_indices` over their cached prefixes (the new tokens come from the step's k / v), the largest new-
  token count, and for TARGET_VERIFY with tree masks the masks as int8 with their offsets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch


@dataclass(frozen=True)
class DecodePlan:
    """int32 `kv_indptr` `[bs + 1]` and `kv_indices`; float32 `logits` `[U, bs, Dv, H]` (zeros) and
    `logits_max` `[U, bs, H]` (-inf)."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    logits: torch.Tensor
    logits_max: torch.Tensor


@dataclass(frozen=True)
class ExtendPlan:
    """int32 `qo_indptr` / `kv_indptr` `[n + 1]` over the n requests with new tokens, `kv_indices` (their
    prefixes' slots); `max_extend_len`; `custom_mask` int8 and `mask_offsets` int32 `[n]` or None."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    max_extend_len: int
    custom_mask: Optional[torch.Tensor] = None
    mask_offsets: Optional[torch.Tensor] = None


@dataclass
class WaveMetadata:
    """One step's plan and the Wave kernel it feeds (`path`, shown by attn-core's debug switch); `plan`
    is None for an extend step without new tokens."""

    path: str
    plan: Optional[Union[DecodePlan, ExtendPlan]]


def empty_splits(seq_len: int, num_splits: int) -> list[int]:
    """Splits the decode kernel leaves unwritten for a sequence of `seq_len` keys cut into `num_splits`
    splits of ceil(seq_len / num_splits) keys, among those its merge reads (0..min(seq_len, U) - 1).
    Example: (9, 8) -> [5, 6, 7]; (16, 8) -> []; (3, 8) -> []."""
    per = -(-seq_len // num_splits)
    return [u for u in range(min(seq_len, num_splits)) if u * per >= seq_len]
