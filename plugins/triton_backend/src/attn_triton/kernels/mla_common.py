"""Pieces shared by the two MLA kernels (`mla_decode.py`'s Triton kernel and the Hopper Gluon kernel
`mla_wgmma.py`): what a program takes of its request (`request_keys`) and the masked scores of one key
tile (`tile_scores`). Kept apart from either kernel so that neither module imports the other's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attn_triton.kernels.common import FAULT_KEY_OFFSETS, FAULT_MASK, FAULT_QUERY_ROWS, offset_range, scale_scores
from attn_triton.kernels.decode import split_count, split_range


@triton.jit
def request_keys(
    QO_INDPTR,
    KV_INDPTR,
    MASK_INDPTR,
    FAULT,
    r,
    first,
    s,
    num_tokens,
    num_indices,
    mask_size,
    min_split_len,
    max_splits,
    window,
    Q_LEN: tl.constexpr,
    USE_MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """What a program of either MLA kernel (`mla_decode.py`'s and the Hopper kernel `mla_wgmma.py`, which
    calls it from Gluon) takes of request r: (q_beg, q_len, kv_beg, kv_len, mask_beg, s_lo, s_hi, n_split). Its
    query rows (q_len 1 at row r in a DECODE launch, else from QO_INDPTR) and keys (KV_INDPTR), both
    clamped to their buffers; with USE_MASK the start of its `[q_len, kv_len]` tree-mask block; its keys
    [s_lo, s_hi) of split s: of [lo, kv_len), lo the oldest key any row's window reaches, a
    `decode.split_range` share when SPLIT (n_split splits; a program with s >= n_split has no work), all
    of it otherwise (n_split 1). The `first` program of the request raises the KEY_OFFSETS / QUERY_ROWS /
    MASK faults for offsets outside their buffers (entries past them are not read)."""
    kv_beg, kv_len, kv_clamped = offset_range(KV_INDPTR, r, num_indices)
    if Q_LEN == 1:
        q_beg = r
        q_len = 1
    else:
        q_beg, q_len, q_clamped = offset_range(QO_INDPTR, r, num_tokens)
        if first:
            tl.store(FAULT + FAULT_QUERY_ROWS, 1, mask=q_clamped)
    if first:
        tl.store(FAULT + FAULT_KEY_OFFSETS, 1, mask=kv_clamped)
    mask_beg = 0
    if USE_MASK:
        mask_beg = tl.load(MASK_INDPTR + r)
        mask_outside = (mask_beg < 0) | (mask_beg + q_len.to(tl.int64) * kv_len > mask_size)
        if first:
            tl.store(FAULT + FAULT_MASK, 1, mask=mask_outside)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(kv_len - q_len - window + 1, 0)
    if SPLIT:
        n_split = split_count(kv_len, min_split_len, max_splits)
        s_lo, s_hi = split_range(kv_len, lo, s, n_split, BLOCK_N)
    else:
        n_split = 1
        s_lo = lo
        s_hi = kv_len
    return q_beg, q_len, kv_beg, kv_len, mask_beg, s_lo, s_hi, n_split


@triton.jit
def tile_scores(
    qk,
    n,
    n_ok,
    t,
    row_ok,
    q_pos,
    mask_beg,
    kv_len,
    MASK,
    mask_size,
    qk_scale,
    cap_scale,
    window,
    Q_LEN: tl.constexpr,
    USE_MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
):
    """Scores of one key tile `[BLOCK_H, BLOCK_N]` of either MLA kernel (`mla_decode.py`'s and the Hopper
    kernel `mla_wgmma.py`, which calls it from Gluon): raw q·k, or base-2 logits under a logit cap
    (`common.scale_scores`); -inf where the key is out of the tile's range or pool (`n_ok [BLOCK_N]`), the
    row is padding (`row_ok [BLOCK_H]`), or, with Q_LEN > 1, the key is past the row's causal limit
    (`q_pos`, the row's token position) or off in its tree mask (per request a row-major
    `[q_len, kv_len]` uint8 block at mask_beg; entries outside the mask are not read), or outside its
    window."""
    if LOGIT_CAP:
        sc = scale_scores(qk, qk_scale, cap_scale, LOGIT_CAP)
    else:
        sc = qk
    ok = n_ok[None, :] & row_ok[:, None]
    if Q_LEN > 1:
        if USE_MASK:
            at = mask_beg + t[:, None].to(tl.int64) * kv_len + n[None, :]
            bits = tl.load(MASK + at, mask=ok & (at >= 0) & (at < mask_size), other=0)
            ok = ok & (bits != 0)
        else:
            ok = ok & (n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            ok = ok & (n[None, :] > q_pos[:, None] - window)
    return tl.where(ok, sc, float("-inf"))
