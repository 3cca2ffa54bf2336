"""Argument packing for TensorRT-LLM's MLA decode (free of FlashInfer: tested on CPU).

The kernel takes the queries as `[bs, q_len, H, kv_lora_rank + rope]` (every request the same q_len:
DECODE 1, TARGET_VERIFY the draft count), the paged latent `[pages, P, kv_lora_rank + rope]`, a block
table, the key counts and two fused scales: `bmm1_scale` multiplies Q·Kᵀ (the softmax scale times the
q and k dequantization scales), `bmm2_scale` the P·V product (the v scale; for MLA the latent is both
K and V, so v_scale = k_scale).

The block table is attn-core's (`attn_core.ops.kv_indices.page_table_from_req_to_token`, padded with
`PAD`): int32 `[bs, width]` page ids, row b listing request b's pages in order (entries past its last
page are never read: `seq_lens` bounds the kernel). Its width is TRT-LLM's: padded so that `width * P`
is a multiple of 128 tokens (FlashInfer 0.6.6 refuses other widths for the trtllm-gen kernels:
`block_num % (128 / block_size) == 0`; `padded_width`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.ops.kv_indices import pages_for

#: Padding entries of a block table.
PAD = -1
#: The trtllm-gen kernels want the table's width in tokens to be a multiple of this.
TOKEN_ALIGNMENT = 128
#: DeepSeek's no-rope part of a query head before absorption; FlashInfer 0.6.6 takes it (128 or 64) but
#: its trtllm-gen path does not use it.
QK_NOPE_HEAD_DIM = 128


@dataclass(frozen=True)
class Scales:
    """The two fused scales. Example: fold_scales(0.0721, q_scale=None, k_scale=0.5) -> Scales(0.03605, 0.5)."""

    bmm1: float
    bmm2: float


def fold_scales(scaling: float, q_scale: Optional[float], k_scale: Optional[float]) -> Scales:
    """bmm1 = scaling * q_scale * k_scale, bmm2 = k_scale (None counts as 1)."""
    qs = 1.0 if q_scale is None else float(q_scale)
    ks = 1.0 if k_scale is None else float(k_scale)
    return Scales(float(scaling) * qs * ks, ks)


def decode_kwargs(
    q: torch.Tensor,
    latent: torch.Tensor,
    page_size: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    q_len: int,
    scales: Scales,
    workspace: torch.Tensor,
    out: Optional[torch.Tensor],
) -> dict:
    """Keyword arguments of `trtllm_batch_decode_with_kv_cache_mla` for q `[bs * q_len, H, D]` over one
    layer's latent pool `[slots, 1, D]` (D = kv_lora_rank + rope), both viewed, not copied. `out`
    (bf16 `[bs, H, kv_lora_rank]`) is passed for q_len 1 only: FlashInfer 0.6.6 checks a given output
    against `[bs, H, kv_lora_rank]` whatever q_len is, so with q_len > 1 it allocates its own
    `[bs, q_len, H, kv_lora_rank]`."""
    T, H, D = q.shape
    if D != kv_lora_rank + qk_rope_head_dim:
        raise InvalidArgumentError("q", f"head dim {kv_lora_rank + qk_rope_head_dim}", D)
    bs = block_table.shape[0]
    if T != bs * q_len:
        raise InvalidArgumentError("q", f"{bs} requests x {q_len} queries", T)
    if q.dtype != torch.bfloat16 or (out is not None and out.dtype != torch.bfloat16):
        raise UnsupportedFeatureError("trtllm_mla", f"dtype {q.dtype} (the kernels here take and write bfloat16)")
    return dict(
        query=q.view(bs, q_len, H, D),
        kv_cache=latent.view(-1, page_size, D),
        workspace_buffer=workspace,
        qk_nope_head_dim=QK_NOPE_HEAD_DIM,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        block_tables=block_table,
        seq_lens=seq_lens,
        max_seq_len=max_seq_len,
        out=out if q_len == 1 else None,
        bmm1_scale=scales.bmm1,
        bmm2_scale=scales.bmm2,
    )


def padded_width(max_seq_len: int, page_size: int) -> int:
    """Columns of a block table for sequences of at most `max_seq_len` keys: the page count, rounded up
    to a multiple of 128 / page_size (at least one such group). Example: (70, 32) -> 4; (300, 64) -> 6;
    (0, 64) -> 2."""
    if page_size < 1 or TOKEN_ALIGNMENT % page_size:
        raise InvalidArgumentError("page_size", f"a divisor of {TOKEN_ALIGNMENT}", page_size)
    group = TOKEN_ALIGNMENT // page_size
    return max(1, pages_for(pages_for(max_seq_len, page_size), group)) * group


def check_width(max_seq_len: int, page_size: int, width: int) -> None:
    """A typed error when `max_seq_len` keys do not fit `width` pages of `page_size`."""
    if pages_for(max_seq_len, page_size) > width:
        expected = f"at most {width * page_size} keys (the block table's width)"
        raise InvalidArgumentError("seq_lens", expected, max_seq_len)
