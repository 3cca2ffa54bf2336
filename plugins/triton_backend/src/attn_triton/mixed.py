"""MIXED steps split by request kind: decodes through the decode kernel, the rest through the extend kernel.

On by default (`TritonAttnBackend(ctx, mixed_split=False)` turns it off): on an H100 the split step took
1/3.7 of the unsplit time at 64 decodes × 4096 + one 512-token chunk and 1/1.24 at 4 × 4096 + 2 × 2048
(docs/dev/perf-notebook.md "MIXED steps"). Unsplit, a MIXED step runs every request through the extend kernel,
whose programs take one q head and a block of query rows each: a one-token decode fills one row of a
`block_m`-row tile and its K/V is read once per q head. Split, the decodes go to the split-KV decode
kernel (one program per KV head reads each K/V tile once for the whole GQA group, and long contexts are
spread over KV splits) and the other requests to the extend kernel: two launches per layer.

Request order: any. The step's requests are put decode-first with attn-core's
`attn_core.batching.batch_utils.decode_first_split` (fewest swaps), and the key indices are built in that order
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
checks and fault flags. `plan_mixed` builds the step's plan (a `plans.StepPlan` whose only path is a
`MixedPath`: the step serves neither cross-attention nor chunked local layers) from the planner's public
methods; `MixedPath.run` is the per-layer work.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn_core.batching.batch_utils import RowOrder, decode_first_split
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.layer import AttentionLayer
from attn_triton.launchers import Launch, launch_decode, launch_extend
from attn_triton.metadata import KVIndex, fill_kv, new_kv
from attn_triton.planner import StepPlanner
from attn_triton.plans import DecodeKeys, StepPlan


class MixedPath:
    """A MIXED step in decode-first order: requests [0, num_decodes) are decodes (q rows [0, num_decodes)),
    the others run through the extend kernel.

    decode_kv: CSR keys of the decodes (indptr `[num_decodes + 1]`); split: the decode kernel's splits and
    scratch (`[num_decodes, Hq, max_splits, Dv]` / `[num_decodes, Hq, max_splits]`). prefill_qo_indptr
    `[P + 1]` int32 and prefill_kv (indptr `[P + 1]`) address the decode-first q rows and key indices
    absolutely (they start at num_decodes and at the decodes' key count); prefill_max_q_len (host int, 0
    when P = 0) sizes the extend grid. rows: the decode-first order on the device
    (`attn_core.batching.batch_utils.RowOrder`; no copy when the batch is already decode-first)."""

    path = "extend+decode (mixed split)"

    def __init__(
        self,
        ln: Launch,
        num_decodes: int,
        decode_kv: KVIndex,
        split: DecodeKeys,
        prefill_qo_indptr: torch.Tensor,
        prefill_kv: KVIndex,
        prefill_max_q_len: int,
        rows: RowOrder,
    ):
        self.ln, self.num_decodes, self.decode_kv, self.split = ln, num_decodes, decode_kv, split
        self.prefill_qo_indptr, self.prefill_kv, self.prefill_max_q_len = (
            prefill_qo_indptr,
            prefill_kv,
            prefill_max_q_len,
        )
        self.rows = rows

    def run(self, q, k_buf, v_buf, layer: AttentionLayer, sinks: Optional[torch.Tensor], return_lse: bool):
        """One layer: q `[T, Hq, D]` in the batch's order → `[T, Hq*Dv]` (and LSE `[T, Hq]` float32 with
        return_lse), the same meaning as the unsplit path."""
        qs = self.rows.tokens(q)
        if qs.stride(-1) != 1:
            qs = qs.contiguous()
        # the extend part (a no-op launch when every request is a decode) allocates the decode-first output
        o, lse = launch_extend(
            self.ln,
            qs,
            k_buf,
            v_buf,
            layer,
            self.prefill_qo_indptr,
            self.prefill_kv,
            self.prefill_max_q_len,
            causal=layer.attn_type != "encoder_only",
            custom_mask=None,
            mask_indptr=None,
            sinks=sinks,
            want_lse=return_lse,
        )
        nd, s = self.num_decodes, self.split
        lse_d = None if lse is None else lse[:nd]
        launch_decode(
            self.ln, qs[:nd], k_buf, v_buf, o[:nd], lse_d, layer, self.decode_kv, s.splits, s.part_o, s.part_lse, sinks
        )
        o = self.rows.scatter_tokens(o)
        lse = None if lse is None else self.rows.scatter_tokens(lse)
        o = o.view(q.shape[0], layer.num_q_heads * layer.v_head_dim)
        return (o, lse) if return_lse else o


def plan_mixed(planner: StepPlanner, b: ForwardBatch, r2t: torch.Tensor, has_window_pool: bool) -> Optional[StepPlan]:
    """The split plan of MIXED batch `b`, or None where the step keeps the unsplit path (see the module
    docstring). One host→device copy (only for a batch not decode-first) and one index launch."""
    if (
        b.encoder_lens is not None
        or b.cascade_prefix_len
        or planner.ctx.attention_chunk_size is not None
        or has_window_pool
    ):
        return None
    split = decode_first_split(b)
    nd = split.num_decodes
    if nd == 0:
        return None
    dev, bs = planner.ctx.device, b.batch_size
    rows = split.to_device(dev)
    req, seq, q_lens = rows.requests(b.req_pool_indices), rows.requests(b.seq_lens), rows.requests(b.extend_seq_lens)
    kv = new_kv(bs, b.seq_lens_sum, dev)
    qo_indptr = torch.empty(bs + 1, dtype=torch.int32, device=dev)
    fill_kv(kv, r2t, req, seq, planner.launch.fault, q_lens=q_lens, qo_indptr=qo_indptr)
    path = MixedPath(
        planner.launch,
        num_decodes=nd,
        decode_kv=KVIndex(kv.indptr[: nd + 1], kv.indices),
        split=planner.decode_keys(nd),
        prefill_qo_indptr=qo_indptr[nd:],
        prefill_kv=KVIndex(kv.indptr[nd:], kv.indices),
        prefill_max_q_len=max(split.query_lens[nd:], default=0),
        rows=rows,
    )
    return StepPlan(False, kv, path)
