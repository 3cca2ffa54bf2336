"""What FlashInfer's wrappers need to read an fp8 (float8_e4m3fn) KV cache; pure helpers, importable
without flashinfer (tested on the CPU).

FlashInfer 0.6's paged decode / prefill `run` take `k_scale` / `v_scale` floats (k_scale joins the
softmax scale, v_scale multiplies the output); its ragged prefill on the FA2 path takes none, so the
ragged pass runs in the query dtype over the new tokens as the cache holds them.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn_core.memory.fp8 import as_cached, is_fp8
from attn_flashinfer.steps import Dims


def ragged_kv_dtype(dims: Dims) -> torch.dtype:
    """The kv_data_type the ragged wrapper is planned with: the query dtype over an fp8 cache (it gets
    dequantized new tokens), else the cache's. Dims(32, 8, 128, bf16, float8_e4m3fn) → bf16."""
    return dims.q_dtype if is_fp8(dims.kv_dtype) else dims.kv_dtype


def ragged_inputs(
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    kv_dtype: torch.dtype,
    scales: tuple[float, float],
    q_dtype: torch.dtype,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The new tokens' k/v `[T, Hkv, D]` for the ragged pass: over an fp8 cache, as the cache holds them
    (e4m3(x / s) · s, in `q_dtype`), so every key a query sees has the cache's precision; otherwise
    unchanged. With scales (0.5, 0.5), k = [0.3] over float8_e4m3fn gives [0.3125]."""
    if k is None or not is_fp8(kv_dtype):
        return k, v
    return as_cached(k, kv_dtype, scales[0], q_dtype), as_cached(v, kv_dtype, scales[1], q_dtype)


def cache_run_kwargs(scales: tuple[float, float]) -> dict:
    """Keyword arguments of a paged wrapper's `run` for a cache with (k, v) dequantization `scales`:
    {} for (1.0, 1.0) (FlashInfer's default), else {"k_scale": k, "v_scale": v}."""
    k, v = scales
    return {} if (k, v) == (1.0, 1.0) else {"k_scale": float(k), "v_scale": float(v)}


__all__ = ["cache_run_kwargs", "ragged_inputs", "ragged_kv_dtype"]
