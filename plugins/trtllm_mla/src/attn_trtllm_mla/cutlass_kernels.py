"""The one place `cutlass_mla` calls sgl-kernel: CUTLASS's MLA decode and its workspace size. Never ran on
hardware: no Blackwell GPU was available; the arguments are built and tested on the CPU (`cutlass_backend`,
the float64 stand-in)."""

from __future__ import annotations

import torch

#: KV splits per request: 1, as SGLang runs it (more splits are unsafe under CUDA graphs, sgl-kernel says)
NUM_KV_SPLITS = 1


def workspace_size(max_seq_len: int, batch_size: int) -> int:
    """Bytes of workspace one decode call over `batch_size` requests and a table of `max_seq_len` tokens needs."""
    from sgl_kernel import cutlass_mla_get_workspace_size

    return cutlass_mla_get_workspace_size(max_seq_len, batch_size, num_kv_splits=NUM_KV_SPLITS)


def decode(q_nope, q_pe, cache, seq_lens, page_table, workspace, sm_scale: float) -> torch.Tensor:
    """`sgl_kernel.cutlass_mla_decode`: `[B, H, 512]` from q_nope `[B, H, 512]`, q_pe `[B, H, 64]`, the latent
    cache `[pages, 128, 576]`, int32 key counts `[B]` and page table `[B, block_num]`."""
    from sgl_kernel import cutlass_mla_decode

    return cutlass_mla_decode(
        q_nope=q_nope,
        q_pe=q_pe,
        kv_c_and_k_pe_cache=cache,
        seq_lens=seq_lens,
        page_table=page_table,
        workspace=workspace,
        sm_scale=sm_scale,
        num_kv_splits=NUM_KV_SPLITS,
    )
