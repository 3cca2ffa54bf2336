"""Double sparsity's token selection on the device, without a host sync: approximate scores from the label
cache, then the top-k keys of every (request, q head).

1. `label_scores`: for request r, q head h (KV head g = h // group) and key j, the approximate score
   s~(j) = sum_c q[h, ch[g, c]] * label[j, g, c], where ch are the layer's heavy channels and the label
   cache holds label[j, g, c] = k[j, g, ch[g, c]]. Written as an order key: the float32 bits mapped to an
   int32 whose signed order is the float order (-0.0 counted as +0.0).
2. `select_topk`: the slots of the k keys with the largest s~ (k = min(top_k, kv_len)); ties at the k-th
   value go to the lower positions. A radix select finds the k-th largest key in four passes of 8 bits (a
   256-bin histogram of the keys that match the digits found so far), then one pass writes the slots of
   the keys above it and of the first equal ones, in position order.

Only requests flagged in `sparse` (int8 `[bs]`) are worked on; the others' programs return at once. Slots
outside [0, num_slots) read slot 0's label instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_core.contract.errors import InvalidArgumentError
from attn_sparse.kernels.ranged import dot_precision
from attn_sparse.plan import StepPlan


@triton.jit(do_not_specialize=["num_slots", "width"])
def _label_scores_kernel(
    Q,
    stride_qb,
    stride_qh,
    CH,
    stride_ch,
    LAB,
    stride_ls,
    stride_lh,
    KV_INDPTR,
    KV_INDICES,
    num_slots,
    SPARSE,
    KEYS,
    stride_kb,
    stride_kh,
    width,
    group,
    num_channels,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    start = tl.program_id(2) * BLOCK_N
    if tl.load(SPARSE + r) == 0:
        return
    kv_beg = tl.load(KV_INDPTR + r)
    kv_len = tl.minimum(tl.load(KV_INDPTR + r + 1) - kv_beg, width)
    if start >= kv_len:
        return
    n = start + tl.arange(0, BLOCK_N)
    n_ok = n < kv_len
    c = tl.arange(0, BLOCK_C)
    c_ok = c < num_channels
    ch = tl.load(CH + kvh * stride_ch + c, mask=c_ok, other=0)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < group
    head = (kvh * group + g).to(tl.int64)
    q_lab = tl.load(
        Q + r.to(tl.int64) * stride_qb + head[:, None] * stride_qh + ch[None, :],
        mask=g_ok[:, None] & c_ok[None, :],
        other=0.0,
    )
    slot = tl.load(KV_INDICES + kv_beg + n, mask=n_ok, other=0)
    slot = tl.where((slot >= 0) & (slot < num_slots), slot, 0).to(tl.int64)
    lab = tl.load(
        LAB + slot[:, None] * stride_ls + kvh * stride_lh + c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0
    )
    score = tl.dot(q_lab, tl.trans(lab.to(q_lab.dtype)), input_precision=DOT_PREC) + 0.0  # + 0.0: -0.0 becomes +0.0
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    tl.store(
        KEYS + r.to(tl.int64) * stride_kb + head[:, None] * stride_kh + n[None, :],
        key,
        mask=g_ok[:, None] & n_ok[None, :],
    )


@triton.jit(do_not_specialize=["width", "top_k"])
def _select_topk_kernel(
    KEYS,
    stride_kb,
    stride_kh,
    width,
    KV_INDPTR,
    KV_INDICES,
    SPARSE,
    SEL,
    stride_sb,
    stride_sh,
    top_k,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    if tl.load(SPARSE + r) == 0:
        return
    kv_beg = tl.load(KV_INDPTR + r)
    kv_len = tl.minimum(tl.load(KV_INDPTR + r + 1) - kv_beg, width)
    row = KEYS + r.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    out = SEL + r.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 512)
    # radix select of the k-th largest key, 8 bits a pass from the top: `prefix` holds the digits found,
    # `remaining` how many keys equal to the prefix so far are still to be taken
    remaining = tl.minimum(top_k, kv_len)
    prefix = (kv_len * 0).to(tl.int64)
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([512], dtype=tl.int32)
        for start in range(0, kv_len, BLOCK):
            n = start + offs
            ok = n < kv_len
            u = tl.load(row + n, mask=ok, other=0).to(tl.int64) + 2147483648  # unsigned order, as int64
            match = ok & ((u >> (shift + 8)) == prefix)
            digit = tl.where(match, (u >> shift) & 255, 256).to(tl.int32)  # bin 256: not a candidate
            hist += tl.histogram(digit, 512)
        hist = tl.where(bins < 256, hist, 0)
        above_or_at = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # candidates with digit >= bin
        b = tl.max(tl.where(above_or_at >= remaining, bins, -1), 0)
        remaining -= tl.sum(tl.where(bins > b, hist, 0), 0)
        prefix = prefix * 256 + b
    written = remaining * 0
    equal_seen = remaining * 0
    for start in range(0, kv_len, BLOCK):
        n = start + offs
        ok = n < kv_len
        u = tl.load(row + n, mask=ok, other=0).to(tl.int64) + 2147483648
        eq = (ok & (u == prefix)).to(tl.int32)
        take = (ok & (u > prefix)) | ((eq > 0) & (equal_seen + tl.cumsum(eq, 0) - eq < remaining))
        take_i = take.to(tl.int32)
        pos = written + tl.cumsum(take_i, 0) - take_i
        slot = tl.load(KV_INDICES + kv_beg + n, mask=take, other=0)
        tl.store(out + pos, slot, mask=take)
        written += tl.sum(take_i, 0)
        equal_seen += tl.sum(eq, 0)


def label_scores(
    q: torch.Tensor,
    channels: torch.Tensor,
    labels: torch.Tensor,
    plan: StepPlan,
    sparse: torch.Tensor,
    keys: torch.Tensor,
    block_n: int,
) -> None:
    """Write the order keys of every cached key of the flagged requests into `keys` int32 `[bs, Hq, W]`
    (positions >= W are not scored). q `[bs, Hq, D]` (DECODE rows), channels `[Hkv, C]` integer (the
    layer's heavy channels), labels the layer's label buffer `[slots, Hkv, C]`."""
    bs, hq = q.shape[0], q.shape[1]
    hkv, c = labels.shape[1], labels.shape[2]
    if tuple(channels.shape) != (hkv, c):
        raise InvalidArgumentError(
            "channels", f"the label buffer's (heads, channels) = {(hkv, c)}", tuple(channels.shape)
        )
    width = keys.shape[2]
    if bs == 0 or width == 0:
        return
    group = hq // hkv
    _label_scores_kernel[(bs, hkv, triton.cdiv(width, block_n))](
        q,
        q.stride(0),
        q.stride(1),
        channels,
        channels.stride(0),
        labels,
        labels.stride(0),
        labels.stride(1),
        plan.kv_indptr,
        plan.kv_indices,
        labels.shape[0],
        sparse,
        keys,
        keys.stride(0),
        keys.stride(1),
        width,
        group,
        c,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_C=max(16, triton.next_power_of_2(c)),
        DOT_PREC=dot_precision(q.dtype),
        num_warps=4 if q.is_cuda else 1,
    )


def select_topk(keys: torch.Tensor, plan: StepPlan, sparse: torch.Tensor, top_k: int, selected: torch.Tensor) -> None:
    """Write into `selected` int32 `[bs, Hq, >= top_k]` the slots of every flagged request's top-k keys per
    q head (the first min(top_k, kv_len) entries of its row, in position order), from `label_scores`' keys."""
    bs, hq, width = keys.shape
    if bs == 0 or width == 0:
        return
    _select_topk_kernel[(bs, hq)](
        keys,
        keys.stride(0),
        keys.stride(1),
        width,
        plan.kv_indptr,
        plan.kv_indices,
        sparse,
        selected,
        selected.stride(0),
        selected.stride(1),
        top_k,
        BLOCK=1024 if keys.is_cuda else 64,
        num_warps=4 if keys.is_cuda else 1,
    )
