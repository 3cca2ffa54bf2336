"""The step check: a batch's device tensors checked on the device, without a host sync, once per step.

On a GPU the default validation ("basic") reads only the host copies: reading the device tensors would
cost a sync per step. The step check reads them where they live, in one launch per step
(`AttentionBackend.init_forward_metadata`, `CudaGraphRunner.run`), before any K/V write:

per request r (row = req_pool_indices[r], its keys at columns 0 .. enc + seq - 1 of that row):
- REQUEST_ROW: row outside [0, rows); DUPLICATE_ROW: row and seq_len both those of an earlier request of
  the batch (their new tokens would write one slot twice; one row at two lengths is allowed: decode
  context parallelism's local batches read a request so);
- LENGTH: seq_lens < 0 (DECODE: < 1), encoder_lens < 0 or extend_seq_lens < 0; TABLE_WIDTH: enc + seq
  past the table's width; EXTEND_LENS: extend_seq_lens > seq_lens or extend_prefix_lens != seq - extend;
- START_LOC: extend_start_loc[r] != the sum of the extend lengths before r; MASK_INDPTR: mask_indptr[r]
  != the sum of q_len * seq_len before r (and mask_indptr[bs] the whole sum);
- KEY_SLOT: a key the request attends to whose `req_to_token` slot is outside [1, num_slots);
- CASCADE: with `cascade_len` P > 0, a request whose first P slots are not the first request's;
per step:
- SEQ_TOTAL: sum(seq_lens) != the host's `seq_lens_sum`; EXTEND_TOTAL: sum(extend_seq_lens) != the
  step's token count (the host's);
per new token t (the i-th of request r; with `out_cache_loc`):
- WRITE_SLOT: out_cache_loc[t] outside [1, num_slots); WRITE_OWNER: out_cache_loc[t] is not
  req_to_token[row, enc + seq - q_len + i], the slot the table gives the token's position (another
  request's slot, another position's, a duplicate).

Every fault is flagged in the fault word (`attn_core.ops.device_faults`), with the first offending
request for the per-request and per-token kinds. The check writes `safe[t]` = out_cache_loc[t] where the
token's write is allowed and 0 (the reserved dummy slot) where not: a token whose request failed any
check, a token of a step whose totals disagree, a token no request covers. The step's layers write
through `safe` (`attn_core.ops.kv_write.CheckedSlots`): no K/V lands outside the batch's legal slots.

Two implementations with the same results: `check_step_torch` (plain torch, any device, the reference)
and the Triton kernel of `attn_core.ops.step_checks_triton` (CUDA: one launch), chosen by `check_step`.

Worked example (DECODE, page_size 1): rows [0, 5] of a 4-row table, seq_lens [3, 2], out_cache_loc [7, 9]
with req_to_token[0, 2] = 7: request 1's row is out of range (REQUEST_ROW, first request 1), so safe is
[7, 0]: request 0 writes slot 7, request 1's write goes to the dummy slot.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Optional

import torch

from attn_core.ops.device_faults import DeviceFaultKind as K
from attn_core.ops.kv_write import record_fault, record_first
from attn_core.ops.step_tensors import StepTensors


def step_tensors(batch, req_to_token: torch.Tensor, num_slots: int, *, check_dup: bool = True) -> StepTensors:
    """The `StepTensors` of a validated (at "basic") `ForwardBatch`: its rows, lengths, offsets, verify
    mask offsets, `out_cache_loc` and cascade prefix, with the host totals `seq_lens_sum` and
    `num_tokens`. No device work."""
    b = batch
    decode = b.forward_mode.is_decode()
    spec = b.spec_info
    has_mask = b.forward_mode.is_target_verify() and spec is not None and spec.custom_mask is not None
    return StepTensors(
        req_to_token=req_to_token,
        req_pool_indices=b.req_pool_indices,
        seq_lens=b.seq_lens,
        num_tokens=b.num_tokens,
        num_slots=num_slots,
        encoder_lens=b.encoder_lens,
        q_lens=None if decode else b.extend_seq_lens,
        prefix_lens=None if decode else b.extend_prefix_lens,
        start_loc=None if decode else b.extend_start_loc,
        mask_indptr=spec.mask_indptr if has_mask else None,
        out_cache_loc=b.out_cache_loc,
        seq_total=b.seq_lens_sum,
        cascade_len=b.cascade_prefix_len,
        decode=decode,
        check_dup=check_dup,
    )


def check_step_torch(s: StepTensors, safe: Optional[torch.Tensor], fault: torch.Tensor) -> None:
    """The step check in plain torch (module docstring): faults into `fault` (int32 fault word), the
    allowed slots into `safe` (int64 `[num_tokens]`, when `s.out_cache_loc` is given). Every gather
    clamps its indices; no sync."""
    bs, dev, i64 = s.batch_size, s.req_to_token.device, torch.int64
    rows, width = s.req_to_token.shape
    T = s.num_tokens
    if bs == 0:
        if safe is not None and T:
            safe[:T] = 0
        return
    row = s.req_pool_indices.to(i64)
    seq = s.seq_lens.to(i64)
    enc = s.encoder_lens.to(i64) if s.encoder_lens is not None else torch.zeros_like(seq)
    q = s.q_lens.to(i64) if s.q_lens is not None else torch.ones_like(seq)
    qc = q.clamp(min=0)
    ends = torch.cumsum(qc, 0)
    beg = ends - qc
    idx = torch.arange(bs, device=dev)

    row_bad = (row < 0) | (row >= rows)
    pad = (row == 0) & (seq == s.pad_seq_len)
    dup = torch.zeros(bs, dtype=torch.bool, device=dev)
    if s.check_dup:
        earlier = idx[None, :] < idx[:, None]
        same = (row[:, None] == row[None, :]) & (seq[:, None] == seq[None, :])
        dup = (same & earlier & ~pad[:, None] & ~pad[None, :]).any(1)
    len_bad = (seq < (1 if s.decode else 0)) | (enc < 0) | (q < 0)
    width_bad = ~len_bad & (enc + seq > width)
    ext_bad = q > seq
    if s.prefix_lens is not None:
        ext_bad = ext_bad | (s.prefix_lens.to(i64) != seq - q)
    start_bad = torch.zeros_like(dup) if s.start_loc is None else s.start_loc.to(i64) != beg
    mask_bad = torch.zeros_like(dup)
    if s.mask_indptr is not None:
        m = (qc * seq.clamp(min=0)).cumsum(0)
        mask_bad = s.mask_indptr[:bs].to(i64) != (m - qc * seq.clamp(min=0))
        last_bad = (s.mask_indptr[bs:].to(i64) != m[-1:]).reshape(())
        mask_bad = mask_bad | ((idx == bs - 1) & last_bad)
    shape_ok = ~(row_bad | len_bad | width_bad)
    safe_row = torch.where(row_bad, torch.zeros_like(row), row)
    n_keys = torch.where(shape_ok, enc + seq, torch.zeros_like(seq))

    key_bad = torch.zeros_like(dup)
    casc_bad = torch.zeros_like(dup)
    if (s.check_keys or s.cascade_len) and width:
        cols = torch.arange(width, device=dev)
        table = s.req_to_token[safe_row]  # [bs, width]
        if s.check_keys:
            visible = cols[None, :] < n_keys[:, None]
            key_bad = (visible & ((table < 1) | (table >= s.num_slots))).any(1) & ~pad
        if s.cascade_len:
            p = min(s.cascade_len, width)
            shared = cols[None, :p] < torch.minimum(n_keys, torch.full_like(n_keys, p))[:, None]
            differ = (table[:, :p] != table[:1, :p]) & shared
            casc_bad = (differ.any(1) | (n_keys < p)) & (idx > 0)
            casc_bad = casc_bad | ((idx == 0) & (n_keys < p))
    req_bad = row_bad | dup | len_bad | width_bad | ext_bad | start_bad | mask_bad | key_bad | casc_bad
    for kind, bad in (
        (K.REQUEST_ROW, row_bad),
        (K.DUPLICATE_ROW, dup),
        (K.LENGTH, len_bad),
        (K.TABLE_WIDTH, width_bad),
        (K.EXTEND_LENS, ext_bad),
        (K.START_LOC, start_bad),
        (K.MASK_INDPTR, mask_bad),
        (K.KEY_SLOT, key_bad),
        (K.CASCADE, casc_bad),
    ):
        record_first(fault, kind, bad)
    step_bad = ends[-1] != T
    record_fault(fault, K.EXTEND_TOTAL, step_bad.reshape(1))
    if s.seq_total is not None:  # a host int, or a 1-element device tensor a kernel of the step wrote
        total = s.seq_total.reshape(()).to(i64) if isinstance(s.seq_total, torch.Tensor) else s.seq_total
        seq_bad = seq.sum() != total
        record_fault(fault, K.SEQ_TOTAL, seq_bad.reshape(1))
        step_bad = step_bad | seq_bad
    if s.out_cache_loc is None or safe is None or T == 0:
        return
    t = torch.arange(T, device=dev)
    owner = torch.searchsorted(ends, t, right=True)  # request of token t (bs: nobody's)
    covered = owner < bs
    r = owner.clamp(max=bs - 1)
    loc = s.out_cache_loc.to(i64)
    col = (enc + seq - q)[r] + (t - beg[r])
    col_ok = covered & shape_ok[r] & (col >= 0) & (col < width)
    expect = s.req_to_token[safe_row[r], col.clamp(0, max(width - 1, 0))].to(i64)
    pad_tok = (loc == 0) & (s.pad_seq_len >= 0)  # graph runs: a token may write the dummy slot (stays 0)
    in_pool = ((loc >= 1) & (loc < s.num_slots)) | pad_tok
    owned = (col_ok & (loc == expect)) | pad_tok
    slot_bad = covered & ~in_pool
    owner_bad = covered & in_pool & ~owned & ~req_bad[r]
    per_request = torch.zeros(bs, dtype=torch.int32, device=dev)
    record_first(fault, K.WRITE_SLOT, per_request.index_add(0, r, slot_bad.to(torch.int32)) > 0)
    record_first(fault, K.WRITE_OWNER, per_request.index_add(0, r, owner_bad.to(torch.int32)) > 0)
    ok = covered & in_pool & owned & ~req_bad[r] & ~step_bad
    safe[:T] = torch.where(ok, loc, torch.zeros_like(loc))


@functools.lru_cache(maxsize=1)
def _triton_path():
    """`check_step_triton` when Triton is importable, else None (looked up once: per-step code)."""
    if importlib.util.find_spec("triton") is None:
        return None
    from attn_core.ops.step_checks_triton import check_step_triton

    return check_step_triton


@dataclass
class PendingStepCheck:
    """A step check not launched yet: what `AttentionBackend.take_step_check` hands a backend whose index
    launch runs it (`attn_core.ops.kv_indices_triton.kv_indices_triton(step_check=...)`, `build_kv_indices`):
    its `tensors`, the allowed-slots buffer `safe` (int64, or None: no write check) and the `fault` word."""

    tensors: StepTensors
    safe: Optional[torch.Tensor]
    fault: torch.Tensor

    def run(self) -> None:
        """Launch it on its own (`check_step`)."""
        check_step(self.tensors, self.safe, self.fault)


def check_step(s: StepTensors, safe: Optional[torch.Tensor], fault: torch.Tensor) -> None:
    """The step check on `s`'s device: one Triton launch on CUDA (Triton importable), the torch path
    elsewhere. Same results either way (the tests compare them)."""
    if s.req_to_token.is_cuda and _triton_path() is not None:
        _triton_path()(s, safe, fault)
    else:
        check_step_torch(s, safe, fault)


__all__ = ["PendingStepCheck", "StepTensors", "check_step", "check_step_torch", "step_tensors"]
