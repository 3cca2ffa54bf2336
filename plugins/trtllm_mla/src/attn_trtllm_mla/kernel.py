"""The one place this plugin calls TensorRT-LLM's kernels (through FlashInfer 0.6.6): MLA decode
(`decode`) and DeepSeek's ragged prefill (`ragged_prefill`). Unverified on hardware: no Blackwell GPU
was available to this project; everything that builds these calls' arguments is tested on CPU
(`args.py`, `ragged.py`; the block tables are attn-core's).

`kernel_for(capability, dtype)` says which FlashInfer path serves a device: "trtllm-gen" on compute
capability 10.x; on 12.x FlashInfer 0.6.6 routes MLA decode to XQA, which takes fp8 queries and KV
only, so bf16 steps there go to the fallback backend (None).
"""

from __future__ import annotations

from typing import Optional

import torch

#: bytes of the kernels' workspace (multi-block semaphores and scratch); zeroed once, before first use
WORKSPACE_BYTES = 128 << 20


def kernel_for(capability: tuple[int, int], dtype: torch.dtype) -> Optional[str]:
    """The FlashInfer backend name of TRT-LLM's MLA decode for this device and dtype, or None when it
    has none (then the fallback's FlashInfer MLA kernels serve). Examples: ((10, 0), bf16) -> "trtllm-gen";
    ((12, 0), bf16) -> None; ((9, 0), bf16) -> None."""
    if capability[0] == 10 and dtype == torch.bfloat16:
        return "trtllm-gen"
    return None


def new_workspace(device: torch.device) -> torch.Tensor:
    """The kernels' workspace: zero-initialised, as FlashInfer requires before its first use."""
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def decode(kwargs: dict, kernel: str) -> torch.Tensor:
    """Run TRT-LLM's MLA decode with `args.decode_kwargs(...)`: output bf16 `[bs, H, kv_lora_rank]` (q_len
    1) or `[bs, q_len, H, kv_lora_rank]`."""
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla

    return trtllm_batch_decode_with_kv_cache_mla(**kwargs, backend=kernel)


def ragged_prefill(kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Run TRT-LLM's ragged prefill with `ragged.ragged_kwargs(...)`: output `[Tq, H, Dv]` in q's dtype and
    the base-2 LSE float32 `[Tq, H]` (`ragged.natural_lse` converts it)."""
    from flashinfer.prefill import trtllm_ragged_attention_deepseek

    return trtllm_ragged_attention_deepseek(**kwargs)
