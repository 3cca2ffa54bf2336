"""`TRTLLMMLABackend` (`trtllm_mla`): attn-flashinfer's `FlashInferMLABackend` with DECODE, TARGET_VERIFY
and DRAFT_EXTEND (when every request has the same query count) on TensorRT-LLM's MLA decode kernels.

Unverified on hardware (no Blackwell GPU was available): see README.md. On a device or dtype without a
TRT-LLM kernel (`kernel.kernel_for`), and for every other step (EXTEND, MIXED, ragged DRAFT_EXTEND), the
parent's FlashInfer MLA kernels serve. DeepSeek's prefill path (`plan_prefill`) runs on TRT-LLM's ragged
prefill (`ragged.py`) where the trtllm-gen kernels serve and the head dims are ones it builds, else on
the parent's FlashInfer ragged wrappers.

A TRT-LLM step carries a block table (`block_table.build_block_table`, one launch of torch ops, into a
fixed buffer under CUDA graphs) and the key counts; the layer's softmax scale and the latent's k_scale
are folded into the kernel's scales (`args.fold_scales`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attn_core.batch import ForwardBatch
from attn_core.chunked_prefill import ChunkedPrefillPlan
from attn_core.errors import UnsupportedFeatureError
from attn_flashinfer.mla_backend import FlashInferMLABackend, MLAGraph, MLAStep
from attn_flashinfer.mla_steps import uniform_q_len
from attn_flashinfer.steps import StepInputs
from attn_trtllm_mla import kernel
from attn_trtllm_mla.args import decode_kwargs, fold_scales
from attn_trtllm_mla.block_table import PAD, build_block_table, check_width, padded_width
from attn_trtllm_mla.ragged import plan_ragged_prefill, uses_ragged_kernel
from attn_trtllm_mla.spec import CAPABILITIES


@dataclass
class TrtDecode:
    """The TRT-LLM part of a step: block table int32 `[bs, width]`, key counts int32 `[bs]` (device),
    the longest request (eager) or the table's capacity in tokens (CUDA graphs), queries per request."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
    q_len: int


class TRTLLMMLABackend(FlashInferMLABackend):
    """TensorRT-LLM's MLA decode kernels (compute capability 10.x, bf16), FlashInfer's MLA kernels for the
    rest. Options: those of `FlashInferMLABackend`."""

    name = "trtllm_mla"
    capabilities = CAPABILITIES

    def __init__(self, ctx, **options):
        super().__init__(ctx, **options)
        self.kernel = kernel.kernel_for(torch.cuda.get_device_capability(self.device), ctx.dtype)
        self.trt_workspace = kernel.new_workspace(self.device) if self.kernel else None
        self.width = padded_width(ctx.max_context_len, self.page_size)
        self._graph_table: Optional[torch.Tensor] = None
        self._graph_seq_lens: Optional[torch.Tensor] = None

    def _new_step(self, inputs: StepInputs, graph: Optional[MLAGraph], scalings) -> MLAStep:
        trt_mode = inputs.mode.is_decode() or inputs.mode.is_target_verify() or inputs.mode.is_draft_extend()
        q_len = uniform_q_len(inputs.q_lens_host, inputs.bs, inputs.num_tokens) if self.kernel and trt_mode else None
        if q_len is None:
            return super()._new_step(inputs, graph, scalings)
        step = super()._new_step(inputs, graph, ())  # the key list only: no FlashInfer plan
        longest = int(inputs.seq_lens_host.max()) if inputs.bs else 0
        check_width(longest, self.page_size, self.width)
        if graph is None:
            table = build_block_table(inputs.req_to_token, inputs.req_pool_indices, inputs.seq_lens, self.page_size, self.width)
            step.kernel_args = TrtDecode(table, inputs.seq_lens.to(torch.int32), longest, q_len)
        else:
            table = build_block_table(
                inputs.req_to_token, inputs.req_pool_indices, inputs.seq_lens, self.page_size, self.width, out=self._graph_table
            )
            seq = self._graph_seq_lens[: inputs.bs]
            seq.copy_(inputs.seq_lens)
            step.kernel_args = TrtDecode(table, seq, self.width * self.page_size, q_len)
        return step

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        super().init_cuda_graph_state(max_bs, max_num_tokens)
        self._graph_table = torch.full((max_bs, self.width), PAD, dtype=torch.int32, device=self.device)
        self._graph_seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=self.device)

    def _forward(self, q, k, v, layer, batch, save_kv_cache, return_lse=False):
        step: MLAStep = self.forward_metadata
        trt: Optional[TrtDecode] = step.kernel_args
        if trt is None:
            return super()._forward(q, k, v, layer, batch, save_kv_cache, return_lse=return_lse)
        if return_lse:
            raise UnsupportedFeatureError(self.name, "return_lse (TRT-LLM's MLA decode returns no LSE)")
        pool = self.save_kv(k, v, layer, batch) if save_kv_cache else self.kv_pool(batch)
        latent = pool.get_key_buffer(layer.layer_id)
        bs = trt.block_table.shape[0]
        out = q.new_empty((bs, q.shape[1], self.dims.kv_lora_rank)) if trt.q_len == 1 else None
        kw = decode_kwargs(
            q, latent, self.page_size, self.dims.kv_lora_rank, self.dims.qk_rope_head_dim, trt.block_table, trt.seq_lens,
            trt.max_seq_len, trt.q_len, fold_scales(layer.scaling, None, layer.k_scale), self.trt_workspace, out,
        )  # fmt: skip
        o = kernel.decode(kw, self.kernel)
        return o.flatten(1)  # [T, H * Dv] (T may be 0)

    def plan_prefill(
        self, forward_batch: ForwardBatch, chunk_capacity: int, scaling: float, qk_head_dim: int = 192, v_head_dim: int = 128
    ) -> ChunkedPrefillPlan:
        """The parent's `plan_prefill` (same arguments, same `attend`), on TRT-LLM's ragged prefill when
        `ragged.uses_ragged_kernel` says so; its workspace is the decode kernels' (calls are serial on
        the stream)."""
        if not uses_ragged_kernel(self.kernel, qk_head_dim, v_head_dim):
            return super().plan_prefill(forward_batch, chunk_capacity, scaling, qk_head_dim, v_head_dim)
        return plan_ragged_prefill(
            forward_batch, self.req_to_token(forward_batch), chunk_capacity, num_heads=self.dims.num_heads, qk_head_dim=qk_head_dim,
            v_head_dim=v_head_dim, scaling=scaling, workspace=self.trt_workspace, run=kernel.ragged_prefill,
        )  # fmt: skip
