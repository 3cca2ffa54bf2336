"""The one place attn-wave calls Wave (`wave_lang`): its paged-decode and extend attention templates,
compiled per shape and cached, behind `WaveKernels.decode` and `WaveKernels.extend`.

What the compiled kernels compute, and the template signatures: `attn_wave.testing.emulated_kernels`.
Never ran on an AMD GPU: on the CPU the tests install the emulation as the `wave_lang` modules
(`testing.emulated_wave_lang`), whose `wave_compile` returns the emulated kernel, so everything here but
the real compiler's handling of the options runs in CI.

Release differences handled here: the decode template's keywords vary (`input_dtype` always;
`output_dtype`, `layer_scaling`, `mha` in some releases). `WaveKernels` passes only the keywords the
installed template declares; without `layer_scaling` it scales q by scale·sqrt(D) (the template then
applies 1/sqrt(D)); without `output_dtype` the decode output is float16, and a bfloat16 context is
refused at construction (`decode_writes_float16`).
"""

from __future__ import annotations

import importlib
import inspect
import math
from types import SimpleNamespace
from typing import Callable, Optional

import torch

from attn_core.contract.errors import BackendUnavailableError

#: module alias -> the wave_lang module attn-wave imports
MODULES = {
    "compile": "wave_lang.kernel.wave.compile",
    "constraints": "wave_lang.kernel.wave.constraints",
    "general_utils": "wave_lang.kernel.wave.utils.general_utils",
    "run_utils": "wave_lang.kernel.wave.utils.run_utils",
    "common": "wave_lang.kernel.wave.templates.attention_common",
    "extend": "wave_lang.kernel.wave.templates.extend_attention",
    "decode": "wave_lang.kernel.wave.templates.paged_decode_attention",
}


def load_wave(backend: str) -> SimpleNamespace:
    """The wave_lang modules of `MODULES`, any import failure as the registry's typed "unavailable" error."""
    try:
        return SimpleNamespace(**{alias: importlib.import_module(name) for alias, name in MODULES.items()})
    except Exception as exc:
        raise BackendUnavailableError(backend, f"wave_lang failed to import ({type(exc).__name__}: {exc})") from exc


def template_keywords(fn: Callable) -> frozenset[str]:
    """Parameter names of a template function. Example: a decode template (shape, mfma_variant,
    num_kv_splits, input_dtype, layer_scaling, mha) -> frozenset of those six names."""
    return frozenset(inspect.signature(fn).parameters)


def decode_writes_float16(keywords: frozenset[str]) -> bool:
    """Whether a decode template with these keywords writes its output in float16 whatever the input
    (no `output_dtype`). Example: {"input_dtype", "layer_scaling"} -> True."""
    return "output_dtype" not in keywords


