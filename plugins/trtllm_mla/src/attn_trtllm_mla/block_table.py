"""Block tables in TensorRT-LLM's layout (plain torch: runs on CPU and CUDA, no host sync, capturable in
a CUDA graph).

The TRT-LLM MLA decode kernels read each request's pages from a dense table `[bs, width]` of int32 page
ids: row b lists request b's pages in order (page j holds its tokens j*P .. j*P + P - 1); entries past
its last page are padding (`PAD`, never read: `seq_lens` bounds the kernel). `width` is padded so
that `width * P` is a multiple of 128 tokens (FlashInfer 0.6.6 refuses other widths for the trtllm-gen
kernels: `block_num % (128 / block_size) == 0`). attn-core's pool slot = page * P + offset and its
allocator keeps every request's tokens page-aligned, so a request's page j is the page of its key j*P.

Worked example (P = 32, so the width is a multiple of 4): requests in rows 2 and 0 with 70 and 5 keys,
req_to_token[2, 0] = 320, [2, 32] = 96, [2, 64] = 640; req_to_token[0, 0] = 32:
    padded_width(70, 32) = 4
    table = [[10, 3, 20, -1],
             [ 1, -1, -1, -1]]
"""

from __future__ import annotations

from typing import Optional

import torch

from attn_core.errors import InvalidArgumentError

#: Padding entries of a block table.
PAD = -1
#: The trtllm-gen kernels want the table's width in tokens to be a multiple of this.
TOKEN_ALIGNMENT = 128


def padded_width(max_seq_len: int, page_size: int) -> int:
    """Columns of a block table for sequences of at most `max_seq_len` keys: the page count, rounded up
    to a multiple of 128 / page_size (at least one such group). Example: (70, 32) -> 4; (300, 64) -> 6;
    (0, 64) -> 2."""
    if page_size < 1 or TOKEN_ALIGNMENT % page_size:
        raise InvalidArgumentError("page_size", f"a divisor of {TOKEN_ALIGNMENT}", page_size)
    group = TOKEN_ALIGNMENT // page_size
    pages = -(-max_seq_len // page_size)
    return max(1, -(-pages // group)) * group


def build_block_table(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    width: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The block table int32 `[bs, width]` of requests in rows `req_pool_indices` with `seq_lens` keys
    (device tensors, `bs` entries; req_to_token int32 `[rows, max_context_len]`), written into `out`
    (a `[>= bs, width]` int32 buffer, e.g. a CUDA graph's) when given. A request with more than
    width * page_size keys is the caller's error (`check_width` says so on the host)."""
    bs = req_pool_indices.shape[0]
    cols = torch.arange(width, device=req_to_token.device, dtype=torch.int64) * page_size
    valid = cols[None, :] < seq_lens.to(torch.int64)[:, None]
    cols = cols.clamp(max=req_to_token.shape[1] - 1)
    pages = torch.div(req_to_token[req_pool_indices.to(torch.int64)[:, None], cols[None, :]], page_size, rounding_mode="floor")
    table = torch.where(valid, pages, torch.full_like(pages, PAD)).to(torch.int32)
    if out is None:
        return table
    out[:bs].copy_(table)
    return out[:bs]


def check_width(max_seq_len: int, page_size: int, width: int) -> None:
    """A typed error when `max_seq_len` keys do not fit `width` pages of `page_size`."""
    if -(-max_seq_len // page_size) > width:
        raise InvalidArgumentError("seq_lens", f"at most {width * page_size} keys (the block table's width)", max_seq_len)
