"""MIXED steps split by request kind: decodes through the decode kernel, the rest through the extend kernel.

On by default (`TritonAttnBackend(ctx, mixed_split=False)` turns it off): on an H100 the split step took
1/3.7 of the unsplit time at 64 decodes × 4096 + one 512-token chunk and 1/1.24 at 4 × 4096 + 2 × 2048
(docs/dev/perf-notebook.md "MIXED steps"). Unsplit, a MIXED step runs every request through the extend kernel,
whose programs take one q head and a block of query rows each: a one-token decode fills one row of a
`block_m`-row tile and its K/V is read once per q head. Split, the decodes go to the split-KV decode
kernel (one program per KV head reads each K/V tile once for the whole GQA group, and long contexts are
spread over KV splits) and the other requests to the extend kernel: two launches per layer.

Request order: any. The step's requests are put decode-first with attn-core's
`attn_core.batch_utils.decode_first_split` (fewest swaps), and the key indices are built in that order
in `init_forward_metadata`. When the batch is already decode-first (an engine can apply that
permutation itself), nothing is copied per layer: the decode kernel reads the first rows of q and writes
the first rows of the output, the extend kernel the rest. Otherwise each layer gathers q's rows into the
decode-first order (one `index_select`) and scatters the output rows back (one `index_copy_`).

A decode here is a request with exactly one new token; a request with none joins the extend part (the
decode kernel reads exactly one query per request). Steps the split does not serve keep the unsplit
path (`build_mixed_metadata` returns None): no decode in the step, encoder tokens (cross attention),
chunked local attention, a sliding-window KV pool, a cascade prefix.

Everything is sized from host data (`*_cpu`, `seq_lens_sum`); the index tensors are filled on the device
by the same launch as the unsplit path's (`fill_kv`, bounds-checked into the fault buffer), so neither
the metadata nor `forward` waits for the device. The kernels are the existing ones, with their bounds
checks and fault flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from attn_core.batch import ForwardBatch
from attn_core.batch_utils import RowOrder, decode_first_split
from attn_core.errors import InvalidArgumentError
from attn_core.layer import AttentionLayer
from attn_core.memory.window_pool import window_pool_of
from attn_triton.metadata import KVIndex, Splits, fill_kv, new_kv

if TYPE_CHECKING:
    from attn_triton.backend import TritonAttnBackend


@dataclass
class MixedMetadata:
    """A MIXED step in decode-first order: requests [0, num_decodes) are decodes (q rows [0, num_decodes)),
    the others run through the extend kernel.

    decode_kv: CSR keys of the decodes (indptr `[num_decodes + 1]`); splits, part_o
    `[num_decodes, Hq, max_splits, Dv]`, part_lse `[num_decodes, Hq, max_splits]`: the decode kernel's.
    prefill_qo_indptr `[P + 1]` int32 and prefill_kv (indptr `[P + 1]`) address the decode-first q rows and
    key indices absolutely (they start at num_decodes and at the decodes' key count); prefill_max_q_len
    (host int, 0 when P = 0) sizes the extend grid. rows: the decode-first order on the device
    (`attn_core.batch_utils.RowOrder`; no copy when the batch is already decode-first)."""

    num_decodes: int
    decode_kv: KVIndex
    splits: Splits
    part_o: torch.Tensor
    part_lse: torch.Tensor
    prefill_qo_indptr: torch.Tensor
    prefill_kv: KVIndex
    prefill_max_q_len: int
    rows: RowOrder


def build_mixed_metadata(backend: TritonAttnBackend, b: ForwardBatch, r2t: torch.Tensor) -> Optional[MixedMetadata]:
    """The split metadata of MIXED batch `b`, or None where the step keeps the unsplit path (see the module
    docstring). One host→device copy (only for a batch not decode-first) and one index launch."""
    if (
        b.encoder_lens is not None
        or b.cascade_prefix_len
        or backend.ctx.attention_chunk_size is not None
        or window_pool_of(backend.kv_pool(b)) is not None
    ):
        return None
    split = decode_first_split(b)
    nd = split.num_decodes
    if nd == 0:
        return None
    dev, bs = backend.device, b.batch_size
    rows = split.to_device(dev)
    req, seq, q_lens = rows.requests(b.req_pool_indices), rows.requests(b.seq_lens), rows.requests(b.extend_seq_lens)
    kv = new_kv(bs, b.seq_lens_sum, dev)
    qo_indptr = torch.empty(bs + 1, dtype=torch.int32, device=dev)
    fill_kv(kv, r2t, req, seq, backend.device_faults.buffer, q_lens=q_lens, qo_indptr=qo_indptr)
    splits = backend.decode_splits(nd)
    part_o, part_lse = backend._scratch.views(nd, splits.max_splits)
    return MixedMetadata(
        num_decodes=nd,
        decode_kv=KVIndex(kv.indptr[: nd + 1], kv.indices),
        splits=splits,
        part_o=part_o,
        part_lse=part_lse,
        prefill_qo_indptr=qo_indptr[nd:],
        prefill_kv=KVIndex(kv.indptr[nd:], kv.indices),
        prefill_max_q_len=max(split.query_lens[nd:], default=0),
        rows=rows,
    )


def forward_mixed(
    backend: TritonAttnBackend,
    meta: MixedMetadata,
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    layer: AttentionLayer,
    b: ForwardBatch,
    save_kv_cache: bool,
    sinks: Optional[torch.Tensor],
    return_lse: bool,
):
    """One layer of a split MIXED step: q `[T, Hq, D]` in the batch's order → `[T, Hq*Dv]` (and LSE
    `[T, Hq]` float32 with return_lse), the same meaning as the unsplit path. K/V of the new tokens are
    written in the batch's order (through `out_cache_loc`) before either kernel runs."""
    if layer.is_cross_attention:
        raise InvalidArgumentError("forward_batch.encoder_lens", "encoder lengths for a cross-attention layer", None)
    if layer.attention_chunk_size is not None:
        raise InvalidArgumentError(
            f"layer {layer.layer_id} attention_chunk_size", "the context's attention_chunk_size (None)", layer.attention_chunk_size
        )
    k_buf, v_buf = backend._save_and_buffers(q, k, v, layer, b, save_kv_cache, sinks)
    qs = meta.rows.tokens(q)
    if qs.stride(-1) != 1:
        qs = qs.contiguous()
    # the extend part (a no-op launch when every request is a decode) allocates the decode-first output
    o, lse = backend._extend(
        qs,
        k_buf,
        v_buf,
        layer,
        meta.prefill_qo_indptr,
        meta.prefill_kv,
        meta.prefill_max_q_len,
        causal=layer.attn_type != "encoder_only",
        custom_mask=None,
        mask_indptr=None,
        sinks=sinks,
        want_lse=return_lse,
    )
    nd = meta.num_decodes
    lse_d = None if lse is None else lse[:nd]
    backend._decode(qs[:nd], k_buf, v_buf, o[:nd], lse_d, layer, meta.decode_kv, meta.splits, meta.part_o, meta.part_lse, sinks)
    o = meta.rows.scatter_tokens(o)
    lse = None if lse is None else meta.rows.scatter_tokens(lse)
    o = o.view(q.shape[0], layer.num_q_heads * layer.v_head_dim)
    return (o, lse) if return_lse else o
