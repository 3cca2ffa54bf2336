"""Pieces shared by the decode and extend kernels: score transform, online-softmax step, finalize,
the bounds of CSR offsets and the fault-buffer entries (`attn_core.ops.device_faults`).

All softmax arithmetic runs in the base-2 domain (`exp2`/`log2`, logits pre-multiplied by log2(e));
LSEs leave the kernels in natural log. Host-side scale factors come from `score_scales`.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from attn_core.errors import InvalidArgumentError
from attn_core.ops.device_faults import DeviceFaultKind

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
#: the same constants for use inside kernels (Triton only reads constexpr globals)
LOG2E_K = tl.constexpr(LOG2E)
LN2_K = tl.constexpr(LN2)
#: fault-buffer entries the attention kernels record
FAULT_SLOT = tl.constexpr(int(DeviceFaultKind.SLOT))
FAULT_KEY_OFFSETS = tl.constexpr(int(DeviceFaultKind.KEY_OFFSETS))
FAULT_QUERY_ROWS = tl.constexpr(int(DeviceFaultKind.QUERY_ROWS))
FAULT_MASK = tl.constexpr(int(DeviceFaultKind.MASK))


def score_scales(sm_scale: float, logit_cap: float, k_scale: float = 1.0) -> tuple[float, float]:
    """(qk_scale, cap_scale): without a cap, logits2 = qk·sm_scale·k_scale·log2e; with a cap c,
    logits2 = c·tanh(qk·sm_scale·k_scale / c)·log2e (`scale_scores`). The product must be > 0."""
    s = sm_scale * k_scale
    if not s > 0:
        raise InvalidArgumentError("layer.scaling * k_scale", "> 0", s)
    if logit_cap > 0:
        return s / logit_cap, logit_cap * LOG2E
    return s * LOG2E, 0.0


@triton.jit
def scale_scores(qk, qk_scale, cap_scale, LOGIT_CAP: tl.constexpr):
    """Raw q·k under a logit cap to base-2 logits (see `score_scales`); tanh is written with exp so
    the interpreter runs it. Without a cap the kernels keep raw scores and fold qk_scale into
    `softmax_step` (one FMA per score)."""
    x = qk * qk_scale
    t = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
    return t * cap_scale


@triton.jit
def softmax_step(m_i, l_i, acc, s, s_scale, GUARD: tl.constexpr):
    """One online-softmax step over scores `s` [M, N]: base-2 logits are s * s_scale (s_scale > 0;
    -inf where masked).

    Returns the new running max, denominator, rescaled accumulator and the probabilities `p` [M, N].
    With GUARD, rows that have seen only -inf keep max -inf and contribute nothing (no NaN); without
    it every row must hold a finite score (unmasked tiles)."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)
    if GUARD:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s * s_scale - m_use[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    return m_new, l_new, acc * alpha[:, None], p


@triton.jit
def add_sink(m_i, l_i, acc, sink2):
    """Join a base-2 sink logit per row to the denominator (it adds nothing to the output)."""
    m_new = tl.maximum(m_i, sink2)
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.exp2(sink2 - m_new), acc * alpha[:, None]


@triton.jit
def finalize(m_i, l_i, acc):
    """Normalized output and base-2 LSE; rows that saw no key get 0 and -inf."""
    ok = l_i > 0.0
    inv = tl.where(ok, 1.0 / tl.where(ok, l_i, 1.0), 0.0)
    lse2 = tl.where(ok, m_i + tl.log2(tl.where(ok, l_i, 1.0)), float("-inf"))
    return acc * inv[:, None], lse2


@triton.jit
def load_slots(KV_INDICES, kv_beg, n, n_ok, num_slots, bad_slots):
    """Slots (int64) of keys `n` of the request whose CSR entries start at `kv_beg`, read where `n_ok`;
    returns (slot, n_ok and the slot inside [0, num_slots), bad_slots | the keys whose slot is not):
    a key with a slot outside the pool is masked out and recorded, never read."""
    slot = tl.load(KV_INDICES + kv_beg + n, mask=n_ok, other=0).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < num_slots)
    return slot, n_ok & slot_ok, bad_slots | (n_ok & ~slot_ok)


@triton.jit
def offset_range(INDPTR, r, size):
    """(begin, length, clamped) of CSR entry r, its offsets INDPTR[r], INDPTR[r+1] clamped so that
    0 <= begin <= end <= size; `clamped` says whether either offset was out of range."""
    beg_in = tl.load(INDPTR + r)
    end_in = tl.load(INDPTR + r + 1)
    beg = tl.minimum(tl.maximum(beg_in, 0), size)
    end = tl.minimum(tl.maximum(end_in, beg), size)
    return beg, end - beg, (beg != beg_in) | (end != end_in)
