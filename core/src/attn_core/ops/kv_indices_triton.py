"""One Triton kernel that turns `req_to_token` rows into a step's index metadata; the Triton path of
`attn_core.ops.kv_indices.build_kv_indices` and the metadata kernel of the Triton backend.

For request r (row `req_pool_indices[r]`, keys at columns kv_start[r] .. kv_start[r] + kv_lens[r] - 1)
it writes, in a single launch and without any host sync:
- kv_indices: with page_size 1 the slots `req_to_token[row, start + j]`; with page_size > 1 one page id
  per page, `req_to_token[row, start + j * page_size] // page_size` (start must be a multiple of
  page_size, as the paged allocator lays rows out); concatenated over the requests;
- optionally kv_indptr `[bs+1]` int32: exclusive prefix sum of the per-request counts (tokens, or pages);
- optionally last_page_len `[bs]` int32: keys in each request's last page (0 for a request without keys);
- optionally qo_indptr `[bs+1]` int32 (prefix sum of q_lens) and mask_indptr `[bs+1]` int64 (prefix sum
  of q_lens * kv_lens, in tokens: offsets of per-request row-major `[q_len, kv_len]` custom masks);
- optionally num_splits `[bs]` int32 = clamp(ceil(kv_lens / min_split_len), 1, max_splits), the decode
  split count, a function of the request's own length only.

Grid `[bs, P]`: each program sums the counts before its request (a masked block load, O(bs)) and
copies every P-th CHUNK of its ids, so any P is correct; P only spreads the copy. Importing this
module imports Triton; with `TRITON_INTERPRET=1` set before the import the kernel runs on CPU tensors.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from attn_core.errors import InvalidArgumentError
from attn_core.ops.triton_launch import CachedLaunch

CHUNK = 512


# No value or alignment specialization: one binary per constexpr set serves every batch, which lets
# `CachedLaunch` skip the per-call specialization work of the JIT launcher.
@triton.jit(
    do_not_specialize=["stride_row", "max_splits", "min_split_len"],
    do_not_specialize_on_alignment=[
        "REQ_TO_TOKEN", "REQ_POOL_INDICES", "KV_LENS", "KV_START", "KV_INDPTR", "KV_INDICES", "LAST_PAGE_LEN", "Q_LENS",
        "QO_INDPTR", "MASK_INDPTR", "NUM_SPLITS",
    ],
)  # fmt: skip
def _build_indices_kernel(
    REQ_TO_TOKEN,
    stride_row,
    REQ_POOL_INDICES,
    KV_LENS,
    KV_START,
    KV_INDPTR,
    KV_INDICES,
    LAST_PAGE_LEN,
    Q_LENS,
    QO_INDPTR,
    MASK_INDPTR,
    NUM_SPLITS,
    max_splits,
    min_split_len,
    BS_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_START: tl.constexpr,
    HAS_INDPTR: tl.constexpr,
    HAS_LAST: tl.constexpr,
    HAS_Q: tl.constexpr,
    HAS_MASK_INDPTR: tl.constexpr,
    HAS_SPLITS: tl.constexpr,
):
    r = tl.program_id(0)
    c = tl.program_id(1)
    num_c = tl.num_programs(1)
    offs = tl.arange(0, BS_BLOCK)
    before = offs < r
    lens = tl.load(KV_LENS + offs, mask=before, other=0)
    length = tl.load(KV_LENS + r)
    if PAGE_SIZE == 1:
        beg = tl.sum(lens, 0)
        count = length
    else:
        beg = tl.sum((lens + PAGE_SIZE - 1) // PAGE_SIZE, 0)
        count = (length + PAGE_SIZE - 1) // PAGE_SIZE
    if c == 0:
        if HAS_INDPTR:
            if r == 0:
                tl.store(KV_INDPTR, beg * 0)
            tl.store(KV_INDPTR + r + 1, beg + count)
        if HAS_LAST:
            tl.store(LAST_PAGE_LEN + r, length - tl.maximum(count - 1, 0) * PAGE_SIZE)
        if HAS_Q:
            q_lens = tl.load(Q_LENS + offs, mask=before, other=0)
            q_len = tl.load(Q_LENS + r)
            q_beg = tl.sum(q_lens, 0)
            if r == 0:
                tl.store(QO_INDPTR, q_beg * 0)
            tl.store(QO_INDPTR + r + 1, q_beg + q_len)
            if HAS_MASK_INDPTR:
                m_beg = tl.sum(q_lens.to(tl.int64) * lens.to(tl.int64), 0)
                if r == 0:
                    tl.store(MASK_INDPTR, m_beg * 0)
                tl.store(MASK_INDPTR + r + 1, m_beg + q_len.to(tl.int64) * length.to(tl.int64))
        if HAS_SPLITS:
            n = tl.minimum(tl.maximum(tl.cdiv(length, min_split_len), 1), max_splits)
            tl.store(NUM_SPLITS + r, n)
    row = tl.load(REQ_POOL_INDICES + r).to(tl.int64)
    src = REQ_TO_TOKEN + row * stride_row
    if HAS_START:
        src += tl.load(KV_START + r)
    dst = KV_INDICES + beg
    for i in range(c * CHUNK, count, num_c * CHUNK):
        o = i + tl.arange(0, CHUNK)
        ok = o < count
        if PAGE_SIZE == 1:
            tl.store(dst + o, tl.load(src + o, mask=ok), mask=ok)
        else:
            tl.store(dst + o, tl.load(src + o * PAGE_SIZE, mask=ok) // PAGE_SIZE, mask=ok)


def copy_programs(bs: int, on_gpu: bool) -> int:
    """Programs per request along the copy axis: enough to fill a GPU at small batch sizes (one under
    the interpreter, which runs programs one after another)."""
    return max(1, min(32, 512 // max(bs, 1))) if on_gpu else 1


def kv_indices_triton(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    kv_indptr: Optional[torch.Tensor] = None,
    last_page_len: Optional[torch.Tensor] = None,
    page_size: int = 1,
    kv_start: Optional[torch.Tensor] = None,
    q_lens: Optional[torch.Tensor] = None,
    qo_indptr: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
    num_splits: Optional[torch.Tensor] = None,
    max_splits: int = 1,
    min_split_len: int = 1,
) -> None:
    """Fill the index tensors of `bs = req_pool_indices.shape[0]` requests in place (see module doc).

    req_to_token `[rows, max_context_len]` int32 with contiguous rows; req_pool_indices `[bs]`
    int32/int64; kv_lens, kv_start, q_lens `[bs]` int32 (kv_lens in tokens); kv_indices int32 holding at
    least the sum of the counts (tokens, or pages with page_size > 1); last_page_len `[bs]` int32
    (with page_size 1: 1, or 0 for an empty request); qo_indptr is written only
    together with q_lens, mask_indptr only together with both. An empty batch writes kv_indptr = [0].
    """
    bs = req_pool_indices.shape[0]
    if bs == 0:
        if kv_indptr is not None:
            kv_indptr.zero_()
        return
    if req_to_token.stride(1) != 1:
        raise InvalidArgumentError("req_to_token", "a tensor with contiguous rows", tuple(req_to_token.stride()))
    dummy = kv_indices
    _LAUNCH(
        (bs, copy_programs(bs, req_to_token.is_cuda)),
        req_to_token,
        req_to_token.stride(0),
        req_pool_indices,
        kv_lens,
        kv_start if kv_start is not None else dummy,
        kv_indptr if kv_indptr is not None else dummy,
        kv_indices,
        last_page_len if last_page_len is not None else dummy,
        q_lens if q_lens is not None else dummy,
        qo_indptr if qo_indptr is not None else dummy,
        mask_indptr if mask_indptr is not None else dummy,
        num_splits if num_splits is not None else dummy,
        max_splits,
        min_split_len,
        BS_BLOCK=triton.next_power_of_2(bs),
        CHUNK=CHUNK,
        PAGE_SIZE=page_size,
        HAS_START=kv_start is not None,
        HAS_INDPTR=kv_indptr is not None,
        HAS_LAST=last_page_len is not None,
        HAS_Q=q_lens is not None,
        HAS_MASK_INDPTR=mask_indptr is not None,
        HAS_SPLITS=num_splits is not None,
        num_warps=4,
    )


_LAUNCH = CachedLaunch(_build_indices_kernel)
