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
from typing import Callable, Optional, Union

import numpy as np
import torch

from attn_core.ops.kv_indices import build_kv_indices


@dataclass
class PagedKV:
    """Keys of each request of a step, paged. Host tensors feed FlashInfer's plan (no device sync);
    `indices` lives on the device (possibly a prefix of a CUDA-graph buffer). `indptr` and
    `last_page_len` are views of `packed`, so an eager step copies both to the device at once
    (`indptr_dev`, `last_page_len_dev`: the wrappers read them when the layers run)."""

    page_size: int
    kv_lens: torch.Tensor  # host int32 [bs] keys per request
    packed: torch.Tensor  # host int32 [2*bs+1]: indptr, then last_page_len
    indptr: torch.Tensor  # host int32 [bs+1] page offsets
    last_page_len: torch.Tensor  # host int32 [bs]
    max_len: int  # max(kv_lens), 0 for an empty batch
    num_pages: int  # indptr[-1]
    indices: Optional[torch.Tensor] = None  # device int32 [num_pages] page ids
    indptr_dev: Optional[torch.Tensor] = None
    last_page_len_dev: Optional[torch.Tensor] = None
    fill: Optional[Callable[[], None]] = None  # writes `indices` when their launch was deferred

    def write_indices(self) -> None:
        """Launch a deferred page-id build (no-op when already written)."""
        if self.fill is not None:
            self.fill()
            self.fill = None


def paged_kv_host(kv_lens_host: torch.Tensor, page_size: int) -> PagedKV:
    """Host side of a `PagedKV` (no page ids yet): kv_lens int32, indptr int32 `[bs+1]` and
    last_page_len int32 `[bs]` (views of one buffer), the longest request and the page count.

    The numbers of attn_core's `page_indptr_from_lens` / `last_page_len_from_lens` (tests check they
    agree), computed with a handful of numpy ops: this runs on the host every step before FlashInfer's
    plan, where each torch op would cost several times more. last = min((len + P - 1) % P + 1, len)
    (0 for an empty request, else 1..P)."""
    lens_t = kv_lens_host if kv_lens_host.dtype == torch.int32 else kv_lens_host.to(torch.int32)
    lens = lens_t.numpy()
    bs = lens.shape[0]
    packed = np.empty(2 * bs + 1, dtype=np.int32)
    indptr, last = packed[: bs + 1], packed[bs + 1 :]
    indptr[0] = 0
    if page_size == 1:
        np.cumsum(lens, out=indptr[1:])
        np.minimum(lens, 1, out=last)
    else:
        up = lens + (page_size - 1)
        np.cumsum(up // page_size, out=indptr[1:])
        np.minimum(up % page_size + 1, lens, out=last)
    host = torch.from_numpy(packed)
    max_len = int(lens.max()) if bs else 0
    return PagedKV(page_size, lens_t, host, host[: bs + 1], host[bs + 1 :], max_len, int(indptr[-1]))


def build_paged_kv(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_lens_host: torch.Tensor,
    page_size: int,
    kv_start: Optional[torch.Tensor] = None,
    out: Union[torch.Tensor, Callable[[int], torch.Tensor], None] = None,
    defer: bool = False,
    to_device: bool = False,
) -> PagedKV:
    """Keys `req_to_token[row, start : start + kv_len]` of each request as a `PagedKV`.

    kv_lens: device int32 `[bs]` (the same numbers as `kv_lens_host`, which the host already has, so
    nothing is copied back); kv_start: device per-request first column (must be a multiple of
    page_size; None: 0); out: where the page ids go, an int32 device buffer (CUDA graphs) or a function
    giving one for a number of pages (a reused scratch buffer); None: a new tensor. `defer`: leave the
    page ids unwritten until `write_indices()` (an eager step launches them after FlashInfer's plans).
    `to_device`: also copy indptr and last_page_len to the device, in one copy.
    """
    kv = paged_kv_host(kv_lens_host, page_size)
    total = kv.num_pages
    if callable(out):
        out = out(total)
    if out is None:
        out = torch.empty(total, dtype=torch.int32, device=req_to_token.device)
    kv.indices = out[:total]
    if to_device:
        dev = kv.packed.to(req_to_token.device, non_blocking=True)
        n = kv.indptr.shape[0]
        kv.indptr_dev, kv.last_page_len_dev = dev[:n], dev[n:]

    def fill() -> None:
        build_kv_indices(req_to_token, req_pool_indices, kv_lens, total, page_size=page_size, kv_start=kv_start, out=out)

    kv.fill = fill
    if not defer:
        kv.write_indices()
    return kv


@dataclass
class QueryLayout:
    """Where each request's queries (and, for the ragged pass, its new keys) sit in the step's tokens."""

    indptr: torch.Tensor  # host int32 [bs+1]
    lens: torch.Tensor  # host int32 [bs]
    max_len: int
    indptr_dev: Optional[torch.Tensor]  # the same offsets on the device (eager wrappers read them at run time)

    @property
    def num_tokens(self) -> int:
        return int(self.indptr[-1])


def query_layout(q_lens_host: torch.Tensor, device: Optional[torch.device]) -> QueryLayout:
    """The `QueryLayout` of queries per request `q_lens_host` (host; one copy to `device`, if any)."""
    lens_t = q_lens_host if q_lens_host.dtype == torch.int32 else q_lens_host.to(torch.int32)
    lens = lens_t.numpy()
    indptr = np.zeros(lens.shape[0] + 1, dtype=np.int32)
    np.cumsum(lens, out=indptr[1:])
    host = torch.from_numpy(indptr)
    dev = None if device is None else host.to(device, non_blocking=True)
    return QueryLayout(host, lens_t, int(lens.max()) if lens.shape[0] else 0, dev)


def any_positive(lens_host: torch.Tensor) -> bool:
    """Whether some request has a nonzero length (host tensor; e.g. a cached prefix in the batch)."""
    return bool(lens_host.numpy().any())


def self_attention_page_size(page_size: int, has_encoder_tokens: bool) -> int:
    """Granularity of decoder self-attention keys: encoder tokens first in a request's row push its
    decoder tokens off page boundaries, so encoder-decoder models index them per token."""
    return 1 if has_encoder_tokens else page_size
