"""`TRTLLMMLABackend` (`trtllm_mla`): DECODE, TARGET_VERIFY and DRAFT_EXTEND steps whose requests all carry
the same query count on TensorRT-LLM's MLA decode kernels; every other step on attn-flashinfer's
`FlashInferMLABackend`, which this backend holds (`fallback`) and drives through its public extension
point (`build_forward_metadata` / `capture_step` / `replay_step` give an `MLAStep` plan whose `run` runs a
layer; see `attn_flashinfer.mla_backend`). No class of attn-flashinfer is subclassed.

Unverified on hardware (no Blackwell GPU was available): see README.md. On a device or dtype without a
TRT-LLM kernel (`kernel.kernel_for`), and for every other step (EXTEND, MIXED, ragged DRAFT_EXTEND), the
fallback's FlashInfer MLA kernels serve. DeepSeek's prefill path (`plan_prefill`) runs on TRT-LLM's ragged
prefill (`ragged.py`) where the trtllm-gen kernels serve and the head dims are ones it builds, else on the
fallback's FlashInfer ragged wrappers.

Plan once per step, run thin: a TRT-LLM step's plan (`TrtPlan`) carries the block table (attn-core's
`page_table_from_req_to_token`, torch ops, every row and slot checked on the device against the table and
the pool, refusals recorded in this backend's fault buffer; written into a fixed buffer under CUDA
graphs), the key counts and the query count; the layer's softmax scale and the latent's k_scale are folded
into the kernel's scales (`args.fold_scales`) when a layer runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from attn_core.batching.batch_utils import shared_query_len
from attn_core.batching.chunked_prefill import ChunkedPrefillPlan
from attn_core.contract.backend import AttentionBackend
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.errors import UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.contract.layer import AttentionLayer
from attn_core.engine.graph_captures import GraphCaptures, captures_of
from attn_core.ops.device_faults import DeviceFaultFlags
from attn_core.ops.kv_indices import page_table_from_req_to_token
from attn_flashinfer.mla_backend import FlashInferMLABackend, MLAStep
from attn_flashinfer.mla_steps import refuse_tree_mask
from attn_trtllm_mla import kernel
from attn_trtllm_mla.args import PAD, check_width, decode_kwargs, fold_scales, padded_width
from attn_trtllm_mla.ragged import plan_ragged_prefill, uses_ragged_kernel
from attn_trtllm_mla.spec import CAPABILITIES


@dataclass
class TrtPlan:
    """A step on TRT-LLM's MLA decode: block table int32 `[bs, width]`, key counts int32 `[bs]` (device),
    the longest request (eager) or the table's capacity in tokens (CUDA graphs), queries per request."""

    backend: TRTLLMMLABackend
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
    q_len: int
    path = "trtllm-gen MLA decode"

    def run(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: AttentionLayer,
        batch: ForwardBatch,
        save_kv_cache: bool = True,
        return_lse: bool = False,
    ) -> torch.Tensor:
        """One layer: q `[bs * q_len, H, kv_lora_rank + rope]` (the new latents written first when
        `save_kv_cache`) → `[bs * q_len, H * kv_lora_rank]`. No LSE (the kernel returns none: a typed
        error before the write)."""
        be = self.backend
        if return_lse:
            raise UnsupportedFeatureError(be.name, "return_lse (TRT-LLM's MLA decode returns no LSE)")
        pool = be.save_kv(k, v, layer, batch) if save_kv_cache else be.kv_pool(batch)
        latent = pool.get_key_buffer(layer.layer_id)
        bs = self.block_table.shape[0]
        out = q.new_empty((bs, q.shape[1], be.kv_lora_rank)) if self.q_len == 1 else None
        kw = decode_kwargs(
            q,
            latent,
            be.page_size,
            be.kv_lora_rank,
            be.qk_rope_head_dim,
            self.block_table,
            self.seq_lens,
            self.max_seq_len,
            self.q_len,
            fold_scales(layer.scaling, None, layer.k_scale),
            be.trt_workspace,
            out,
        )
        o = kernel.decode(kw, be.kernel)  # [bs, H, rank] (q_len 1) or [bs, q_len, H, rank]
        return o.reshape(q.shape[0], q.shape[1] * be.kv_lora_rank)  # [T, H * Dv], T = bs * q_len (may be 0)


