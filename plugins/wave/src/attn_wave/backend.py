"""`WaveBackend`: attention on AMD GPUs through Wave's attention templates (wave-lang). Never ran on an
AMD GPU (README.md).

Paths (kernel contracts: `attn_wave.testing.emulated_kernels`; calls: `attn_wave.wave_kernels`):
- DECODE: the paged-decode template's two phases (split-KV partials, then their merge) over attn-core's
  token-major pool buffers `[slots, Hkv, D]` and each request's slot list.
- EXTEND, MIXED, DRAFT_EXTEND, TARGET_VERIFY: the extend template: each request's new tokens over its
  cached prefix (slot list) and, causally, over its own new tokens (the step's k / v); TARGET_VERIFY with
  tree masks through the template's custom-mask variant. Requests without new tokens are left out.

Both read slot lists (pages of one token), so any page size serves. A layer's k_scale / v_scale (None or
1 unless the engine set them) fold into the softmax scale and the output; new tokens go to the extend
kernel as the pool stores them. Metadata comes from the batch's host copies; `forward` never syncs.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn_core.contract.backend import AttentionBackend
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.errors import IncompatibleBackendError, UnsupportedFeatureError
from attn_core.memory import kv_scales
from attn_core.memory.fp8 import quantize_kv
from attn_core.ops.kv_indices import build_kv_indices, kv_indptr_from_lens
from attn_wave.plans import DecodePlan, ExtendPlan, WaveMetadata
from attn_wave.spec import CAPABILITIES
from attn_wave.wave_kernels import WaveKernels, decode_writes_float16, load_wave

DECODE_PATH = "wave paged_decode_attention (phase 0 + phase 1)"
EXTEND_PATH = "wave extend_attention"
#: key-value splits of the decode kernel (SGLang's default `triton_attention_num_kv_splits`)
NUM_KV_SPLITS = 8


class WaveBackend(AttentionBackend[WaveMetadata]):
    """The `wave` backend (see the module docstring). Needs wave-lang on ROCm; tests install an emulation.
    Option: `num_kv_splits` (decode splits per sequence, default 8)."""

    name = "wave"
    capabilities = CAPABILITIES

    def __init__(self, ctx, *, num_kv_splits: int = NUM_KV_SPLITS, **options):
        super().__init__(ctx, **options)
        self.kernels = WaveKernels(load_wave(self.name), num_kv_splits)
        if ctx.dtype != torch.float16 and decode_writes_float16(self.kernels.decode_keywords):
            raise IncompatibleBackendError(
                self.name, [f"dtype {ctx.dtype}: this wave-lang's decode template writes float16 only"]
            )

    # ---- per-step metadata -------------------------------------------------------------------
    def build_forward_metadata(self, forward_batch: ForwardBatch) -> WaveMetadata:
        b = forward_batch
        if b.encoder_lens is not None:
            raise UnsupportedFeatureError(self.name, "encoder-decoder batches")
        seq = [int(n) for n in b.seq_lens_cpu.tolist()]
        r2t = self.req_to_token(b)
        if b.forward_mode.is_decode():
            ids = build_kv_indices(r2t, b.req_pool_indices, b.seq_lens, sum(seq))
            (u, s, dv, h), max_shape = self.kernels.decode_buffer_shapes(
                b.batch_size, self.ctx.num_q_heads, self.ctx.v_head_dim
            )
            logits = torch.zeros((u, s, dv, h), dtype=torch.float32, device=self.device)
            logits_max = torch.full(max_shape, float("-inf"), dtype=torch.float32, device=self.device)
            return WaveMetadata(DECODE_PATH, DecodePlan(kv_indptr_from_lens(b.seq_lens), ids, logits, logits_max))
        q = [int(n) for n in b.extend_seq_lens_cpu.tolist()]
        keep = [i for i, n in enumerate(q) if n > 0]
        if not keep:
            return WaveMetadata(EXTEND_PATH, None)
        prefix = [seq[i] - q[i] for i in keep]
        lens = torch.tensor([[q[i] for i in keep], prefix], dtype=torch.int32).to(self.device)
        rows = b.req_pool_indices
        if len(keep) < len(q):
            rows = rows[torch.tensor(keep, dtype=torch.long).to(rows.device)]
        ids = build_kv_indices(r2t, rows, lens[1], sum(prefix))
        mask = offsets = None
        spec = b.spec_info
        if b.forward_mode.is_target_verify() and spec is not None and spec.custom_mask is not None:
            mask, offsets = (
                spec.custom_mask.to(torch.int8),
                spec.mask_indptr[:-1].to(torch.int32),
            )  # every request has drafts
        plan = ExtendPlan(kv_indptr_from_lens(lens[0]), kv_indptr_from_lens(lens[1]), ids, max(q), mask, offsets)
        return WaveMetadata(EXTEND_PATH, plan)

    # ---- forward -------------------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        """The two decode phases over the request's slot list. Returns `[bs, Hq * Dv]`."""
        pool = self.save_kv(k, v, layer, forward_batch) if save_kv_cache else self.kv_pool(forward_batch)
        plan: DecodePlan = self.forward_metadata.plan
        ks, vs = kv_scales(layer, pool)
        out = q.new_empty((q.shape[0], layer.num_q_heads, layer.v_head_dim))
        self.kernels.decode(
            q.contiguous(),
            pool.get_key_buffer(layer.layer_id),
            pool.get_value_buffer(layer.layer_id),
            out,
            plan.kv_indptr,
            plan.kv_indices,
            plan.logits,
            plan.logits_max,
            scale=layer.scaling * ks,
        )
        return _scaled(out, vs).reshape(q.shape[0], -1)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        """The extend kernel: prefix from the pool, new tokens from k / v. Returns `[T, Hq * Dv]`."""
        pool = self.save_kv(k, v, layer, forward_batch) if save_kv_cache else self.kv_pool(forward_batch)
        plan: Optional[ExtendPlan] = self.forward_metadata.plan
        if plan is None:
            return q.new_zeros((0, layer.num_q_heads * layer.v_head_dim))
        ks, vs = kv_scales(layer, pool)
        k_new, v_new = (x if s == 1.0 else quantize_kv(x, pool.dtype, s) for x, s in ((k, ks), (v, vs)))
        out = q.new_empty((q.shape[0], layer.num_q_heads, layer.v_head_dim))
        self.kernels.extend(
            q.contiguous(),
            k_new.contiguous(),
            v_new.contiguous(),
            pool.get_key_buffer(layer.layer_id),
            pool.get_value_buffer(layer.layer_id),
            out,
            qo_indptr=plan.qo_indptr,
            kv_indptr=plan.kv_indptr,
            kv_indices=plan.kv_indices,
            max_extend_len=plan.max_extend_len,
            scale=layer.scaling * ks,
            custom_mask=plan.custom_mask,
            mask_offsets=plan.mask_offsets,
        )
        return _scaled(out, vs).reshape(q.shape[0], -1)


def _scaled(out: torch.Tensor, scale: float) -> torch.Tensor:
    """`out` times `scale` (no work when it is 1)."""
    return out if scale == 1.0 else out * scale
