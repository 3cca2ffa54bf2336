"""Every call into FlashInfer's MLA paged wrapper (`flashinfer.mla.BatchMLAPagedAttentionWrapper`):
construction (eager or CUDA-graph mode), plan and run.

The wrapper attends queries split as q_nope `[T, H, kv_lora_rank]` + q_pe `[T, H, rope]` to a paged
latent split the same way (ckv `[pages, P, kv_lora_rank]`, kpe `[pages, P, rope]`); both splits are
views of attn-core's tensors (q `[T, H, kv_lora_rank + rope]`, the pool's `[slots, 1, kv_lora_rank +
rope]`), never copies. The softmax scale is fixed at plan time, so a wrapper serves one layer scaling.
FlashInfer picks its kernels by device (`backend="auto"`: FA3 on SM90, FA2 elsewhere).
"""

from __future__ import annotations

from typing import Optional

import torch
from flashinfer.mla import BatchMLAPagedAttentionWrapper

from attn_flashinfer import replan
from attn_flashinfer.indices import PagedKV, QueryLayout
from attn_flashinfer.mla_steps import MLADims, MLAGraphBuffers

KERNEL_BACKEND = "auto"


def new_wrapper(workspace: torch.Tensor, graph: Optional[MLAGraphBuffers] = None) -> BatchMLAPagedAttentionWrapper:
    if graph is None:
        return BatchMLAPagedAttentionWrapper(workspace, backend=KERNEL_BACKEND)
    return BatchMLAPagedAttentionWrapper(
        workspace,
        use_cuda_graph=True,
        qo_indptr=graph.qo_indptr,
        kv_indptr=graph.kv_indptr,
        kv_indices=graph.kv_indices,
        kv_len_arr=graph.kv_lens,
        backend=KERNEL_BACKEND,
    )


def plan(w: BatchMLAPagedAttentionWrapper, qo: QueryLayout, kv: PagedKV, causal: bool, dims: MLADims, scaling: float, lean: bool) -> None:
    """Plan queries `qo` over the keys of `kv` (causal: each request's queries are its last keys).
    `lean`: `replan.mla` (the wrapper has had its public plan with the same scaling and dtypes)."""
    if lean:
        replan.mla(w, qo, kv, causal, dims.num_heads, dims.kv_lora_rank)
        return
    w.plan(
        qo.indptr,
        kv.indptr,
        kv.indices,
        kv.kv_lens,
        dims.num_heads,
        dims.kv_lora_rank,
        dims.qk_rope_head_dim,
        kv.page_size,
        causal,
        scaling,
        dims.dtype,
        dims.dtype,
    )


def run(
    w: BatchMLAPagedAttentionWrapper, q: torch.Tensor, latent: torch.Tensor, page_size: int, kv_lora_rank: int, return_lse: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Absorbed MLA of q `[T, H, kv_lora_rank + rope]` over one layer's latent pool `[slots, 1,
    kv_lora_rank + rope]`: output `[T, H, kv_lora_rank]` and, with return_lse, the natural-log LSE
    `[T, H]` float32."""
    pages = latent.view(-1, page_size, latent.shape[-1])
    out = q.new_empty((q.shape[0], q.shape[1], kv_lora_rank))
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    w.run(
        q[..., :kv_lora_rank],
        q[..., kv_lora_rank:],
        pages[..., :kv_lora_rank],
        pages[..., kv_lora_rank:],
        out=out,
        lse=lse,
        return_lse=return_lse,
        return_lse_base_on_e=True,
    )
    return out, lse
