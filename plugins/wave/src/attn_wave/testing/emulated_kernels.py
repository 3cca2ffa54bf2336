"""Wave's attention templates (`wave_lang.kernel.wave.templates`) in plain torch, from their documentation:
what the compiled kernels compute, and what the template functions return. Nothing here ran on an AMD
GPU or was compared with Wave.

Sources (the templates' `tkl.Memory[...]` signatures and bodies, read for facts; SGLang's wave backend
for the call forms):

- [DECODE] `paged_decode_attention.get_paged_decode_attention_kernels(shape, mfma_variant, num_kv_splits,
  ...)` returns `(phase_0, phase_1, hyperparams_0, hyperparams_1, dynamic_symbols_0, dynamic_symbols_1)`.
  `phase_0(q [S, H, D], k [slots, Hkv, D], v [slots, Hkv, Dv], kv_indptr [S + 1], kv_indices, logits,
  logits_max)`: sequence s reads keys `kv_indices[kv_indptr[s]:kv_indptr[s + 1]]` (slots: pages of one
  token), cut into U = num_kv_splits splits of ceil(L / U) keys; split u with at least one key writes
  its normalized partial output to `logits[u, s, :, h]` (`[U, S, Dv, H]` float32) and its base-2
  log-sum-exp to `logits_max[u, s, h]` (`[U, S, H]`), scores scaled by `layer_scaling` (default
  1/sqrt(D)) in base 2; an empty split writes nothing. `phase_1(logits, logits_max, kv_indptr, out)`
  merges splits 0..min(L, U) - 1 of each sequence into `out` `[S, H, Dv]` - including splits phase_0
  left unwritten (L = 9, U = 8: splits 5..7), so a caller keeps those entries harmless (logits 0,
  logits_max -inf). `get_paged_decode_intermediate_arrays_shapes(shape, num_kv_splits)` gives the two
  buffer shapes. The keywords differ between releases: iree-turbine's template takes `input_dtype`,
  `layer_scaling` and `mha` and writes float16; SGLang's current wrapper passes `input_dtype`,
  `output_dtype` and `logit_cap`. The emulation offers both forms ("full": input/output dtype and
  layer_scaling; "minimal": input_dtype only, float16 output, scale 1/sqrt(D)).
- [EXTEND] `extend_attention.get_extend_attention_kernel(shape, mfma_variant, q_shape, k_shape, v_shape,
  k_cache_shape, v_cache_shape, o_shape, input_dtype, output_dtype, size_dtype, is_causal, logit_cap,
  layer_scaling, num_waves, use_custom_mask)` returns `(kernel, hyperparams, dynamic_symbols)`; the
  kernel takes `(q [T, H, D], k [T, Hkv, D], v [T, Hkv, Dv], k_cache [slots, Hkv, D], v_cache, qo_indptr,
  kv_indptr, kv_indices, [custom_mask int8, mask_offsets,] max_extend_len, out [T, H, Dv])`: sequence s's
  new tokens (rows qo_indptr[s]..) attend to its cached prefix `kv_indices[kv_indptr[s]:kv_indptr[s +
  1]]` (all visible) and to its own new tokens (`k` / `v` rows), causally (new token i sees new tokens
  0..i) with `is_causal`, or through `custom_mask` (row i of sequence s: entries
  `mask_offsets[s] + i * (prefix + n) + j`, j over prefix then new tokens) with `use_custom_mask`; never
  both. Inputs fp16 / bf16, lengths int32. `max_extend_len` bounds the new tokens per sequence.

Strict readings (`EmulatedOpError`): int32 index tensors, call-time shapes equal to the compiled ones
but for the first (dynamic) dimension, `max_extend_len` at least every sequence's new tokens.
"""

from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import dataclass
from typing import Optional

import torch

from attn_core.ops.masked_values import masked_pv

LOG2E = 1.44269504089

#: the decode template's shape descriptor (its fields, as the template names them)
paged_decode_attention_shape = namedtuple(
    "paged_decode_attention_shape",
    ["num_query_heads", "num_kv_heads", "head_size", "head_size_kv", "block_size", "num_seqs"],
)


@dataclass
class AttentionShape:
    """The extend template's shape descriptor (the fields attn-wave fills)."""

    num_query_heads: int
    num_kv_heads: int
    head_size: int
    head_size_kv: int
    num_seqs: Optional[int] = None
    max_seq_len: Optional[int] = None
    block_size: Optional[int] = None


class EmulatedOpError(RuntimeError):
    """An input the documented kernel does not accept (the GPU would misbehave)."""


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise EmulatedOpError(msg)


def _ints(name: str, x: torch.Tensor) -> list[int]:
    _need(x.dtype == torch.int32 and x.dim() == 1, f"{name} must be a 1-D int32 tensor, got {x.dtype} {tuple(x.shape)}")
    return [int(v) for v in x.tolist()]


