"""KV-index builders in plain torch (device-agnostic, no host sync when sizes are passed in), and the
page arithmetic every backend shares: pages of a token count (`pages_for`), page offsets and last-page
lengths on the host (`host_page_offsets`, `host_last_page_lens`: numpy, for per-step host code) and in
torch (`page_indptr_from_lens`, `last_page_len_from_lens`), and dense block tables
(`page_table_from_req_to_token`).

These are the reference and the CPU path; plugins may add faster versions and test against these.

Worked example (page_size 1): two requests in rows 3 and 0 with kv lengths 2 and 3,
req_to_token[3, :2] = [7, 8], req_to_token[0, :3] = [4, 5, 6]:
    kv_indptr  = [0, 2, 5]
    kv_indices = [7, 8, 4, 5, 6]
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Optional

import numpy as np
import torch

from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.validation import SMALL_HOST_BATCH
from attn_core.ops.device_faults import DeviceFaultKind
from attn_core.ops.step_checks import PendingStepCheck


def exclusive_cumsum(lens: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """[n] lengths → [n+1] offsets starting at 0."""
    out = torch.zeros(lens.shape[0] + 1, dtype=dtype, device=lens.device)
    out[1:] = torch.cumsum(lens, dim=0)
    return out


def kv_indptr_from_lens(kv_lens: torch.Tensor) -> torch.Tensor:
    """CSR row pointer `[bs+1]` int32 of per-request KV lengths."""
    return exclusive_cumsum(kv_lens, torch.int32)


def kv_indices_from_req_to_token(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    total: int,
    kv_start: Optional[torch.Tensor] = None,
    page_size: int = 1,
) -> torch.Tensor:
    """Concatenate each request's slots `req_to_token[row, start : start + len]` (int32 `[total]`).

    `total` = kv_indptr[-1], passed in from the host so no sync happens. `kv_start` (per request,
    default 0) skips leading tokens, e.g. encoder tokens for a decoder self-attention layer.

    With `page_size` > 1, `kv_indptr` counts pages (`page_indptr_from_lens`) and the result holds page
    ids: entry j of a request is the page of its token start + j * page_size. That token must sit at
    offset 0 of its page (true when `start` is a multiple of page_size, by the allocator's layout).
    """
    device = req_to_token.device
    tok = torch.arange(total, device=device, dtype=torch.int64)
    owner = torch.searchsorted(kv_indptr[1:].to(torch.int64), tok, right=True)
    col = (tok - kv_indptr.to(torch.int64)[owner]) * page_size
    if kv_start is not None:
        col = col + kv_start.to(torch.int64)[owner]
    rows = req_pool_indices.to(torch.int64)[owner]
    slots = req_to_token[rows, col]
    return (slots if page_size == 1 else slots // page_size).to(torch.int32)


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens: ceil(tokens / page_size), 0 for none (host ints).

    Example: pages_for(129, 128) == 2; pages_for(70, 32) == 3; pages_for(0, 16) == 0."""
    return -(-tokens // page_size)


def num_pages_from_lens(kv_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """`[n]` pages each request's `kv_lens` tokens occupy (ceil(len / page_size); 0 for no tokens)."""
    return torch.div(kv_lens + (page_size - 1), page_size, rounding_mode="floor")


def page_indptr_from_lens(kv_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """CSR row pointer `[n+1]` int32 over pages (page_size 1: the same as `kv_indptr_from_lens`)."""
    return exclusive_cumsum(num_pages_from_lens(kv_lens, page_size), torch.int32)


def last_page_len_from_lens(kv_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """int32 `[n]` tokens in each request's last page: 1..page_size, and 0 for a request with no tokens.

    Worked example (page_size 4): kv_lens [0, 1, 4, 5] -> pages [0, 1, 1, 2], last [0, 1, 4, 1].
    """
    pages = num_pages_from_lens(kv_lens, page_size)
    return (kv_lens - (pages - 1).clamp(min=0) * page_size).to(torch.int32)


def host_page_offsets(lens: np.ndarray, page_size: int, out: np.ndarray) -> int:
    """`page_indptr_from_lens` on the host: write the page offsets of requests with `lens` keys (numpy
    int32 `[bs]`) into `out` (numpy int32 `[bs+1]`: 0, then the running sum of ceil(len / page_size)) and
    return the page count. For per-step host code, where each torch op costs several times more.

    Up to `attn_core.contract.validation.SMALL_HOST_BATCH` requests the sum runs over a Python list (~0.6 µs at
    bs 1 on a desktop core, against ~4 µs for the numpy ops at any size).
    Example: lens [5, 2, 0], page_size 4 -> out [0, 2, 3, 3], returns 3."""
    out[0] = 0
    if lens.shape[0] <= SMALL_HOST_BATCH:
        total = 0
        for i, n in enumerate(lens.tolist(), 1):
            total += (n + page_size - 1) // page_size
            out[i] = total
        return total
    if page_size == 1:
        lens.cumsum(out=out[1:])
    else:
        ((lens + (page_size - 1)) // page_size).cumsum(out=out[1:])
    return int(out[-1])


def host_last_page_lens(lens: np.ndarray, page_size: int, out: np.ndarray) -> None:
    """`last_page_len_from_lens` on the host: write into `out` (numpy int32 `[bs]`) the tokens in the last
    page of requests with `lens` keys (numpy int32 `[bs]`): min((len + P - 1) % P + 1, len), i.e. 0 for
    a request with no keys, else 1..P.

    Example: lens [0, 1, 4, 5], page_size 4 -> out [0, 1, 4, 1]."""
    if page_size == 1:
        np.minimum(lens, 1, out=out)
    else:
        np.minimum((lens + (page_size - 1)) % page_size + 1, lens, out=out)


def rows_in_table(rows: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows clamped into a table of `num_rows` rows, int64 `[n]`; which were inside it, bool `[n]`): device
    rows a kernel or a gather may follow without an out-of-bounds read, the refused ones reading row 0 (the
    caller masks their keys). Device ops only, no sync. Example: rows [2, -1, 9], num_rows 4 -> ([2, 0, 3],
    [True, False, False])."""
    r = rows.to(torch.int64)
    return r.clamp(0, num_rows - 1), (r >= 0) & (r < num_rows)


def slots_in_pool(slots: torch.Tensor, num_slots: Optional[int]) -> torch.Tensor:
    """Where `slots` lie in a KV pool of `num_slots` slots, bool, `slots`' shape (None: everywhere). Example:
    slots [3, -1, 7], num_slots 5 -> [True, False, False]."""
    if num_slots is None:
        return torch.ones_like(slots, dtype=torch.bool)
    return (slots >= 0) & (slots < num_slots)


def page_table_from_req_to_token(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    max_pages: int,
    *,
    pad: int = 0,
    out: Optional[torch.Tensor] = None,
    num_slots: Optional[int] = None,
    fault: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The dense block table int32 `[bs, max_pages]` of the requests in rows `req_pool_indices` with
    `kv_lens` keys (device tensors `[bs]`; req_to_token int32 `[rows, max_context_len]`): entry j of a
    request is the page of its key j * page_size, entries past its last page are `pad` (0, the reserved
    dummy page, by default; TensorRT-LLM's kernels take -1). Plain torch, no host sync, capturable in a
    CUDA graph. Relies on the allocator's layout: token i of a request sits at offset i % page_size of
    its page.

    `out`: a `[>= bs, max_pages]` int32 buffer (e.g. a CUDA graph's) whose first bs rows receive the
    table, which is returned. With `num_slots` / `fault` (the KV pool's slot count and the int32 buffer of
    `attn_core.ops.device_faults.DeviceFaultFlags`) what the host cannot check is checked on the device:
    a request row outside the table (its row becomes all `pad`, `REQUEST_ROW` recorded) and a slot outside
    the pool (`pad`, `SLOT` recorded); without them an out-of-range row is torch's indexing error.

    Worked example (page_size 32, max_pages 4, pad -1): requests in rows 2 and 0 with 70 and 5 keys,
    req_to_token[2, 0] = 320, [2, 32] = 96, [2, 64] = 640, req_to_token[0, 0] = 32 ->
        [[10,  3, 20, -1],
         [ 1, -1, -1, -1]]
    """
    device = req_to_token.device
    rows = req_pool_indices.to(torch.int64)
    cols = torch.arange(max_pages, device=device, dtype=torch.int64) * page_size
    valid = cols[None, :] < kv_lens.to(torch.int64)[:, None]
    cols = cols.clamp(max=req_to_token.shape[1] - 1)
    if fault is not None:
        rows, row_ok = rows_in_table(rows, req_to_token.shape[0])
        _record(fault, DeviceFaultKind.REQUEST_ROW, ~row_ok)
        valid = valid & row_ok[:, None]
    slots = req_to_token[rows[:, None], cols[None, :]].to(torch.int64)
    if num_slots is not None and fault is not None:
        bad_slot = valid & ~slots_in_pool(slots, num_slots)
        _record(fault, DeviceFaultKind.SLOT, bad_slot)
        valid = valid & ~bad_slot
    pages = torch.div(slots, page_size, rounding_mode="floor")
    table = torch.where(valid, pages, torch.full_like(pages, pad)).to(torch.int32)
    if out is None:
        return table
    bs = rows.shape[0]
    out[:bs].copy_(table)
    return out[:bs]


def _record(fault: torch.Tensor, kind: DeviceFaultKind, bad: torch.Tensor) -> None:
    """Set entry `kind` of the fault buffer when any of `bad` holds (device ops only, no sync)."""
    flag = fault[int(kind) : int(kind) + 1]
    torch.maximum(flag, bad.any().to(fault.dtype).reshape(1), out=flag)


def index_kernel_runs_on(req_to_token: torch.Tensor) -> bool:
    """Whether `build_kv_indices` takes its Triton path for tables on `req_to_token`'s device: on CUDA. (Inside
    `attn_core.testing.device_path.accelerator_checks`, CPU tables too, under the Triton interpreter: the
    accelerator's bounds-checked path in CPU tests.) Example: a CPU table -> False."""
    return req_to_token.is_cuda


@functools.lru_cache(maxsize=1)
def _triton_path():
    """`kv_indices_triton` when Triton is importable, else None (looked up once: this is per-step code)."""
    if importlib.util.find_spec("triton") is None:
        return None
    from attn_core.ops.kv_indices_triton import kv_indices_triton

    return kv_indices_triton


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    total: int,
    *,
    page_size: int = 1,
    kv_start: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    indptr_out: Optional[torch.Tensor] = None,
    last_page_len_out: Optional[torch.Tensor] = None,
    q_lens: Optional[torch.Tensor] = None,
    qo_indptr_out: Optional[torch.Tensor] = None,
    num_slots: Optional[int] = None,
    fault: Optional[torch.Tensor] = None,
    whole_out: bool = False,
    keep_layout: bool = False,
    step_check: Optional[PendingStepCheck] = None,
) -> torch.Tensor:
    """Slot ids (page_size 1) or page ids of each request's `kv_lens` tokens, concatenated: int32 `[total]`.

    Same result as `kv_indices_from_req_to_token` with `page_indptr_from_lens(kv_lens, page_size)`, but
    from the lengths alone, so the caller builds no indptr on the device. `total` (the sum of pages) comes
    from the host: no sync. With `out` (int32, at least `total` long, e.g. a CUDA-graph buffer) the ids go
    to `out[:total]`, which is returned (`whole_out`: `out` itself is, its entries past `total` as they
    were; for callers whose readers take the count from elsewhere, sparing the view's microseconds of
    host time per step). In the same launch, optionally: `indptr_out` `[bs+1]` (page
    offsets, `page_indptr_from_lens`), `last_page_len_out` `[bs]` (`last_page_len_from_lens`) and, from
    `q_lens`, `qo_indptr_out` `[bs+1]` (all int32). On CUDA with Triton importable one Triton kernel does
    the work (`attn_core.ops.kv_indices_triton`), which bounds-checks on the device what the host cannot
    (rows, lengths, the host `total` whatever the device `kv_lens` say, and with `num_slots` every slot
    against the KV pool), writes only inside the buffers and records refusals in `fault` (the int32
    buffer of `attn_core.ops.device_faults.DeviceFaultFlags`); elsewhere the torch path, where torch's
    indexing raises on an out-of-range index instead. `keep_layout` (Triton path; for readers that take
    the offsets from the host's lengths, as FlashInfer's plans do): a refused request row keeps its ids'
    places as dummy ids 0 and `out[:total]` is written whole, so such a reader finds only valid ids.
    `step_check` (`AttentionBackend.take_step_check`): the step's pending step check, run in the same launch
    on the Triton path when it covers these requests (`kv_indices_triton.launch_checked_indices`), else first.
    """
    if out is None:
        out = torch.empty(total, dtype=torch.int32, device=req_to_token.device)
    elif out.dtype != torch.int32 or out.shape[0] < total:
        raise InvalidArgumentError("out", f"an int32 tensor of at least {total} entries", (out.dtype, tuple(out.shape)))
    if (q_lens is None) != (qo_indptr_out is None):
        raise InvalidArgumentError("qo_indptr_out", "given exactly when q_lens is", qo_indptr_out is not None)
    if index_kernel_runs_on(req_to_token) and _triton_path() is not None:
        _triton_path()(
            req_to_token,
            req_pool_indices,
            kv_lens,
            out,
            kv_indptr=indptr_out,
            last_page_len=last_page_len_out,
            page_size=page_size,
            kv_start=kv_start,
            q_lens=q_lens,
            qo_indptr=qo_indptr_out,
            num_slots=num_slots,
            fault=fault,
            capacity=total,
            keep_layout=keep_layout,
            step_check=step_check,
        )
        return out if whole_out else out[:total]
    if step_check is not None:
        step_check.run()
    indptr = page_indptr_from_lens(kv_lens, page_size)
    out[:total] = kv_indices_from_req_to_token(req_to_token, req_pool_indices, indptr, total, kv_start, page_size)
    if indptr_out is not None:
        indptr_out.copy_(indptr)
    if last_page_len_out is not None:
        last_page_len_out.copy_(last_page_len_from_lens(kv_lens, page_size))
    if q_lens is not None and qo_indptr_out is not None:  # given together (checked above)
        qo_indptr_out.copy_(kv_indptr_from_lens(q_lens))
    return out if whole_out else out[:total]
