"""The one place attn-aiter calls AITER: four operators, each behind one method of `AiterOps`.

Semantics and the documents they come from: `attn_aiter.testing.emulated_ops`. Never ran on an AMD
GPU; on the CPU the tests install the emulation as the `aiter` package (`testing.emulated_aiter`).

- `paged_decode`: `aiter.paged_attention_ragged` (MHA/GQA DECODE over NHD pages, CSR page lists);
- `varlen_prefill`: `aiter.flash_attn_varlen_func` (MHA/GQA extend-like steps over gathered K/V, causal
  from the bottom right);
- `mla`: `aiter.mla.mla_decode_fwd` / `mla_prefill_fwd` (absorbed MLA over the
  latent pool viewed as pages of one token). `sm_scale` goes by keyword: the two documented forms of
  `mla_decode_fwd` place it differently.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from attn_core.contract.errors import BackendUnavailableError

#: tokens per partition of the paged decode kernel (its `partition_size`)
PARTITION_SIZE = 256
#: operators attn-aiter calls: (module, name)
OPERATORS = (
    ("aiter", "paged_attention_ragged"),
    ("aiter", "flash_attn_varlen_func"),
    ("aiter.mla", "mla_decode_fwd"),
    ("aiter.mla", "mla_prefill_fwd"),
)


def missing_operators() -> str:
    """ "" when `aiter` and `aiter.mla` import with every operator of `OPERATORS`, else what is wrong
    (e.g. "aiter has no paged_attention_ragged, ..." for PyPI's unrelated `aiter` package)."""
    try:
        mods = {name: importlib.import_module(name) for name in ("aiter", "aiter.mla")}
    except Exception as exc:  # a broken ROCm install must not break discovery of other backends
        return f"aiter failed to import ({type(exc).__name__}: {exc})"
    missing = [f"{mod}.{op}" for mod, op in OPERATORS if not hasattr(mods[mod], op)]
    return "" if not missing else f"the installed aiter is not AMD's AITER (no {', '.join(missing)})"


def load_aiter(backend: str) -> tuple[ModuleType, ModuleType]:
    """`import aiter, aiter.mla`, any failure as the registry's typed "unavailable" error naming it."""
    problem = missing_operators()
    if problem:
        raise BackendUnavailableError(backend, problem)
    return importlib.import_module("aiter"), importlib.import_module("aiter.mla")


class AiterOps:
    """Calls into AITER with the argument layout each operator documents."""

    def __init__(self, aiter: ModuleType, mla: ModuleType):
        self.aiter, self.mla_module = aiter, mla
        self._unit_scale: dict[torch.device, torch.Tensor] = {}

    def unit_scale(self, device: torch.device) -> torch.Tensor:
        """float32 `[1]` tensor 1.0 on `device` (paged decode's k_scale / v_scale: attn-aiter folds the
        layer's scales itself, `plans.fold_kv_scales`)."""
        if device not in self._unit_scale:
            self._unit_scale[device] = torch.ones(1, dtype=torch.float32, device=device)
        return self._unit_scale[device]

    def paged_decode(
        self,
        out,
        workspace,
        query,
        key_cache,
        value_cache,
        *,
        scale,
        kv_indptr,
        page_ids,
        last_page_lens,
        page_size,
        max_partitions,
    ) -> None:
        """out `[bs, H, D]` = decode attention of query `[bs, H, D]` over NHD caches `[pages, page_size,
        Hkv, D]`: request b reads pages `page_ids[kv_indptr[b]:kv_indptr[b + 1]]`, its last one filled to
        `last_page_lens[b]` (int32); `workspace` holds `plans.decode_workspace_bytes(...)` bytes."""
        one = self.unit_scale(query.device)
        self.aiter.paged_attention_ragged(
            out,
            workspace,
            query,
            key_cache,
            value_cache,
            scale,
            kv_indptr,
            page_ids,
            last_page_lens,
            page_size,
            max_partitions,
            None,
            "auto",
            "NHD",
            0.0,
            one,
            one,
            None,
            PARTITION_SIZE,
        )

    def varlen_prefill(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale) -> torch.Tensor:
        """`[total_q, H, Dv]`: sequence b's queries over its keys (int32 cumulative lengths), causal from
        the bottom right."""
        return self.aiter.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=scale, causal=True
        )

    def mla(
        self, kernel: str, q, kv_buffer, out, *, qo_indptr, kv_indptr, kv_indices, last_page_lens, max_seqlen_q, scale
    ) -> None:
        """out `[total_q, H, Dv]` = absorbed MLA of q `[total_q, H, D]` over `kv_buffer` `[pages, page, 1, D]`,
        causal from the bottom right: `kernel` "decode" (`mla_decode_fwd`, 1..4 queries per sequence) or
        "prefill" (`mla_prefill_fwd`, up to `plans.MLA_PREFILL_MAX_Q`)."""
        fn = self.mla_module.mla_decode_fwd if kernel == "decode" else self.mla_module.mla_prefill_fwd
        fn(q, kv_buffer, out, qo_indptr, kv_indptr, kv_indices, last_page_lens, max_seqlen_q, sm_scale=scale)