def _indptr(name: str, x: torch.Tensor) -> list[int]:
    ptr = _ints(name, x)
    _need(
        len(ptr) >= 2 and ptr[0] == 0 and all(b >= a for a, b in zip(ptr, ptr[1:])),
        f"{name} must be offsets from 0, got {ptr}",
    )
    return ptr


def _scores(q, k, scale_log2: float) -> torch.Tensor:
    """Base-2 scores `[H, Sq, Sk]` of q `[Sq, H, D]` against k `[Sk, Hkv, D]` (GQA by head groups)."""
    g = q.shape[1] // k.shape[1]
    kf = k.float().transpose(0, 1).repeat_interleave(g, 0)
    return (q.float().transpose(0, 1) @ kf.transpose(1, 2)) * scale_log2


def _values(v, heads: int) -> torch.Tensor:
    return v.float().transpose(0, 1).repeat_interleave(heads // v.shape[1], 0)


def get_paged_decode_intermediate_arrays_shapes(shape, num_kv_splits: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """([U, S, Dv, H], [U, S, H]): the float32 `logits` / `logits_max` buffers of [DECODE]."""
    u, s = num_kv_splits, shape.num_seqs
    return (u, s, shape.head_size_kv, shape.num_query_heads), (u, s, shape.num_query_heads)


def _decode_phases(
    shape, num_kv_splits: int, in_dtype: torch.dtype, out_dtype: torch.dtype, layer_scaling: Optional[float]
):
    u_splits = num_kv_splits
    scale_log2 = (layer_scaling or math.sqrt(1.0 / shape.head_size)) * LOG2E
    h, hkv, d, dv = shape.num_query_heads, shape.num_kv_heads, shape.head_size, shape.head_size_kv

    def phase_0(q, k, v, kv_indptr, kv_indices, logits, logits_max):
        _need(q.dtype == in_dtype and k.dtype == in_dtype and v.dtype == in_dtype, f"inputs must be {in_dtype}")
        _need(q.dim() == 3 and tuple(q.shape[1:]) == (h, d), f"q must be [S, {h}, {d}], got {tuple(q.shape)}")
        _need(tuple(k.shape[1:]) == (hkv, d) and tuple(v.shape[1:]) == (hkv, dv), "k / v must be [slots, Hkv, D]")
        s = q.shape[0]
        _need(
            tuple(logits.shape) == (u_splits, s, dv, h) and logits.dtype == torch.float32,
            "logits must be [U, S, Dv, H] f32",
        )
        _need(
            tuple(logits_max.shape) == (u_splits, s, h) and logits_max.dtype == torch.float32,
            "logits_max must be [U, S, H]",
        )
        ptr, ids = _indptr("kv_indptr", kv_indptr), _ints("kv_indices", kv_indices)
        _need(len(ptr) == s + 1 and len(ids) >= ptr[-1], "kv_indptr / kv_indices do not cover the sequences")
        for b in range(s):
            slots = ids[ptr[b] : ptr[b + 1]]
            _need(all(0 <= x < k.shape[0] for x in slots), f"kv_indices of sequence {b} out of range")
            n = len(slots)
            per = -(-n // u_splits)
            for u in range(u_splits):
                part = slots[u * per : min((u + 1) * per, n)]
                if not part:
                    continue  # an empty split writes nothing
                idx = torch.tensor(part, dtype=torch.long, device=k.device)
                x = _scores(q[b : b + 1], k[idx], scale_log2)[:, 0]  # [H, n]
                m = x.max(-1).values
                p = torch.exp2(x - m[:, None])
                acc = (p[:, None, :] @ _values(v[idx], h))[:, 0]  # [H, Dv]
                logits[u, b] = (acc / p.sum(-1)[:, None]).transpose(0, 1)
                logits_max[u, b] = m + torch.log2(p.sum(-1))

    def phase_1(logits, logits_max, kv_indptr, out):
        ptr = _indptr("kv_indptr", kv_indptr)
        s = len(ptr) - 1
        _need(tuple(out.shape) == (s, h, dv) and out.dtype == out_dtype, f"out must be [{s}, {h}, {dv}] {out_dtype}")
        for b in range(s):
            active = min(ptr[b + 1] - ptr[b], u_splits)
            m, total = torch.full((h,), -1e6), torch.zeros(h)
            acc = torch.zeros(h, dv)
            for u in range(active):  # splits phase_0 left empty are read too
                xm = logits_max[u, b].cpu()
                new_m = torch.maximum(xm, m)
                old, new = torch.exp2(m - new_m), torch.exp2(xm - new_m)
                total = total * old + new
                acc = acc * old[:, None] + new[:, None] * logits[u, b].cpu().transpose(0, 1)
                m = new_m
            out[b] = (acc / total[:, None]).to(out.dtype).to(out.device)

    return phase_0, phase_1


def make_decode_template(form: str = "full"):
    """`get_paged_decode_attention_kernels` in one of the two keyword forms of [DECODE]."""

    def full(
        shape, mfma_variant, num_kv_splits, input_dtype=torch.float16, output_dtype=torch.float16, layer_scaling=None
    ):
        p0, p1 = _decode_phases(shape, num_kv_splits, input_dtype, output_dtype, layer_scaling)
        return p0, p1, {}, {}, [], []

    def minimal(shape, mfma_variant, num_kv_splits, input_dtype=torch.float16):
        p0, p1 = _decode_phases(shape, num_kv_splits, input_dtype, torch.float16, None)
        return p0, p1, {}, {}, [], []

    fn = {"full": full, "minimal": minimal}[form]
    fn.__name__ = "get_paged_decode_attention_kernels"
    return fn


def get_extend_attention_kernel(
    shape,
    mfma_variant,
    q_shape,
    k_shape,
    v_shape,
    k_cache_shape,
    v_cache_shape,
    o_shape,
    input_dtype=torch.float16,
    output_dtype=torch.float32,
    size_dtype=torch.int32,
    is_causal=False,
    logit_cap=0.0,
    layer_scaling=None,
    num_waves=4,
    use_custom_mask=False,
):
    """[EXTEND]: (kernel, hyperparams, dynamic_symbols); the kernel as documented above."""
    _need(input_dtype in (torch.float16, torch.bfloat16), f"input_dtype {input_dtype} (fp16 / bf16 only)")
    _need(size_dtype == torch.int32, "size_dtype must be int32")
    _need(not (is_causal and use_custom_mask), "Cannot have both causal and custom mask at the same time")
    _need(logit_cap == 0.0, "logit_cap is not emulated")
    scale = layer_scaling or math.sqrt(1.0 / shape.head_size)
    compiled = [tuple(x) for x in (q_shape, k_shape, v_shape, k_cache_shape, v_cache_shape, o_shape)]

    def run(
        q, k, v, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_offsets, max_extend_len, out
    ):
        for x, want, name in zip(
            (q, k, v, k_cache, v_cache, out), compiled, ("q", "k", "v", "k_cache", "v_cache", "out")
        ):
            _need(tuple(x.shape[1:]) == want[1:], f"{name} {tuple(x.shape)} does not match the compiled {want}")
        _need(
            q.dtype == input_dtype and k_cache.dtype == input_dtype and out.dtype == output_dtype,
            "dtypes differ from the compiled",
        )
        qo, kv, ids = _indptr("qo_indptr", qo_indptr), _indptr("kv_indptr", kv_indptr), _ints("kv_indices", kv_indices)
        _need(len(qo) == len(kv) and qo[-1] == q.shape[0] == k.shape[0], "qo_indptr / kv_indptr disagree with q rows")
        _need(len(ids) >= kv[-1], "kv_indices shorter than kv_indptr says")
        offs = _ints("mask_offsets", mask_offsets) if use_custom_mask else None
        if use_custom_mask:
            _need(custom_mask.dtype == torch.int8, "custom_mask must be int8")
        for s in range(len(qo) - 1):
            n, pre = qo[s + 1] - qo[s], kv[s + 1] - kv[s]
            _need(n <= max_extend_len, f"sequence {s} has {n} new tokens > max_extend_len {max_extend_len}")
            if n == 0:
                continue
            idx = torch.tensor(ids[kv[s] : kv[s + 1]], dtype=torch.long, device=k_cache.device)
            keys = torch.cat([k_cache[idx], k[qo[s] : qo[s + 1]]])
            vals = torch.cat([v_cache[idx], v[qo[s] : qo[s + 1]]])
            i, j = torch.arange(n)[:, None], torch.arange(pre + n)[None, :]
            if use_custom_mask:
                flat = custom_mask[offs[s] : offs[s] + n * (pre + n)].reshape(n, pre + n).cpu()
                vis = flat != 0
            else:
                vis = (j < pre) | (~torch.tensor(is_causal)) | (j - pre <= i)
            x = _scores(q[qo[s] : qo[s + 1]], keys, scale * LOG2E).masked_fill(~vis.to(q.device)[None], float("-inf"))
            p = torch.exp2(x - x.max(-1, keepdim=True).values)
            o = masked_pv(p / p.sum(-1, keepdim=True), _values(vals, q.shape[1]), vis.to(q.device))
            out[qo[s] : qo[s + 1]] = o.transpose(0, 1).to(out.dtype)

    if use_custom_mask:

        def kernel(
            q, k, v, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_offsets, max_extend_len, out
        ):
            run(
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

        def kernel(q, k, v, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, max_extend_len, out):
            run(q, k, v, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, None, None, max_extend_len, out)

    return kernel, {}, []
