"""`AscendBackend`: attention on Ascend NPUs through torch_npu's operators.

Paths (operator contracts: `attn_ascend.testing.emulated_ops`):
- K/V writes: `_npu_reshape_and_cache` into block views of attn-core's pools (MHA: each layer's
  `[slots, H, D]` buffer viewed `[pages, page, H, D]`, no copy; MLA: the latent `[slots, 1, rank +
  rope]` split into its latent and rope channels, written as key and value of the operator).
- DECODE: `_npu_paged_attention` (MHA); MLA: `_npu_paged_attention_mla` over the combined latent
  cache, or in graph mode the fused-infer operator's `.out` variant in BSND with query_rope/key_rope.
- EXTEND, MIXED: `npu_fused_infer_attention_score`, TND queries over the paged caches, causal from
  the bottom right (`sparse_mode=3` with the compressed 2048x2048 mask), query_rope/key_rope for MLA.
- TARGET_VERIFY, DRAFT_EXTEND: the same through the `.out` variant into a preallocated output (what
  NPU graph mode captures). Draft tokens attend causally (chains: no tree masks, `custom_mask` is not
  declared).

Sequence lengths go to the operators from host data built in the metadata; `forward` never syncs.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn_ascend.metadata import AscendMetadata, host_metadata
from attn_ascend.npu_ops import NpuOps, load_torch_npu
from attn_ascend.spec import CAPABILITIES
from attn_core.contract.backend import AttentionBackend
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.errors import IncompatibleBackendError, InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.ops.kv_indices import page_table_from_req_to_token, pages_for

#: side of the compressed causal mask the fused-infer operator takes with sparse_mode 3
CAUSAL_MASK_SIZE = 2048
#: sparse_mode of the fused-infer operator: 0 = no mask, 3 = causal aligned to the bottom right
NO_MASK, RIGHT_DOWN_CAUSAL = 0, 3


class AscendBackend(AttentionBackend[AscendMetadata]):
    """The `ascend` backend (see the module docstring). Needs torch_npu; tests install an emulation."""

    name = "ascend"
    capabilities = CAPABILITIES

    def __init__(self, ctx, **options):
        super().__init__(ctx, **options)
        self.ops = NpuOps(load_torch_npu(self.name))
        if ctx.is_mla and not self.ops.fia.rope:
            raise IncompatibleBackendError(
                self.name,
                [
                    "MLA needs query_rope/key_rope on npu_fused_infer_attention_score "
                    "(Ascend Extension for PyTorch 7.0.0+)"
                ],
            )
        self.page_size = ctx.page_size
        # True (masked) strictly above the diagonal, built once (sparse_mode 3 reads its corner)
        self.causal_mask = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=self.device).triu_(1)
        self.graph_block_tables: Optional[torch.Tensor] = None
        self._graph_tokens: dict[tuple[ForwardMode, int], int] = {}

    # ---- per-step metadata -------------------------------------------------------------------
    def build_forward_metadata(self, forward_batch: ForwardBatch) -> AscendMetadata:
        """Block tables from the request rows, host length lists; extend modes drop requests without
        new tokens (the TND layout has no empty sequences)."""
        b = forward_batch
        if b.encoder_lens is not None:
            raise UnsupportedFeatureError(self.name, "encoder-decoder batches")
        seq = [int(n) for n in b.seq_lens_cpu.tolist()]
        q = [1] * b.batch_size if b.forward_mode.is_decode() else [int(n) for n in b.extend_seq_lens_cpu.tolist()]
        keep, seq_kept, q_cumsum = host_metadata(seq, q)
        rows, lens = b.req_pool_indices, b.seq_lens
        if len(keep) < len(q):
            kept = torch.tensor(keep, dtype=torch.long).to(rows.device)
            rows, lens = rows[kept], lens[kept]
        cols = pages_for(max(seq_kept, default=0), self.page_size)
        tables = page_table_from_req_to_token(self.req_to_token(b), rows, lens, self.page_size, cols)
        return AscendMetadata(tables, torch.tensor(seq_kept, dtype=torch.int32), seq_kept, q_cumsum)

    # ---- NPU graph mode ------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """One persistent block table `[max_bs, pages of max_context_len]` every graph reads."""
        cols = pages_for(self.ctx.max_context_len, self.page_size)
        self.graph_block_tables = torch.zeros(max_bs, cols, dtype=torch.int32, device=self.device)

    def capture_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        """Remember the graph's new tokens per request and point the metadata at the persistent block table."""
        if step.encoder_lens is not None:
            raise UnsupportedFeatureError(self.name, "encoder-decoder batches")
        self._graph_tokens[(step.forward_mode, step.bs)] = step.num_tokens // step.bs
        self.bind_graph_metadata(self._graph_metadata(step, step.seq_lens.cpu()), step)

    def replay_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        """Refresh the persistent block table and the host lengths for this replay's batch."""
        host = step.seq_lens.cpu() if step.seq_lens_cpu is None else step.seq_lens_cpu
        self.bind_graph_metadata(self._graph_metadata(step, host), step)

    def _graph_metadata(self, step: CudaGraphStep, seq_lens_cpu: torch.Tensor) -> AscendMetadata:
        """Write the rows' page ids into the persistent block table (zeros past the batch's longest
        request) and take the lengths as host graph inputs."""
        bs, mode = step.bs, step.forward_mode
        if self.graph_block_tables is None:
            raise InvalidArgumentError("init_cuda_graph_state", "called before graph capture / replay", None)
        if bs > self.graph_block_tables.shape[0]:
            raise InvalidArgumentError("bs", f"<= the graph state's max_bs {self.graph_block_tables.shape[0]}", bs)
        t = self._graph_tokens.get((mode, bs))
        if t is None:
            raise InvalidArgumentError("bs", f"a batch size captured for {mode.name}", bs)
        seq = [int(n) for n in seq_lens_cpu.tolist()]
        tables = self.graph_block_tables[:bs]
        max_len = max(seq, default=0)
        cols = pages_for(max_len, self.page_size)
        if cols > tables.shape[1]:
            raise InvalidArgumentError("seq_lens", f"<= max_context_len {self.ctx.max_context_len}", max_len)
        r2t, width = self.req_to_token(), tables.shape[1]
        page_table_from_req_to_token(r2t, step.req_pool_indices, step.seq_lens, self.page_size, width, out=tables)
        q_cumsum = [t * (i + 1) for i in range(bs)]
        return AscendMetadata(tables, torch.tensor(seq, dtype=torch.int32), seq, q_cumsum, graph_mode=True)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """1, attn-core's smallest fill (padding rows attend one key; SGLang's Ascend backend pads with 0)."""
        return 1

    # ---- forward -------------------------------------------------------------------------------
    def _check_scales(self, layer) -> None:
        for name in ("k_scale", "v_scale"):
            s = getattr(layer, name)
            if s is not None and s != 1.0:
                raise InvalidArgumentError(name, "None or 1.0 (attn-ascend keeps K/V in bf16/fp16)", s)

    def _paged_buffer(self, batch: ForwardBatch, layer_id: int, value: bool = False) -> torch.Tensor:
        """A layer's K (or V) buffer `[slots, H, D]` viewed in blocks `[pages, page, H, D]` (no copy)."""
        pool = self.kv_pool(batch)
        buf = pool.get_value_buffer(layer_id) if value else pool.get_key_buffer(layer_id)
        return buf.unflatten(0, (-1, self.page_size))

    def _block_views(self, batch: ForwardBatch, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MHA: K and V `[pages, page, Hkv, D]`; MLA: the latent and rope channels `[pages, page, 1, *]`
        of the one latent buffer (strided views, no copy)."""
        if self.ctx.is_mla:
            buf, rank = self._paged_buffer(batch, layer_id), self.ctx.kv_lora_rank
            return buf[..., :rank], buf[..., rank:]
        return self._paged_buffer(batch, layer_id), self._paged_buffer(batch, layer_id, value=True)

    def _write_kv(self, k, v, layer, batch: ForwardBatch) -> None:
        """New K/V of the step into their slots through the reshape-and-cache operator."""
        key_cache, value_cache = self._block_views(batch, layer.layer_id)
        slots = self.write_slots(batch, layer).slots.to(torch.int32)  # the step's checked slots (refusals: the dummy 0)
        if self.ctx.is_mla:
            rank = self.ctx.kv_lora_rank
            k, v = k[..., :rank], k[..., rank:]
        self.ops.reshape_and_cache(k.contiguous(), v.contiguous(), key_cache, value_cache, slots)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        """One query per request: paged attention (MHA), the paged MLA operator, or in graph mode (MLA)
        the fused-infer `.out` variant in BSND. Returns `[bs, Hq * Dv]`."""
        meta = self.forward_metadata
        self._check_scales(layer)
        if save_kv_cache and k is not None:
            self._write_kv(k, v, layer, forward_batch)
        key_cache, value_cache = self._block_views(forward_batch, layer.layer_id)
        hq, dv = layer.num_q_heads, layer.v_head_dim
        out = q.new_empty((q.shape[0], hq, dv))
        if not self.ctx.is_mla:
            self.ops.paged_attention(
                q.contiguous(),
                key_cache,
                value_cache,
                num_heads=hq,
                num_kv_heads=layer.num_kv_heads,
                scale=layer.scaling,
                block_table=meta.block_tables,
                context_lens=meta.seq_lens_cpu,
                out=out,
            )
        elif not meta.graph_mode:
            self.ops.paged_attention_mla(
                q.contiguous(),
                self._paged_buffer(forward_batch, layer.layer_id),
                num_heads=hq,
                scale=layer.scaling,
                block_table=meta.block_tables,
                context_lens=meta.seq_lens_cpu,
                v_dim=dv,
                out=out,
            )
        else:
            rank = self.ctx.kv_lora_rank
            self.ops.fused_infer(
                q[..., :rank].contiguous().unsqueeze(1),
                key_cache.flatten(2),
                key_cache.flatten(2),
                query_rope=q[..., rank:].contiguous().unsqueeze(1),
                key_rope=value_cache.flatten(2),
                num_heads=hq,
                num_key_value_heads=1,
                input_layout="BSND",
                block_table=meta.block_tables,
                block_size=self.page_size,
                actual_seq_lengths_kv=meta.seq_lens,
                sparse_mode=NO_MASK,
                scale=layer.scaling,
                out=out.unsqueeze(1),
            )
        return out.reshape(q.shape[0], hq * dv)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        """EXTEND / MIXED / TARGET_VERIFY / DRAFT_EXTEND: the fused-infer operator, TND queries over the
        paged caches, causal from the bottom right (`.out` into a preallocated output for verify and
        draft extend). Returns `[T, Hq * Dv]`."""
        meta = self.forward_metadata
        self._check_scales(layer)
        if save_kv_cache and k is not None:
            self._write_kv(k, v, layer, forward_batch)
        hq, dv = layer.num_q_heads, layer.v_head_dim
        if not meta.q_cumsum:
            return q.new_zeros((0, hq * dv))
        key_cache, value_cache = self._block_views(forward_batch, layer.layer_id)
        common = dict(
            num_heads=hq,
            num_key_value_heads=layer.num_kv_heads,
            input_layout="TND",
            block_table=meta.block_tables,
            block_size=self.page_size,
            actual_seq_lengths=meta.q_cumsum,
            actual_seq_lengths_kv=meta.seq_lens,
            atten_mask=self.causal_mask,
            sparse_mode=RIGHT_DOWN_CAUSAL,
            scale=layer.scaling,
        )
        if self.ctx.is_mla:
            rank = self.ctx.kv_lora_rank
            query, latent = q[..., :rank].contiguous(), key_cache.flatten(2)
            args = (query, latent, latent)
            common.update(query_rope=q[..., rank:].contiguous(), key_rope=value_cache.flatten(2))
        else:
            args = (q.contiguous(), key_cache.flatten(2), value_cache.flatten(2))
        mode = forward_batch.forward_mode
        if mode.is_target_verify() or mode.is_draft_extend():
            out = self.ops.fused_infer(*args, out=q.new_empty((q.shape[0], hq, dv)), **common)
        else:
            out = self.ops.fused_infer(*args, **common)
        return out.reshape(q.shape[0], hq * dv)
