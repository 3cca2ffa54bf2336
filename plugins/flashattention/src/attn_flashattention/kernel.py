"""The one call into FlashAttention-4: `attend` hands a `KeyList` and a layer's settings to FA4's
`flash_attn_varlen_func` (or, in the CPU tests, to `attn_flashattention.testing.emulated_fa4`, a float64
stand-in with the same documented semantics).

The arguments it passes, and what FA4 4.0.0b36 does with them on its SM90 path (README.md, "What FA4
takes"): q `[T, Hq, D]`; K and V as one layer's pool buffer `[slots, Hkv, D]` viewed as pages
`[slots / page_size, page_size, Hkv, D]` (no copy); `page_table`, `seqused_k`, `cu_seqlens_q`,
`max_seqlen_q` from the `KeyList`; `softmax_scale` = the layer's scaling; `causal`; `window_size`
(W - 1, 0) for a window of W keys; `softcap` = the logit cap (0: off; applied to the scaled score);
`learnable_sink` = the per-head sink logits `[Hq]`; `return_lse`. It returns the output `[T, Hq, D]` and,
with `return_lse`, the natural-log LSE head-major `[Hq, T]` float32, which `attend` returns token-major.
"""

from __future__ import annotations

import importlib
from typing import Callable, Optional

import torch

from attn_core.contract.errors import BackendUnavailableError
from attn_flashattention.keys import KeyList

#: FA4's module and varlen entry point
MODULE, FUNCTION = "flash_attn.cute", "flash_attn_varlen_func"

Fa4Function = Callable[..., tuple[torch.Tensor, Optional[torch.Tensor]]]


def load_fa4(backend: str) -> Fa4Function:
    """FA4's `flash_attn_varlen_func`; any import failure becomes the registry's typed "unavailable" error."""
    try:
        return getattr(importlib.import_module(MODULE), FUNCTION)
    except Exception as exc:  # a broken CUTLASS DSL install must read as "cannot run here", typed
        raise BackendUnavailableError(
            backend, f"{MODULE}.{FUNCTION} failed to load ({type(exc).__name__}: {exc})"
        ) from exc


def attend(
    fa4: Fa4Function,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    keys: KeyList,
    *,
    scale: float,
    window: Optional[int] = None,
    logit_cap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    return_lse: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Attention of q `[T, Hq, D]` over `keys` in one layer's K/V buffers `[slots, Hkv, D]` (read in place).
    `window` W (None: none) keeps keys p - W + 1 .. p of a query at p (causal lists only); `logit_cap` c > 0
    maps a scaled score s to c * tanh(s / c); `sinks` float32 `[Hq]`. Returns the output `[T, Hq, D]` in
    q's dtype and, with `return_lse`, the natural-log LSE `[T, Hq]` float32 (else None)."""
    ps = keys.page_size
    k_pages = k_cache.view(-1, ps, *k_cache.shape[1:])
    v_pages = v_cache.view(-1, ps, *v_cache.shape[1:])
    out, lse = fa4(
        q,
        k_pages,
        v_pages,
        cu_seqlens_q=keys.cu_seqlens_q,
        max_seqlen_q=keys.max_seqlen_q,
        seqused_k=keys.seqused_k,
        page_table=keys.page_table,
        softmax_scale=scale,
        causal=keys.causal,
        window_size=(window - 1, 0) if window is not None else (None, None),
        learnable_sink=sinks,
        softcap=logit_cap,
        return_lse=return_lse,
    )
    return out, (lse.t().contiguous() if return_lse else None)