class TRTLLMMLABackend(AttentionBackend[Union[TrtPlan, MLAStep]]):
    """TensorRT-LLM's MLA decode kernels (compute capability 10.x, bf16), FlashInfer's MLA kernels (the held
    `fallback`, a `fallback_class`) for the rest. Options: those of `FlashInferMLABackend`, passed to it."""

    name = "trtllm_mla"
    capabilities = CAPABILITIES
    #: the backend serving the steps TRT-LLM's kernels do not (its public extension point, no subclass)
    fallback_class = FlashInferMLABackend

    def __init__(self, ctx, **options):
        super().__init__(ctx)
        self.fallback = self.fallback_class(ctx, **options)  # its options; unknown ones: a typed error
        capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else (0, 0)
        self.kernel = kernel.kernel_for(capability, ctx.dtype)
        self.trt_workspace = kernel.new_workspace(self.device) if self.kernel else None
        self.page_size, self.kv_lora_rank, self.qk_rope_head_dim = ctx.page_size, ctx.kv_lora_rank, ctx.qk_rope_head_dim
        self.width = padded_width(ctx.max_context_len, self.page_size)
        self.device_faults = DeviceFaultFlags(ctx.device)
        self.graphs: Optional[GraphCaptures[Union[TrtPlan, MLAStep]]] = None
        self._graph_table: Optional[torch.Tensor] = None
        self._graph_seq_lens: Optional[torch.Tensor] = None

    def poll_device_fault(self) -> Optional[str]:
        """What the block tables' checks and the fallback's index kernels refused since the last poll, or
        None; reads and clears both fault buffers (one device sync each)."""
        found = [f for f in (self.device_faults.poll(), self.fallback.poll_device_fault()) if f]
        return "; ".join(found) if found else None

    def trt_q_len(
        self, mode: ForwardMode, bs: int, num_tokens: int, q_lens_host: Optional[torch.Tensor]
    ) -> Optional[int]:
        """The query count of a step TRT-LLM's decode serves (DECODE: 1; TARGET_VERIFY / DRAFT_EXTEND whose
        requests all carry the same, at least one: `q_lens_host` their host counts, None in a CUDA-graph
        batch, whose requests all carry num_tokens // bs), else None. Host data only.

        Example: (TARGET_VERIFY, 2, 6, [3, 3]) -> 3; (DRAFT_EXTEND, 2, 5, [2, 3]) -> None; (EXTEND, ...) -> None."""
        if self.kernel is None or not (mode.is_decode() or mode.is_target_verify() or mode.is_draft_extend()):
            return None
        if mode.is_decode():
            return 1
        if q_lens_host is None:
            n = shared_query_len(bs, num_tokens, longest=num_tokens // bs if bs else 0)
        else:
            n = shared_query_len(bs, num_tokens, lens=q_lens_host)
        return n or None

    # ---- per-step metadata: a TRT-LLM plan, or the fallback's ------------------------------------------
    def build_forward_metadata(self, forward_batch: ForwardBatch) -> Union[TrtPlan, MLAStep]:
        b = forward_batch
        refuse_tree_mask(self.name, b.forward_mode, b.spec_info)
        q_lens = None if b.forward_mode.is_decode() else b.extend_seq_lens_cpu
        q_len = self.trt_q_len(b.forward_mode, b.batch_size, b.num_tokens, q_lens)
        if q_len is None:
            return self.fallback.build_forward_metadata(b)  # the batch was validated by init_forward_metadata
        longest = int(b.seq_lens_cpu.max()) if b.batch_size else 0
        check_width(longest, self.page_size, self.width)
        table = self._block_table(self.req_to_token(b), b.req_pool_indices, b.seq_lens)
        return TrtPlan(self, table, b.seq_lens.to(torch.int32), longest, q_len)

    def _block_table(
        self, r2t: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, out: Optional[torch.Tensor] = None
    ):
        pool = self.ctx.token_to_kv_pool
        return page_table_from_req_to_token(
            r2t,
            rows,
            seq_lens,
            self.page_size,
            self.width,
            pad=PAD,
            out=out,
            num_slots=None if pool is None else pool.num_slots,
            fault=self.device_faults.buffer,
        )

    # ---- CUDA graphs ---------------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.fallback.init_cuda_graph_state(max_bs, max_num_tokens)
        self.graphs = GraphCaptures(self.name, max_bs, max_num_tokens)
        self._graph_table = torch.full((max_bs, self.width), PAD, dtype=torch.int32, device=self.device)
        self._graph_seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=self.device)

    def capture_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        graphs = captures_of(self.graphs, self.name)
        graphs.check_capture(step)
        refuse_tree_mask(self.name, step.forward_mode, step.spec_info)
        q_len = self.trt_q_len(step.forward_mode, step.bs, step.num_tokens, None)
        if q_len is None:
            plan = self.fallback.capture_step(step)
        else:
            plan = TrtPlan(
                self, self._graph_table[: step.bs], self._graph_seq_lens[: step.bs], self.width * self.page_size, q_len
            )
            self._refresh(plan, step, step.seq_lens.cpu())  # capture only: a sync is fine here
        self.bind_graph_metadata(graphs.add(step, plan), step)

    def replay_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        graphs = captures_of(self.graphs, self.name)
        plan = graphs.captured(step)
        if isinstance(plan, TrtPlan):
            refuse_tree_mask(self.name, step.forward_mode, step.spec_info)
            self._refresh(plan, step, step.host_seq_lens())
        else:
            plan = graphs.update(step, self.fallback.replay_step(step))
        self.bind_graph_metadata(plan, step)

    def _refresh(self, plan: TrtPlan, step: CudaGraphStep, seq_host: torch.Tensor) -> None:
        """Rewrite a captured TRT-LLM plan's block table and key counts for this graph batch."""
        check_width(int(seq_host.max()), self.page_size, self.width)
        r2t = self.req_to_token()
        self._block_table(r2t, step.req_pool_indices, step.seq_lens, out=self._graph_table)
        plan.seq_lens.copy_(step.seq_lens)

    # ---- attention: the step's plan runs the layer -------------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, return_lse=False):
        return self.forward_metadata.run(q, k, v, layer, forward_batch, save_kv_cache, return_lse)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, return_lse=False):
        return self.forward_metadata.run(q, k, v, layer, forward_batch, save_kv_cache, return_lse)

    # ---- DeepSeek's prefill path ---------------------------------------------------------------------
    def plan_prefill(
        self,
        forward_batch: ForwardBatch,
        chunk_capacity: int,
        scaling: float,
        qk_head_dim: int = 192,
        v_head_dim: int = 128,
    ) -> ChunkedPrefillPlan:
        """The fallback's `plan_prefill` (same arguments, same `attend`), on TRT-LLM's ragged prefill when
        `ragged.uses_ragged_kernel` says so; its workspace is the decode kernels' (calls are serial on the
        stream)."""
        if not uses_ragged_kernel(self.kernel, qk_head_dim, v_head_dim):
            return self.fallback.plan_prefill(forward_batch, chunk_capacity, scaling, qk_head_dim, v_head_dim)
        return plan_ragged_prefill(
            forward_batch,
            self.req_to_token(forward_batch),
            chunk_capacity,
            num_heads=self.ctx.num_q_heads,
            qk_head_dim=qk_head_dim,
            v_head_dim=v_head_dim,
            scaling=scaling,
            workspace=self.trt_workspace,
            run=kernel.ragged_prefill,
        )
