"""Per-step metadata of the aiter backend (one plan per step, shared by every layer) and the pure helpers
that size and shape it: AITER's metadata layout, built from attn-core's request rows.

- MHA DECODE -> `PagedDecodePlan` for `paged_attention_ragged`: CSR page lists (`kv_indptr` in pages,
  page ids, tokens in each last page), the partition count and the byte workspace.
- MHA extend-like steps -> `VarlenPlan` for `flash_attn_varlen_func`: cumulative query / key lengths of
  the requests with new tokens and the slots of their keys (gathered per layer: the kernel reads dense K/V).
- MLA -> `MlaPlan` for `mla_decode_fwd` (every sequence the same 1..4 queries) or `mla_prefill_fwd`
  (the rest, each request's queries cut into pieces of at most `MLA_PREFILL_MAX_Q`), over the latent
  pool viewed as pages of one token: CSR slot lists, last-page lengths all 1.

Lengths come from the batch's host copies; each plan costs one host-to-device copy and attn-core's index
builder (`attn_core.ops.kv_indices.build_kv_indices`), no device sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Optional, Union

import torch

from attn_core.contract.errors import InvalidArgumentError
from attn_core.ops.kv_indices import pages_for

#: tokens per partition of the paged decode kernel
PARTITION_SIZE = 256
#: queries per sequence the MLA decode kernel serves ("decode_qlen = 1, 2, 3, 4")
MLA_DECODE_MAX_Q = 4
#: queries per piece sent to the absorbed MLA prefill kernel ("limited to q extend < 160")
MLA_PREFILL_MAX_Q = 128
#: the MLA kernels serve query-head counts in multiples of this, up to MLA_MAX_HEADS
MLA_HEAD_MULTIPLE, MLA_MAX_HEADS = 16, 128


@dataclass(frozen=True)
class PagedDecodePlan:
    """int32 on the device: `kv_indptr` `[bs + 1]` (page offsets), `page_ids` (at least kv_indptr[-1]),
    `last_page_lens` `[bs]` (1..page_size); `max_partitions` (host int); `workspace` (uint8 bytes)."""

    kv_indptr: torch.Tensor
    page_ids: torch.Tensor
    last_page_lens: torch.Tensor
    max_partitions: int
    workspace: torch.Tensor


@dataclass(frozen=True)
class VarlenPlan:
    """int32 on the device: `cu_seqlens_q` / `cu_seqlens_k` `[n + 1]` over the n requests with new tokens,
    `kv_slots` `[cu_seqlens_k[-1]]` (their keys' slots, in order); host maxima."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    kv_slots: torch.Tensor


@dataclass(frozen=True)
class MlaPlan:
    """`kernel` "decode" or "prefill"; int32 on the device over n sequences (requests, or pieces of them):
    `qo_indptr` / `kv_indptr` `[n + 1]`, `kv_indices` (slots: pages of one token), `last_page_lens` `[n]`
    (all 1); `max_seqlen_q` (host int)."""

    kernel: str
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_lens: torch.Tensor
    max_seqlen_q: int


Plan = Union[PagedDecodePlan, VarlenPlan, MlaPlan]


@dataclass
class AiterMetadata:
    """One step's plan and the AITER operator it feeds (`path`, shown by attn-core's debug switch);
    `plan` is None for an extend step without new tokens."""

    path: str
    plan: Optional[Plan]


def partitions_for(max_seq_len: int, partition_size: int = PARTITION_SIZE) -> int:
    """The paged decode kernel's `max_num_partitions` for sequences of at most `max_seq_len` keys (at
    least 1). Example: partitions_for(300) == 2, partitions_for(256) == 1, partitions_for(0) == 1."""
    return max(1, pages_for(max_seq_len, partition_size))


def decode_workspace_bytes(num_seqs: int, num_heads: int, max_partitions: int, head_dim: int, out_itemsize: int) -> int:
    """Bytes of the paged decode kernel's workspace: partial outputs `[seqs, heads, partitions, head_dim]`
    in the output dtype, then two float32 `[seqs, heads, partitions]` statistics (exp sums, max logits).
    Example: (2, 4, 3, 64, 2) -> 2*4*3*64*2 + 2*2*4*3*4 = 3072 + 192 = 3264."""
    cells = num_seqs * num_heads * max_partitions
    return cells * head_dim * out_itemsize + 2 * cells * 4


def mla_padded_heads(num_heads: int) -> int:
    """Query heads the MLA kernels run for `num_heads`: the next multiple of 16 (zero heads padded in,
    their output dropped). Example: 4 -> 16, 16 -> 16, 40 -> 48, 128 -> 128; above 128 a typed error."""
    if not 0 < num_heads <= MLA_MAX_HEADS:
        raise InvalidArgumentError("num_q_heads", f"1..{MLA_MAX_HEADS} for AITER's MLA kernels", num_heads)
    return -(-num_heads // MLA_HEAD_MULTIPLE) * MLA_HEAD_MULTIPLE


def fold_kv_scales(scaling: float, k_scale: float, v_scale: float) -> tuple[float, float]:
    """(softmax scale, output scale) for a cache that stores K / k_scale and V / v_scale: scores use
    scaling * k_scale, the output is multiplied by v_scale. Example: (0.125, 0.5, 2.0) -> (0.0625, 2.0)."""
    return float(scaling) * float(k_scale), float(v_scale)


def query_pieces(q_lens: list[int], kv_lens: list[int], max_q: int) -> list[tuple[int, int, int]]:
    """Cut each request's queries into pieces of at most `max_q` rows: (request, queries, keys) per piece,
    in order. A piece ending at query e of a request with n queries and L keys sees the first L - n + e
    keys, so causal-from-the-bottom-right attention of every piece is the request's own. Requests without
    queries give no piece.

    Example: q_lens [5, 0, 2], kv_lens [9, 3, 2], max_q 2 -> [(0, 2, 6), (0, 2, 8), (0, 1, 9), (2, 2, 2)]."""
    if max_q < 1:
        raise InvalidArgumentError("max_q", ">= 1", max_q)
    pieces = []
    for r, (n, total) in enumerate(zip(q_lens, kv_lens)):
        for start in range(0, n, max_q):
            end = min(n, start + max_q)
            pieces.append((r, end - start, total - n + end))
    return pieces


def mla_kernel_for(q_lens: list[int]) -> str:
    """ "decode" when every request has the same 1..MLA_DECODE_MAX_Q queries, else "prefill".
    Examples: [1, 1] -> "decode"; [3, 3] -> "decode"; [5, 5] -> "prefill"; [1, 2] -> "prefill"."""
    first = q_lens[0] if q_lens else 0
    return "decode" if 0 < first <= MLA_DECODE_MAX_Q and all(n == first for n in q_lens) else "prefill"


def offsets(lengths: list[int]) -> list[int]:
    """[0] + running sums. Example: [3, 0, 2] -> [0, 3, 3, 5]."""
    return [0, *accumulate(lengths)]


def to_device(lists: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Several host int lists as int32 tensors on `device`, with one host-to-device copy."""
    flat = torch.tensor([v for x in lists for v in x], dtype=torch.int32).to(device)
    return list(torch.split(flat, [len(x) for x in lists]))