class WaveKernels:
    """Compiles Wave's attention templates (once per shape) and runs them."""

    def __init__(self, wave: SimpleNamespace, num_kv_splits: int):
        self.w = wave
        self.num_kv_splits = num_kv_splits
        self.decode_keywords = template_keywords(wave.decode.get_paged_decode_attention_kernels)
        self._cache: dict[tuple, object] = {}

    def _compile(self, kernel, hyperparams: dict, dynamic_symbols, **options):
        w = self.w
        hyperparams.update(w.general_utils.get_default_scheduling_params())
        opts = w.compile.WaveCompileOptions(
            subs=hyperparams,
            canonicalize=True,
            run_bench=False,
            dynamic_symbols=dynamic_symbols,
            wave_runtime=True,
            **options,
        )
        return w.compile.wave_compile(w.run_utils.set_default_run_config(opts), kernel)

    # ---- decode ----------------------------------------------------------------------------------
    def decode_buffer_shapes(self, num_seqs: int, num_heads: int, head_size_kv: int) -> tuple[tuple[int, ...], ...]:
        """Shapes of the float32 `logits` / `logits_max` buffers the decode kernels share, from the template."""
        shape = self.w.decode.paged_decode_attention_shape(num_heads, 0, 0, head_size_kv, 0, num_seqs)
        return tuple(
            tuple(s) for s in self.w.decode.get_paged_decode_intermediate_arrays_shapes(shape, self.num_kv_splits)
        )

    def _decode_phases(self, num_seqs, hq, hkv, d, dv, dtype, scale: Optional[float]):
        key = ("decode", num_seqs, hq, hkv, d, dv, dtype, scale)
        if key not in self._cache:
            w, kw = self.w, self.decode_keywords
            shape = w.decode.paged_decode_attention_shape(hq, hkv, d, dv, 32, num_seqs)
            mha = hq == hkv
            c = w.constraints
            if mha:
                m = c.MMAOperand.M
                variant = (
                    c.GenericDot(along_dim=m, k_vec_size=4, k_mult=1),
                    c.GenericDot(along_dim=m, k_vec_size=1, k_mult=64),
                )
            else:
                variant = (c.MMAType.F32_16x16x16_F16, c.MMAType.F32_16x16x16_F16)
            extra = {"input_dtype": dtype, "output_dtype": dtype, "layer_scaling": scale, "mha": mha}
            got = w.decode.get_paged_decode_attention_kernels(
                shape, variant, self.num_kv_splits, **{k: v for k, v in extra.items() if k in kw}
            )
            phase_0, phase_1, hyper_0, hyper_1, dyn_0, dyn_1 = got
            self._cache[key] = (
                self._compile(phase_0, hyper_0, dyn_0, use_buffer_ops=True, waves_per_eu=2),
                self._compile(phase_1, hyper_1, dyn_1, use_buffer_ops=False, waves_per_eu=4),
            )
        return self._cache[key]

    def decode(self, q, k_buffer, v_buffer, out, kv_indptr, kv_indices, logits, logits_max, *, scale: float) -> None:
        """out `[S, H, Dv]` = decode attention of q `[S, H, D]` over the keys `kv_indices[kv_indptr[s]:...]`
        of the token-major caches `[slots, Hkv, D]`; `logits` / `logits_max` the step's buffers
        (`decode_buffer_shapes`, unwritten splits 0 / -inf)."""
        s, hq, d = q.shape
        if "layer_scaling" in self.decode_keywords:
            phase_0, phase_1 = self._decode_phases(s, hq, k_buffer.shape[1], d, v_buffer.shape[2], q.dtype, scale)
        else:
            phase_0, phase_1 = self._decode_phases(s, hq, k_buffer.shape[1], d, v_buffer.shape[2], q.dtype, None)
            q = q * (scale * math.sqrt(d))
        phase_0(q, k_buffer, v_buffer, kv_indptr, kv_indices, logits, logits_max)
        phase_1(logits, logits_max, kv_indptr, out)

    # ---- extend ----------------------------------------------------------------------------------
    def extend(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        out,
        *,
        qo_indptr,
        kv_indptr,
        kv_indices,
        max_extend_len: int,
        scale: float,
        custom_mask: Optional[torch.Tensor] = None,
        mask_offsets: Optional[torch.Tensor] = None,
    ) -> None:
        """out `[T, H, Dv]` = each sequence's new tokens over its cached prefix (`kv_indices`, all visible)
        and its own new tokens (`k` / `v`): causal, or by `custom_mask` (int8, rows of prefix + new
        entries from `mask_offsets[s]`)."""
        masked = custom_mask is not None
        tile = 64 if max_extend_len <= 128 else 128  # the template's tile heuristic reads only this of max_seq_len
        key = (
            "extend",
            q.shape[1:],
            k.shape[1:],
            v.shape[1:],
            k_cache.shape[1:],
            out.shape[1:],
            q.dtype,
            out.dtype,
            tile,
            masked,
            scale,
        )
        if key not in self._cache:
            w = self.w
            shape = w.common.AttentionShape(
                num_query_heads=q.shape[1],
                num_kv_heads=k.shape[1],
                head_size=q.shape[2],
                head_size_kv=v.shape[2],
                num_seqs=qo_indptr.shape[0] - 1,
                max_seq_len=tile,
            )
            variant = (w.constraints.MMAType.F32_16x16x32_K8_F16, w.constraints.MMAType.F32_16x16x16_F16)
            kernel, hyper, dyn = w.extend.get_extend_attention_kernel(
                shape,
                variant,
                q.shape,
                k.shape,
                v.shape,
                k_cache.shape,
                v_cache.shape,
                out.shape,
                input_dtype=q.dtype,
                output_dtype=out.dtype,
                size_dtype=torch.int32,
                is_causal=not masked,
                logit_cap=0.0,
                layer_scaling=scale,
                use_custom_mask=masked,
            )
            self._cache[key] = self._compile(kernel, hyper, dyn, use_scheduling_barriers=False, use_buffer_ops=True)
        kernel = self._cache[key]
        if masked:
            kernel(
                q,
                k,
                v,
                k_cache,
                v_cache,
                qo_indptr,
                kv_indptr,
                kv_indices,
                custom_mask,
                mask_offsets,
                max_extend_len,
                out,
            )
        else:
            kernel(q, k, v, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, max_extend_len, out)
