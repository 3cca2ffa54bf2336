"""One step's key sets in the form FlashInfer's paged wrappers take (plain torch; runs on CPU too).

FlashInfer reads a request's keys from a CSR list of pages: `indptr` (host, int32 `[bs+1]`, page
offsets), `indices` (device, int32 page ids), `last_page_len` (host, int32 `[bs]`, tokens in the last
page; 0 for a request with no keys). Our pool's slot = page * page_size + offset, so a request whose
first key sits at offset 0 of a page (every request, when no encoder tokens come first) is described
at page granularity; otherwise at token granularity (page_size 1, the pool viewed as one-token pages).

Worked example (page_size 4): two requests in rows 3 and 0 with 5 and 2 keys,
req_to_token[3, :5] = [20, 21, 22, 23, 8], req_to_token[0, :2] = [12, 13]:
    pages         = [2, 1]
    indptr        = [0, 2, 3]
    indices       = [5, 2, 3]      (slot // 4 of keys 0 and 4 of row 3, key 0 of row 0)
    last_page_len = [1, 2]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from attn_core.ops.kv_indices import build_kv_indices, host_last_page_lens, host_page_offsets
from attn_core.ops.step_checks import PendingStepCheck

#: (batch size, page count) -> device int32 buffers for (page ids, indptr or None, last_page_len or None)
DeviceOut = Callable[[int, int], tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]]


@dataclass
class PagedKV:
    """Keys of each request of a step, paged. Host tensors feed FlashInfer's plan (no device sync);
    `indices` lives on the device (possibly a prefix of a CUDA-graph buffer). With device buffers for
    them, `indptr_dev` / `last_page_len_dev` hold the same numbers as the host ones, written by the same
    kernel launch as the page ids (re-planned and CUDA-graph wrappers read them when the layers run)."""

    page_size: int
    kv_lens: torch.Tensor  # host int32 [bs] keys per request
    indptr: torch.Tensor  # host int32 [bs+1] page offsets
    last_page_len: torch.Tensor  # host int32 [bs]
    max_len: int  # max(kv_lens), 0 for an empty batch
    num_pages: int  # indptr[-1]
    indices: Optional[torch.Tensor] = None  # device int32 [num_pages] page ids
    indptr_dev: Optional[torch.Tensor] = None
    last_page_len_dev: Optional[torch.Tensor] = None
    launch: Optional[Callable[..., None]] = None  # the device writes, while deferred

    def write_device(
        self,
        q_lens: Optional[torch.Tensor] = None,
        qo_indptr_out: Optional[torch.Tensor] = None,
        step_check: Optional[PendingStepCheck] = None,
    ) -> bool:
        """Launch the deferred device writes; with `q_lens` (device) the same launch also writes the step's
        query offsets into `qo_indptr_out`, with `step_check` (`AttentionBackend.take_step_check`) it runs the
        step check too. Returns whether it launched (False once done: `step_check` is then not run)."""
        if self.launch is None:
            return False
        self.launch(q_lens, qo_indptr_out, step_check)
        self.launch = None
        return True


def paged_kv_host(kv_lens_host: torch.Tensor, page_size: int) -> PagedKV:
    """Host side of a `PagedKV` (no device arrays yet): kv_lens int32, indptr int32 `[bs+1]`,
    last_page_len int32 `[bs]`, the longest request and the page count: attn-core's host page arithmetic
    (`host_page_offsets`, `host_last_page_lens`), a handful of numpy ops, since this runs on the host every
    step before FlashInfer's plan, where each torch op would cost several times more."""
    lens_t = kv_lens_host if kv_lens_host.dtype == torch.int32 else kv_lens_host.to(torch.int32)
    lens = lens_t.numpy()
    bs = lens.shape[0]
    packed = np.empty(2 * bs + 1, dtype=np.int32)  # one allocation for both arrays
    indptr, last = packed[: bs + 1], packed[bs + 1 :]
    total = host_page_offsets(lens, page_size, indptr)
    host_last_page_lens(lens, page_size, last)
    max_len = int(lens.max()) if bs else 0
    return PagedKV(page_size, lens_t, torch.from_numpy(indptr), torch.from_numpy(last), max_len, total)


