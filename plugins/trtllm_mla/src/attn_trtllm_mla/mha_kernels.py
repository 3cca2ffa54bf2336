"""The one place `trtllm_mha` calls FlashInfer: TensorRT-LLM's generated MHA decode and context kernels
(`backend="trtllm-gen"` on compute capability 10.x). Never ran on hardware: no Blackwell GPU was available;
the arguments are packed and tested on the CPU (`mha_args`, `mha_plans`, the float64 stand-in)."""

from __future__ import annotations

import torch

from attn_trtllm_mla.mha_args import WORKSPACE_BYTES


def new_workspace(device: torch.device) -> torch.Tensor:
    """The kernels' workspace: zero-initialized, as FlashInfer requires before its first use."""
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def decode(kwargs: dict) -> torch.Tensor:
    """`flashinfer.decode.trtllm_batch_decode_with_kv_cache(**mha_args.decode_kwargs(...))`: `[T, Hq, D]`."""
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache

    return trtllm_batch_decode_with_kv_cache(**kwargs)


def context(kwargs: dict) -> torch.Tensor:
    """`flashinfer.prefill.trtllm_batch_context_with_kv_cache(**mha_args.context_kwargs(...))`: `[T, Hq, D]`."""
    from flashinfer.prefill import trtllm_batch_context_with_kv_cache

    return trtllm_batch_context_with_kv_cache(**kwargs)
