"""Key lists of chunked local layers (`AttentionLayer.attention_chunk_size` C) in the form FlashInfer's
paged wrappers take (plain torch, no FlashInfer: runs on CPU).

A query at decoder position p of a chunked local layer sees keys (p // C) * C … p. DECODE needs no
virtual batch: each request's keys start at the chunk holding its position seq_len - 1
(`attn_core.batching.local_attention.local_decode_starts`), so the decode wrapper runs over that key list. Every
other mode splits the step into attn-core's virtual requests (`make_local_attention_virtual_batches`):
one per (request, chunk its new tokens touch), whose queries are its new tokens in that chunk and whose
keys are the chunk's keys up to its last new token; a causal paged prefill over them is the chunked rule.
Virtual requests keep the batch's query rows in order, so the output needs no reordering.

Granularity: per page when every key list starts on a page boundary (page_size 1, or C a multiple of the
page size and no encoder tokens before the decoder's), else per token (page_size 1, the pool viewed as
one-token pages: NHD only, see `local_page_size`).

Worked example (C = 4, page_size 2, decoder-only; request rows [1, 0], query lengths [3, 1], seq_lens
[6, 9]; req_to_token row 1 = slots 20, 21, …, row 0 = slots 40, 41, …):
    virtual requests: (request 0, keys 0..3, queries at 3), (request 0, keys 4..5, queries at 4, 5),
                      (request 1, keys 8..8, query at 8)
    queries: q_lens [1, 2, 1] -> qo indptr [0, 1, 3, 4]
    keys:    kv_lens [4, 2, 1], pages of 2 -> indptr [0, 2, 3, 4], last_page_len [2, 2, 1],
             page ids [10, 11, 12, 24]   (slots 20, 22, 24 of row 1, slot 48 of row 0, // 2)
In DECODE with the same seq_lens, keys start at [4, 8]: kv_lens [2, 1], page ids [12, 24].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attn_core.batching.local_attention import local_decode_starts, make_local_attention_virtual_batches
from attn_flashinfer.indices import DeviceOut, PagedKV, QueryLayout, build_paged_kv, query_layout


def local_page_size(attn_chunk_size: int, page_size: int, has_encoder_tokens: bool) -> int:
    """Granularity of chunked local key lists: `page_size` when every chunk start is a page start (C a
    multiple of the page size, no encoder tokens shifting the decoder's), else 1 (per token).

    Example: C 8, page_size 4 -> 4; C 6, page_size 4 -> 1; C 8, page_size 4 with encoder tokens -> 1."""
    if page_size == 1 or (attn_chunk_size % page_size == 0 and not has_encoder_tokens):
        return page_size
    return 1


@dataclass
class LocalKeys:
    """A step's chunked-local plan inputs: the (virtual) requests' queries and keys. DECODE keeps the
    step's own query layout (`qo` None)."""

    qo: Optional[QueryLayout]
    kv: PagedKV


def build_local_decode_kv(
    attn_chunk_size: int,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_host: torch.Tensor,
    page_size: int,
    encoder_lens: Optional[torch.Tensor] = None,
    out: Optional[DeviceOut] = None,
    num_slots: Optional[int] = None,
    fault: Optional[torch.Tensor] = None,
) -> PagedKV:
    """DECODE keys of a chunked local layer: request r's keys from `(seq_len - 1) // C * C` to its last,
    at `local_page_size` granularity (pass it as `page_size`), written now. seq_lens / encoder_lens:
    device int `[bs]`; seq_lens_host: the same on the host; out / num_slots / fault: as in
    `indices.build_paged_kv`."""
    starts_host = local_decode_starts(attn_chunk_size, seq_lens_host.to(torch.int64))
    lens_host = (seq_lens_host.to(torch.int64) - starts_host).to(torch.int32)
    starts = local_decode_starts(attn_chunk_size, seq_lens)
    lens = (seq_lens - starts).to(torch.int32)
    col = (starts if encoder_lens is None else starts + encoder_lens).to(torch.int32)
    return build_paged_kv(
        req_to_token,
        req_pool_indices,
        lens,
        lens_host,
        page_size,
        kv_start=col,
        out=out,
        defer=False,
        num_slots=num_slots,
        fault=fault,
    )


def build_local_extend(
    attn_chunk_size: int,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    q_lens_host: torch.Tensor,
    seq_lens_host: torch.Tensor,
    page_size: int,
    encoder_lens: Optional[torch.Tensor] = None,
    qo_out: Optional[torch.Tensor] = None,
    out: Optional[DeviceOut] = None,
    num_slots: Optional[int] = None,
    fault: Optional[torch.Tensor] = None,
) -> LocalKeys:
    """The virtual requests of an extend-like step (see the module docstring): their `QueryLayout` (with
    `qo_out`, a device int32 buffer of at least V + 1 entries, its offsets copied there now) and their keys
    at `local_page_size` granularity (pass it as `page_size`), written now. Host lengths `[bs]` in,
    one host-to-device copy of the virtual requests' rows, starts and lengths, one index launch."""
    vb = make_local_attention_virtual_batches(attn_chunk_size, q_lens_host.tolist(), seq_lens_host.tolist())
    n = vb.num_virtual
    host = torch.tensor([vb.req_indices, vb.kv_starts, vb.kv_lens], dtype=torch.int32).reshape(3, n)
    dev = host.to(req_to_token.device, non_blocking=True)
    req = dev[0].long()
    col = dev[1] if encoder_lens is None else dev[1] + encoder_lens[req].to(torch.int32)
    qo = query_layout(torch.tensor(vb.q_lens, dtype=torch.int32), None if qo_out is None else qo_out[: n + 1])
    qo.write_device()
    kv = build_paged_kv(
        req_to_token,
        req_pool_indices[req],
        dev[2],
        host[2],
        page_size,
        kv_start=col,
        out=out,
        defer=False,
        num_slots=num_slots,
        fault=fault,
    )
    return LocalKeys(qo, kv)
