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
    `indices` lives on the device (possibly a prefix of a CUDA-graph buffer)."""

    page_size: int
    kv_lens: torch.Tensor  # host int32 [bs] keys per request
    indptr: torch.Tensor  # host int32 [bs+1] page offsets
    last_page_len: torch.Tensor  # host int32 [bs]
    indices: torch.Tensor  # device int32 [indptr[-1]] page ids
    fill: Optional[Callable[[], None]] = None  # writes `indices` when their launch was deferred

    def write_indices(self) -> None:
        """Launch a deferred page-id build (no-op when already written)."""
        if self.fill is not None:
            self.fill()
            self.fill = None

    @property
    def num_pages(self) -> int:
        return int(self.indptr[-1])


def paged_kv_host(kv_lens_host: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host side of a `PagedKV`: (kv_lens int32, indptr int32 `[bs+1]`, last_page_len int32 `[bs]`).

    The numbers of attn_core's `page_indptr_from_lens` / `last_page_len_from_lens` (tests check they
    agree), computed with a handful of numpy ops: this runs on the host every step before FlashInfer's
    plan, where each torch op would cost several times more. last = min((len + P - 1) % P + 1, len)
    (0 for an empty request, else 1..P)."""
    lens_t = kv_lens_host if kv_lens_host.dtype == torch.int32 else kv_lens_host.to(torch.int32)
    lens = lens_t.numpy()
    indptr = np.empty(lens.shape[0] + 1, dtype=np.int32)
    indptr[0] = 0
    if page_size == 1:
        np.cumsum(lens, out=indptr[1:])
        return lens_t, torch.from_numpy(indptr), torch.from_numpy(np.minimum(lens, 1))
    up = lens + (page_size - 1)
    np.cumsum(up // page_size, out=indptr[1:])
    last = np.minimum(up % page_size + 1, lens)
    return lens_t, torch.from_numpy(indptr), torch.from_numpy(last)


def build_paged_kv(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_lens_host: torch.Tensor,
    page_size: int,
    kv_start: Optional[torch.Tensor] = None,
    out: Union[torch.Tensor, Callable[[int], torch.Tensor], None] = None,
    defer: bool = False,
) -> PagedKV:
    """Keys `req_to_token[row, start : start + kv_len]` of each request as a `PagedKV`.

    kv_lens: device int32 `[bs]` (the same numbers as `kv_lens_host`, which the host already has, so
    nothing is copied back); kv_start: device per-request first column (must be a multiple of
    page_size; None: 0); out: where the page ids go, an int32 device buffer (CUDA graphs) or a function
    giving one for a number of pages (a reused scratch buffer); None: a new tensor. `defer`: leave the
    page ids unwritten until `write_indices()` (an eager step launches them after FlashInfer's plans,
    whose copies of host tensors would otherwise wait for this kernel).
    """
    lens, indptr, last = paged_kv_host(kv_lens_host, page_size)
    total = int(indptr.numpy()[-1])
    if callable(out):
        out = out(total)
    if out is None:
        out = torch.empty(total, dtype=torch.int32, device=req_to_token.device)

    def fill() -> None:
        build_kv_indices(req_to_token, req_pool_indices, kv_lens, total, page_size=page_size, kv_start=kv_start, out=out)

    kv = PagedKV(page_size, lens, indptr, last, out[:total], fill)
    if not defer:
        kv.write_indices()
    return kv


def qo_indptr_host(q_lens_host: torch.Tensor) -> torch.Tensor:
    """Host int32 `[bs+1]` offsets of each request's queries (and, for the ragged pass, new keys)."""
    indptr = np.zeros(q_lens_host.shape[0] + 1, dtype=np.int32)
    np.cumsum(q_lens_host.numpy(), out=indptr[1:])
    return torch.from_numpy(indptr)


def any_positive(lens_host: torch.Tensor) -> bool:
    """Whether some request has a nonzero length (host tensor; e.g. a cached prefix in the batch)."""
    return bool(lens_host.numpy().any())


def self_attention_page_size(page_size: int, has_encoder_tokens: bool) -> int:
    """Granularity of decoder self-attention keys: encoder tokens first in a request's row push its
    decoder tokens off page boundaries, so encoder-decoder models index them per token."""
    return 1 if has_encoder_tokens else page_size
