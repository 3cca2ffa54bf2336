"""`TrtllmMHABackend` (`trtllm_mha`): MHA/GQA attention on TensorRT-LLM's generated kernels through FlashInfer,
on Blackwell (compute capability 10.x). Never ran on hardware (README.md).

- DECODE and chain TARGET_VERIFY: `trtllm_batch_decode_with_kv_cache` (`q_len_per_req` = the draft count);
- EXTEND, MIXED, DRAFT_EXTEND: `trtllm_batch_context_with_kv_cache` over the requests with new tokens;
- sliding window (`window_left` = W - 1) and attention sinks on both; k_scale / v_scale folded into
  `bmm1_scale` / `bmm2_scale` (`mha_args.mha_scales`);
- CUDA graphs (DECODE, TARGET_VERIFY): block tables and key counts written into fixed buffers sized for
  `max_bs` and `max_context_len`; `max_seq_len` is the table's capacity.

attn-core's NHD pool buffers are given to the kernels as HND views (`mha_args.hnd_view`, no copy). The kernel
calls go through `vendor` (`mha_kernels`; the CPU tests put the float64 stand-in there).
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from attn_core.contract.backend import AttentionBackend
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.errors import IncompatibleBackendError, InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.memory import kv_scales
from attn_trtllm_mla import mha_kernels
from attn_trtllm_mla.mha_args import context_kwargs, decode_kwargs, hnd_view, mha_scales, window_left
from attn_trtllm_mla.mha_plans import MhaMetadata, MhaPlan, block_tables, decode_q_len, table_width
from attn_trtllm_mla.mha_spec import CAPABILITIES

DECODE_PATH = "flashinfer.decode.trtllm_batch_decode_with_kv_cache"
CONTEXT_PATH = "flashinfer.prefill.trtllm_batch_context_with_kv_cache"


class TrtllmMHABackend(AttentionBackend[MhaMetadata]):
    """TensorRT-LLM's MHA kernels (see the module docstring)."""

    name = "trtllm_mha"
    capabilities = CAPABILITIES
    #: where the kernel calls go: `decode(kwargs)`, `context(kwargs)`, `new_workspace(device)`
    vendor: ModuleType = mha_kernels

    def __init__(self, ctx, **options):
        super().__init__(ctx, **options)
        if ctx.v_head_dim != ctx.head_dim:
            raise IncompatibleBackendError(self.name, [f"v_head_dim {ctx.v_head_dim} != head_dim {ctx.head_dim}"])
        self.page_size = ctx.page_size
        self.workspace = self.vendor.new_workspace(self.device)
        self._graph: Optional[dict] = None

    # ---- per-step metadata -------------------------------------------------------------------
    def build_forward_metadata(self, forward_batch: ForwardBatch) -> MhaMetadata:
        b = forward_batch
        if b.encoder_lens is not None:
            raise UnsupportedFeatureError(self.name, "encoder-decoder batches")
        seq = [int(n) for n in b.seq_lens_cpu.tolist()]
        mode = b.forward_mode
        q = [1] * b.batch_size if mode.is_decode() else [int(n) for n in b.extend_seq_lens_cpu.tolist()]
        r2t, p = self.req_to_token(b), self.page_size
        q_len = decode_q_len(mode.is_decode(), mode.is_target_verify(), q)
        if q_len is not None:
            table = block_tables(r2t, b.req_pool_indices, b.seq_lens, p, table_width(max(seq), p))
            return MhaMetadata(DECODE_PATH, MhaPlan("decode", table, b.seq_lens, max(seq), q_len=q_len))
        keep = [i for i, n in enumerate(q) if n > 0]
        if not keep:
            return MhaMetadata(CONTEXT_PATH, None)
        ql, kl = [q[i] for i in keep], [seq[i] for i in keep]
        host = torch.tensor([0, *torch.tensor(ql).cumsum(0).tolist(), 0, *torch.tensor(kl).cumsum(0).tolist(), *kl])
        dev = host.to(torch.int32).to(self.device)
        n = len(keep)
        rows = b.req_pool_indices
        if n < len(q):
            rows = rows[torch.tensor(keep, dtype=torch.long).to(rows.device)]
        lens = dev[2 * n + 2 :]
        table = block_tables(r2t, rows, lens, p, table_width(max(kl), p))
        plan = MhaPlan(
            "context",
            table,
            lens,
            max(kl),
            cum_seq_lens_q=dev[: n + 1],
            cum_seq_lens_kv=dev[n + 1 : 2 * n + 2],
            max_q_len=max(ql),
        )
        return MhaMetadata(CONTEXT_PATH, plan)

    # ---- CUDA graphs (DECODE, TARGET_VERIFY) -------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Fixed block-table `[max_bs, pages of max_context_len]` and key-count `[max_bs]` buffers."""
        width = table_width(self.ctx.max_context_len, self.page_size)
        self._graph = dict(
            max_bs=max_bs,
            table=torch.zeros(max_bs, width, dtype=torch.int32, device=self.device),
            seq_lens=torch.zeros(max_bs, dtype=torch.int32, device=self.device),
            tokens={},
        )

    def capture_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        if self._graph is not None and step.tokens_per_request is not None:
            self._graph["tokens"][(step.forward_mode, step.bs)] = step.tokens_per_request
        self.bind_graph_metadata(self._graph_metadata(step), step)

    def replay_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        self.bind_graph_metadata(self._graph_metadata(step), step)

    def _graph_metadata(self, step: CudaGraphStep) -> MhaMetadata:
        g = self._graph
        if g is None:
            raise InvalidArgumentError("init_cuda_graph_state", "called before graph capture / replay", None)
        if step.encoder_lens is not None:
            raise UnsupportedFeatureError(self.name, "encoder-decoder batches")
        mode, bs = step.forward_mode, step.bs
        if mode not in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            raise UnsupportedFeatureError(self.name, f"CUDA graphs of {mode.name}")
        if bs > g["max_bs"]:
            raise InvalidArgumentError("bs", f"<= the graph state's max_bs {g['max_bs']}", bs)
        q_len = g["tokens"].get((mode, bs))
        if q_len is None:
            raise InvalidArgumentError("bs", f"a batch size captured for {mode.name}", bs)
        width = g["table"].shape[1]
        table = block_tables(
            self.req_to_token(), step.req_pool_indices, step.seq_lens, self.page_size, width, out=g["table"]
        )
        seq_lens = g["seq_lens"][:bs]
        seq_lens.copy_(step.seq_lens)
        return MhaMetadata(DECODE_PATH, MhaPlan("decode", table, seq_lens, width * self.page_size, q_len=q_len))

    # ---- forward -------------------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, extras.get("sinks"))

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, extras.get("sinks"))

    def _forward(self, q, k, v, layer, batch, save_kv_cache: bool, sinks: Optional[torch.Tensor]) -> torch.Tensor:
        """Write the new K/V, then one kernel call over the HND views of the layer's caches: `[T, Hq * D]`."""
        pool = self.save_kv(k, v, layer, batch) if save_kv_cache else self.kv_pool(batch)
        plan: Optional[MhaPlan] = self.forward_metadata.plan
        if plan is None:
            return q.new_zeros((0, layer.num_q_heads * layer.v_head_dim))
        lid, p = layer.layer_id, self.page_size
        kv_cache = (hnd_view(pool.get_key_buffer(lid), p), hnd_view(pool.get_value_buffer(lid), p))
        scales = mha_scales(layer.scaling, *kv_scales(layer, pool))
        window = window_left(layer.sliding_window_size)
        sinks = None if sinks is None else sinks.float()
        q = q.contiguous()
        if plan.kernel == "decode":
            kw = decode_kwargs(
                q,
                kv_cache,
                self.workspace,
                plan.block_tables,
                plan.seq_lens,
                max_seq_len=plan.max_seq_len,
                scales=scales,
                window=window,
                q_len=plan.q_len,
                sinks=sinks,
            )
            out = self.vendor.decode(kw)
        else:
            kw = context_kwargs(
                q,
                kv_cache,
                self.workspace,
                plan.block_tables,
                plan.seq_lens,
                cum_seq_lens_q=plan.cum_seq_lens_q,
                cum_seq_lens_kv=plan.cum_seq_lens_kv,
                max_q_len=plan.max_q_len,
                max_kv_len=plan.max_seq_len,
                scales=scales,
                window=window,
                sinks=sinks,
            )
            out = self.vendor.context(kw)
        return out.reshape(q.shape[0], -1)
