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
from attn_flashinfer.indices import PageList, QueryLayout
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


def plan(
    w: BatchMLAPagedAttentionWrapper,
    qo: QueryLayout,
    kv: PageList,
    causal: bool,
    dims: MLADims,
    scaling: float,
    lean: bool,
) -> None:
    """Plan queries `qo` over the keys of `kv` (causal: each request's queries are its last keys).
    `lean`: `replan.mla` (the wrapper has had its public plan with the same scaling and dtypes)."""
    if lean:
        replan.mla(w, qo, kv, causal, dims.num_heads, dims.kv_lora_rank)
        return
    w.plan(  # by keyword: FlashInfer 0.7 deprecates positional MLA arguments (same names in 0.6.6)
        qo_indptr=qo.indptr,
        kv_indptr=kv.indptr,
        kv_indices=kv.indices,
        kv_len_arr=kv.kv_lens,
        num_heads=dims.num_heads,
        head_dim_ckv=dims.kv_lora_rank,
        head_dim_kpe=dims.qk_rope_head_dim,
        page_size=kv.page_size,
        causal=causal,
        sm_scale=scaling,
        q_data_type=dims.dtype,
        kv_data_type=dims.dtype,
    )


def latent_views(latent: torch.Tensor, page_size: int, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's latent pool `[slots, 1, kv_lora_rank + rope]` as FlashInfer's paged ckv `[pages,
    page_size, kv_lora_rank]` and kpe `[pages, page_size, rope]` (views, no copy)."""
    pages = latent.view(-1, page_size, latent.shape[-1])
    ckv, kpe = pages.split_with_sizes((kv_lora_rank, latent.shape[-1] - kv_lora_rank), 2)
    return ckv, kpe


def run(
    w: BatchMLAPagedAttentionWrapper,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    out: torch.Tensor,
    lse: Optional[torch.Tensor],
    lean: bool = False,
    works=None,
) -> None:
    """Absorbed MLA of q (q_nope `[T, H, kv_lora_rank]`, q_pe `[T, H, rope]`) over one layer's paged
    latent (`latent_views`) into `out` `[T, H, kv_lora_rank]` and, when `lse` is given, the natural-log
    LSE `[T, H]` float32. `lean`: `replan.mla_run` (the compiled kernel call alone; the caller has
    shaped `out` / `lse` as `run` would check them), over the step's device work list when `works` is
    given (`mla_works.StepWorks`; lean steps only)."""
    if lean:
        replan.mla_run(w, q_nope, q_pe, ckv, kpe, out, lse, works)
        return
    w.run(
        q_nope=q_nope,
        q_pe=q_pe,
        ckv_cache=ckv,
        kpe_cache=kpe,
        out=out,
        lse=lse,
        return_lse=lse is not None,
        return_lse_base_on_e=True,
    )