@dataclass
class PageList:
    """A step's keys as FlashInfer's MLA wrapper reads them: per request its key count and a CSR list
    of page ids (no last-page lengths: the MLA scheduler takes the key counts)."""

    page_size: int
    kv_lens: torch.Tensor  # host int32 [bs] keys per request
    indptr: torch.Tensor  # host int32 [bs+1] page offsets
    num_pages: int  # indptr[-1]
    indices: torch.Tensor  # device int32 [>= num_pages]: the page ids, then what the buffer held (readers go by indptr)


def build_page_list(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_lens_host: torch.Tensor,
    page_size: int,
    out: Callable[[int], torch.Tensor],
    host_indptr: Optional[tuple[np.ndarray, torch.Tensor]] = None,
    num_slots: Optional[int] = None,
    fault: Optional[torch.Tensor] = None,
    launch: Optional[Callable[..., None]] = None,
) -> PageList:
    """Keys `req_to_token[row, : kv_len]` of each request as a `PageList`: host offsets (numpy), page
    ids by one index launch (`attn_core.ops.kv_indices.build_kv_indices`) into `out(num_pages)` (a device
    int32 buffer of at least that many entries: a reused scratch buffer, a CUDA-graph buffer), which is
    the list's `indices` as it is (no view of its first `num_pages` entries). `launch`: a launch that
    writes the ids and more in one go, called as `launch(req_to_token, req_pool_indices, kv_lens, ids,
    num_pages, num_slots, fault)` in place of the index launch (`mla_works.WorkLaunch`: the ids and
    FlashInfer's MLA work list).

    kv_lens: device int32 `[bs]`, the same numbers as `kv_lens_host` (nothing is copied back).
    host_indptr: where the offsets go, a numpy int32 `[bs+1]` array and the torch tensor sharing its
    memory (`HostOffsets`, reused step after step: the list's `indptr` then holds until the next build
    into it); None: a new pair. `num_slots` / `fault`: the KV pool's slot count every slot is checked
    against and the fault buffer that records refused indices (`build_kv_indices`).
    Example (page_size 4): rows [3, 0], kv_lens [5, 2], req_to_token[3, :5] = [20, 21, 22, 23, 8],
    req_to_token[0, :2] = [12, 13] -> indptr [0, 2, 3], indices [5, 2, 3]."""
    lens_t = kv_lens_host if kv_lens_host.dtype == torch.int32 else kv_lens_host.to(torch.int32)
    if host_indptr is None:
        indptr = np.empty(lens_t.shape[0] + 1, dtype=np.int32)
        indptr_t = torch.from_numpy(indptr)
    else:
        indptr, indptr_t = host_indptr
    total = host_page_offsets(lens_t.numpy(), page_size, indptr)
    if launch is not None:
        ids = out(total)
        launch(req_to_token, req_pool_indices, kv_lens, ids, total, num_slots, fault)
    else:
        ids = build_kv_indices(
            req_to_token,
            req_pool_indices,
            kv_lens,
            total,
            page_size=page_size,
            out=out(total),
            num_slots=num_slots,
            fault=fault,
            whole_out=True,
            keep_layout=True,
        )
    return PageList(page_size, lens_t, indptr_t, total, ids)


class HostOffsets:
    """Reused host int32 offset arrays `[bs+1]` by batch size, each a numpy array and the torch tensor
    sharing its memory (making the pair costs microseconds of host time per step; FlashInfer's plans
    read host offsets during the call, or copy them, so a step may overwrite the last one's).

    Example: `h = HostOffsets(); a = h.get(3)` gives a pair of 4 entries; `h.get(3)` that same pair again."""

    def __init__(self) -> None:
        self._pairs: dict[int, tuple[np.ndarray, torch.Tensor]] = {}

    def get(self, bs: int) -> tuple[np.ndarray, torch.Tensor]:
        pair = self._pairs.get(bs)
        if pair is None:
            arr = np.zeros(bs + 1, dtype=np.int32)
            pair = self._pairs[bs] = (arr, torch.from_numpy(arr))
        return pair


