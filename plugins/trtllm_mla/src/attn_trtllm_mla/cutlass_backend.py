"""`CutlassMLABackend` (`cutlass_mla`): absorbed MLA DECODE on CUTLASS's Blackwell kernel through sgl-kernel.
Never ran on hardware (README.md). DECODE only: an engine pairs it with a prefill backend through
`attn_core.wrappers.HybridAttnBackend(prefill=..., decode=...)` (both must read the same MLA pool).

Rules it follows (sgl-kernel's `cutlass_mla_decode` wrapper and SGLang's backend, read for facts):
- the latent pool `[slots, 1, 576]` is the kernel's cache `[pages, 128, 576]` (a view: page size 128);
- q splits into q_nope (first 512 channels) and q_pe (last 64), views; at most 128 heads (the kernel pads);
- the page table: int32 `[bs, width]` from attn-core's block table (`attn_core.ops.kv_indices`), the dummy page
  0 past each request's pages, width = the longest request's pages (at least 1; any width suits page 128);
- the workspace: `cutlass_kernels.workspace_size(width * 128, bs)` bytes per step (eager), or once for
  `max_bs` and `max_context_len` (CUDA graphs, whose table width is fixed);
- a layer's k_scale folds into `sm_scale` and the output (`args.fold_scales`: the latent is both K and V).
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from attn_core.contract.backend import AttentionBackend
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.errors import IncompatibleBackendError, InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.memory import kv_scales
from attn_trtllm_mla import cutlass_kernels
from attn_trtllm_mla.args import fold_scales
from attn_trtllm_mla.cutlass_spec import CAPABILITIES, PAGE_SIZE
from attn_trtllm_mla.mha_plans import block_tables, table_width

PATH = "sgl_kernel.cutlass_mla_decode"
#: query heads the kernel serves
MAX_HEADS = 128


class CutlassPlan:
    """One decode step: int32 `page_table` `[bs, width]`, `seq_lens` `[bs]`, uint8 `workspace`."""

    path = PATH

    def __init__(self, page_table: torch.Tensor, seq_lens: torch.Tensor, workspace: torch.Tensor):
        self.page_table, self.seq_lens, self.workspace = page_table, seq_lens, workspace


class CutlassMLABackend(AttentionBackend[CutlassPlan]):
    """CUTLASS MLA decode (see the module docstring)."""

    name = "cutlass_mla"
    capabilities = CAPABILITIES
    #: where the kernel calls go: `decode(...)`, `workspace_size(max_seq_len, bs)`
    vendor: ModuleType = cutlass_kernels

    def __init__(self, ctx, **options):
        super().__init__(ctx, **options)
        if ctx.num_q_heads > MAX_HEADS:
            raise IncompatibleBackendError(
                self.name, [f"{ctx.num_q_heads} query heads (the kernel serves up to {MAX_HEADS})"]
            )
        if (ctx.kv_lora_rank, ctx.qk_rope_head_dim) != (512, 64):
            raise IncompatibleBackendError(
                self.name, [f"latent {ctx.kv_lora_rank} + {ctx.qk_rope_head_dim} (512 + 64 only)"]
            )
        self._graph: Optional[dict] = None

    def build_forward_metadata(self, forward_batch: ForwardBatch) -> CutlassPlan:
        b = forward_batch
        if b.encoder_lens is not None:
            raise UnsupportedFeatureError(self.name, "encoder-decoder batches")
        width = table_width(int(b.seq_lens_cpu.max()), PAGE_SIZE)
        table = block_tables(self.req_to_token(b), b.req_pool_indices, b.seq_lens, PAGE_SIZE, width)
        size = self.vendor.workspace_size(width * PAGE_SIZE, b.batch_size)
        return CutlassPlan(table, b.seq_lens, torch.empty(size, dtype=torch.uint8, device=self.device))

    # ---- CUDA graphs (DECODE) -------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """A page table `[max_bs, pages of max_context_len]`, and the workspace for that width and batch."""
        width = table_width(self.ctx.max_context_len, PAGE_SIZE)
        size = self.vendor.workspace_size(width * PAGE_SIZE, max_bs)
        self._graph = dict(
            max_bs=max_bs,
            table=torch.zeros(max_bs, width, dtype=torch.int32, device=self.device),
            workspace=torch.empty(size, dtype=torch.uint8, device=self.device),
        )

    def capture_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        self.bind_graph_metadata(self._graph_metadata(step), step)

    def replay_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        self.bind_graph_metadata(self._graph_metadata(step), step)

    def _graph_metadata(self, step: CudaGraphStep) -> CutlassPlan:
        g = self._graph
        if g is None:
            raise InvalidArgumentError("init_cuda_graph_state", "called before graph capture / replay", None)
        if not step.forward_mode.is_decode() or step.encoder_lens is not None:
            raise UnsupportedFeatureError(self.name, f"CUDA graphs of {step.forward_mode.name} (DECODE only)")
        if step.bs > g["max_bs"]:
            raise InvalidArgumentError("bs", f"<= the graph state's max_bs {g['max_bs']}", step.bs)
        table = block_tables(
            self.req_to_token(), step.req_pool_indices, step.seq_lens, PAGE_SIZE, g["table"].shape[1], out=g["table"]
        )
        return CutlassPlan(table, step.seq_lens, g["workspace"])

    # ---- forward -------------------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        """One kernel call: q `[bs, H, 576]` over the latent pool viewed as 128-token pages. `[bs, H * 512]`."""
        pool = self.save_kv(k, v, layer, forward_batch) if save_kv_cache else self.kv_pool(forward_batch)
        plan: CutlassPlan = self.forward_metadata
        rank = self.ctx.kv_lora_rank
        cache = pool.get_key_buffer(layer.layer_id).view(-1, PAGE_SIZE, q.shape[2])
        scales = fold_scales(layer.scaling, None, kv_scales(layer, pool)[0])
        out = self.vendor.decode(
            q[..., :rank], q[..., rank:], cache, plan.seq_lens, plan.page_table, plan.workspace, scales.bmm1
        )
        out = out if scales.bmm2 == 1.0 else out * scales.bmm2
        return out.reshape(q.shape[0], -1)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        raise UnsupportedFeatureError(self.name, f"forward mode {forward_batch.forward_mode.name} (DECODE only)")
