"""The torch_npu operators attn-ascend calls, behind one small adapter (`NpuOps`).

It imports `torch_npu` (the real one, or in tests the emulation installed in `sys.modules`), reads the
installed fused-infer operator's argument names once, and passes keywords the way that release names
them: `scale_value` in Ascend Extension for PyTorch 6.0.0 (ptaoplist_000837), `scale` from 7.0.0
(ptaoplist_001232), which also added `query_rope` / `key_rope`. Signatures and semantics of every
operator: `attn_ascend.testing.emulated_ops`.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

import torch

from attn_core.contract.errors import BackendUnavailableError

FIA = "npu_fused_infer_attention_score"


def argument_names(module: ModuleType, op_name: str) -> frozenset[str]:
    """Argument names of an installed operator: from its registered schema (`torch.ops.npu.<op>`), else
    from the Python signature of `module.<op>`; empty when neither can be read."""
    try:
        packet = getattr(torch.ops.npu, op_name)
        return frozenset(a.name for a in packet.default._schema.arguments)
    except (AttributeError, RuntimeError):
        pass
    try:
        return frozenset(inspect.signature(getattr(module, op_name)).parameters)
    except (AttributeError, TypeError, ValueError):
        return frozenset()


@dataclass(frozen=True)
class FiaKeywords:
    """How the installed fused-infer operator names its arguments.

    Example: names {"query", ..., "scale_value"} -> FiaKeywords(scale="scale_value", rope=False);
    names {"query", ..., "scale", "query_rope", "key_rope"} -> FiaKeywords(scale="scale", rope=True).
    Unreadable names (empty) -> the newest documented form, FiaKeywords("scale", True)."""

    scale: str
    rope: bool

    @classmethod
    def from_names(cls, names: frozenset[str]) -> FiaKeywords:
        if not names:
            return cls("scale", True)
        return cls("scale_value" if "scale_value" in names else "scale", "query_rope" in names)


def load_torch_npu(backend: str) -> ModuleType:
    """`import torch_npu`, turning any failure into the registry's typed "unavailable" error."""
    try:
        return importlib.import_module("torch_npu")
    except Exception as exc:
        raise BackendUnavailableError(backend, f"torch_npu failed to import ({type(exc).__name__}: {exc})") from exc


class NpuOps:
    """Calls into torch_npu with the keyword names of the installed release."""

    def __init__(self, module: ModuleType):
        self.npu = module
        self.fia = FiaKeywords.from_names(argument_names(module, FIA))

    def reshape_and_cache(self, key, value, key_cache, value_cache, slots: torch.Tensor) -> None:
        """key/value `[T, H, D]` into the paged caches `[blocks, block_size, H, D]` at int32 `slots`."""
        self.npu._npu_reshape_and_cache(
            key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_indices=slots
        )

    def paged_attention(
        self, query, key_cache, value_cache, *, num_heads, num_kv_heads, scale, block_table, context_lens, out
    ) -> None:
        """Decode: `out[i]` = attention of query i over its first context_lens[i] paged keys."""
        self.npu._npu_paged_attention(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            num_kv_heads=num_kv_heads,
            num_heads=num_heads,
            scale_value=scale,
            block_table=block_table,
            context_lens=context_lens,
            out=out,
        )

    def paged_attention_mla(self, query, cache, *, num_heads, scale, block_table, context_lens, v_dim, out) -> None:
        """MLA decode over the combined latent cache `[blocks, block_size, 1, rank + rope]`."""
        self.npu._npu_paged_attention_mla(
            query=query,
            key_cache=cache,
            num_kv_heads=1,
            num_heads=num_heads,
            scale_value=scale,
            block_table=block_table,
            context_lens=context_lens,
            mla_vheadsize=v_dim,
            out=out,
        )

    def fused_infer(self, query, key, value, *, scale: float, out: Optional[torch.Tensor] = None, **kw) -> torch.Tensor:
        """The fused-infer operator; with `out`, its `.out` variant (workspace from the operator's
        max-workspace query) writing into `out`. Returns the attention output."""
        kw[self.fia.scale] = scale
        op = getattr(self.npu, FIA)
        if out is None:
            return op(query, key, value, **kw)[0]
        workspace = self.npu._npu_fused_infer_attention_score_get_max_workspace(query, key, value, **kw)
        lse = torch.empty(1, dtype=query.dtype, device=query.device)  # unused: softmax_lse_flag is off
        op.out(query, key, value, workspace=workspace, out=[out, lse], **kw)
        return out