def build_paged_kv(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_lens_host: torch.Tensor,
    page_size: int,
    kv_start: Optional[torch.Tensor] = None,
    out: Optional[DeviceOut] = None,
    defer: bool = False,
    num_slots: Optional[int] = None,
    fault: Optional[torch.Tensor] = None,
) -> PagedKV:
    """Keys `req_to_token[row, start : start + kv_len]` of each request as a `PagedKV`.

    kv_lens: device int32 `[bs]` (the same numbers as `kv_lens_host`, which the host already has, so
    nothing is copied back); kv_start: device per-request first column (must be a multiple of
    page_size; None: 0); out: the device buffers to write (a reused scratch buffer, CUDA-graph buffers);
    None: a new page-id tensor and no device indptr / last_page_len. `defer`: leave the device writes
    to `write_device()` (an eager step launches them after its plans, which may add the step's query
    offsets to the launch). `num_slots` / `fault`: the KV pool's slot count every slot is checked
    against and the fault buffer that records refused indices (`attn_core.ops.kv_indices.build_kv_indices`).
    """
    kv = paged_kv_host(kv_lens_host, page_size)
    total = kv.num_pages
    if out is None:
        ids = torch.empty(total, dtype=torch.int32, device=req_to_token.device)
    else:
        ids, kv.indptr_dev, kv.last_page_len_dev = out(kv.kv_lens.shape[0], total)
    kv.indices = ids[:total]

    def launch(
        q_lens: Optional[torch.Tensor],
        qo_indptr_out: Optional[torch.Tensor],
        step_check: Optional[PendingStepCheck] = None,
    ) -> None:
        build_kv_indices(
            req_to_token,
            req_pool_indices,
            kv_lens,
            total,
            page_size=page_size,
            kv_start=kv_start,
            out=ids,
            indptr_out=kv.indptr_dev,
            last_page_len_out=kv.last_page_len_dev,
            q_lens=q_lens,
            qo_indptr_out=qo_indptr_out,
            num_slots=num_slots,
            fault=fault,
            keep_layout=True,
            step_check=step_check,
        )

    kv.launch = launch
    if not defer:
        kv.write_device()
    return kv


@dataclass
class QueryLayout:
    """Where each request's queries (and, for the ragged pass, its new keys) sit in the step's tokens.
    `indptr_dev`: the offsets on the device for eager wrappers (None for graph wrappers, which copy
    them into their own buffers); while `pending`, the step still has to write it (see `query_layout`)."""

    indptr: torch.Tensor  # host int32 [bs+1]
    lens: torch.Tensor  # host int32 [bs]
    max_len: int
    num_tokens: int  # indptr[-1]
    indptr_dev: Optional[torch.Tensor] = None
    lens_dev: Optional[torch.Tensor] = None  # device int32 [bs], the source of a pending indptr_dev
    pending: bool = False

    def write_device(self) -> None:
        """Write a still-pending `indptr_dev` by a copy (when no index launch of the step took it)."""
        if self.pending:
            self.indptr_dev.copy_(self.indptr, non_blocking=True)
            self.pending = False


def query_layout(
    q_lens_host: torch.Tensor, out: Optional[torch.Tensor] = None, q_lens: Optional[torch.Tensor] = None
) -> QueryLayout:
    """The `QueryLayout` of `q_lens_host` queries per request. `out` (device int32 `[bs+1]`): where the
    offsets go on the device, left pending: an index launch of the step writes them from `q_lens` (the
    same lengths on the device), or `write_device` copies them."""
    lens_t = q_lens_host if q_lens_host.dtype == torch.int32 else q_lens_host.to(torch.int32)
    lens = lens_t.numpy()
    indptr = np.zeros(lens.shape[0] + 1, dtype=np.int32)
    lens.cumsum(out=indptr[1:])
    max_len = int(lens.max()) if lens.shape[0] else 0
    return QueryLayout(torch.from_numpy(indptr), lens_t, max_len, int(indptr[-1]), out, q_lens, out is not None)


def any_positive(lens_host: torch.Tensor) -> bool:
    """Whether some request has a nonzero length (host tensor; e.g. a cached prefix in the batch)."""
    return bool(lens_host.numpy().any())


def self_attention_page_size(page_size: int, has_encoder_tokens: bool) -> int:
    """Granularity of decoder self-attention keys: encoder tokens first in a request's row push its
    decoder tokens off page boundaries, so encoder-decoder models index them per token."""
    return 1 if has_encoder_tokens else page_size
