"""`AiterBackend`: attention on AMD GPUs through AMD's AITER kernels. Never ran on an AMD GPU (README.md).

Paths (operator contracts: `attn_aiter.testing.emulated_ops`; calls: `attn_aiter.aiter_ops`):
- MHA/GQA DECODE: `paged_attention_ragged` over attn-core's pool viewed as NHD pages `[pages, page, Hkv,
  D]` (no copy), CSR page lists from the request rows.
- MHA/GQA EXTEND, MIXED, TARGET_VERIFY (chains), DRAFT_EXTEND: `flash_attn_varlen_func` over each
  request's keys gathered from the pool (one index_select per layer: the kernel reads dense K/V), causal
  from the bottom right; requests without new tokens are left out.
- MLA (512 + 64): `mla_decode_fwd` when every request has the same 1..4 queries (DECODE, short verify
  and draft steps), else `mla_prefill_fwd` with each request cut into pieces of at most 128 queries;
  the latent pool `[slots, 1, 576]` is read as pages of one token (`[slots, 1, 1, 576]`), so any page
  size serves; query heads padded with zeros to a multiple of 16.
- CUDA graphs (DECODE): the CSR buffers, workspace and partition count sized for `max_bs` and
  `max_context_len` once; capture / replay rewrite the buffers in place.

A layer's k_scale / v_scale (None or 1 unless the engine set them) fold into the softmax scale and the
output (`plans.fold_kv_scales`). Metadata comes from the batch's host copies; `forward` never syncs.
"""

from __future__ import annotations

from typing import Optional

import torch

from attn_aiter.aiter_ops import AiterOps, load_aiter
from attn_aiter.plans import (
    MLA_PREFILL_MAX_Q,
    AiterMetadata,
    MlaPlan,
    PagedDecodePlan,
    VarlenPlan,
    decode_workspace_bytes,
    fold_kv_scales,
    mla_kernel_for,
    mla_padded_heads,
    offsets,
    partitions_for,
    query_pieces,
    to_device,
)
from attn_aiter.spec import CAPABILITIES
from attn_core.contract.backend import AttentionBackend
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.errors import IncompatibleBackendError, InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.memory import kv_scales
from attn_core.ops.kv_indices import build_kv_indices, pages_for

#: the AITER operator each plan feeds (AiterMetadata.path)
PATHS = {"decode": "aiter.mla.mla_decode_fwd", "prefill": "aiter.mla.mla_prefill_fwd"}
PAGED_DECODE, VARLEN = "aiter.paged_attention_ragged", "aiter.flash_attn_varlen_func"


class AiterBackend(AttentionBackend[AiterMetadata]):
    """The `aiter` backend (see the module docstring). Needs AITER on ROCm; tests install an emulation."""

    name = "aiter"
    capabilities = CAPABILITIES

    def __init__(self, ctx, **options):
        super().__init__(ctx, **options)
        if ctx.is_mla:
            if ctx.num_q_heads > 128:
                raise IncompatibleBackendError(
                    self.name, [f"{ctx.num_q_heads} query heads (AITER's MLA kernels serve up to 128)"]
                )
            self.mla_heads = mla_padded_heads(ctx.num_q_heads)
        elif ctx.v_head_dim != ctx.head_dim:
            raise IncompatibleBackendError(
                self.name, [f"v_head_dim {ctx.v_head_dim} != head_dim {ctx.head_dim} (paged decode)"]
            )
        self.ops = AiterOps(*load_aiter(self.name))
        self.page_size = ctx.page_size
        self._graph: Optional[dict] = None

    # ---- per-step metadata -------------------------------------------------------------------
    def build_forward_metadata(self, forward_batch: ForwardBatch) -> AiterMetadata:
        b = forward_batch
        if b.encoder_lens is not None:
            raise UnsupportedFeatureError(self.name, "encoder-decoder batches")
        seq = [int(n) for n in b.seq_lens_cpu.tolist()]
        q = [1] * b.batch_size if b.forward_mode.is_decode() else [int(n) for n in b.extend_seq_lens_cpu.tolist()]
        if self.ctx.is_mla:
            return self._mla_metadata(b, q, seq)
        if b.forward_mode.is_decode():
            return AiterMetadata(PAGED_DECODE, self._paged_decode_plan(b, seq))
        keep = [i for i, n in enumerate(q) if n > 0]
        if not keep:
            return AiterMetadata(VARLEN, None)
        rows = self._rows(b.req_pool_indices, keep, len(q))
        ql, kl = [q[i] for i in keep], [seq[i] for i in keep]
        cu_q, cu_k, lens = to_device([offsets(ql), offsets(kl), kl], self.device)
        slots = build_kv_indices(self.req_to_token(b), rows, lens, sum(kl))
        return AiterMetadata(VARLEN, VarlenPlan(cu_q, cu_k, max(ql), max(kl), slots))

    def _rows(self, req_pool_indices: torch.Tensor, keep: list[int], n: int) -> torch.Tensor:
        """The request rows of `keep` (all rows when every request is kept: no gather)."""
        if len(keep) == n:
            return req_pool_indices
        return req_pool_indices[torch.tensor(keep, dtype=torch.long).to(req_pool_indices.device)]

    def _paged_decode_plan(self, b: ForwardBatch, seq: list[int]) -> PagedDecodePlan:
        bs, p = b.batch_size, self.page_size
        indptr = torch.empty(bs + 1, dtype=torch.int32, device=self.device)
        last = torch.empty(bs, dtype=torch.int32, device=self.device)
        total = sum(pages_for(n, p) for n in seq)
        ids = build_kv_indices(
            self.req_to_token(b),
            b.req_pool_indices,
            b.seq_lens,
            total,
            page_size=p,
            indptr_out=indptr,
            last_page_len_out=last,
        )
        parts = partitions_for(max(seq))
        size = decode_workspace_bytes(bs, self.ctx.num_q_heads, parts, self.ctx.head_dim, self._itemsize())
        return PagedDecodePlan(indptr, ids, last, parts, torch.empty(size, dtype=torch.uint8, device=self.device))

    def _itemsize(self) -> int:
        return torch.empty(0, dtype=self.ctx.dtype).element_size()

    def _mla_metadata(self, b: ForwardBatch, q: list[int], seq: list[int]) -> AiterMetadata:
        keep = [i for i, n in enumerate(q) if n > 0]
        ql, kl = [q[i] for i in keep], [seq[i] for i in keep]
        if not keep:
            return AiterMetadata(PATHS["prefill"], None)
        kernel = mla_kernel_for(ql)
        pieces = (
            [(r, n, k) for r, (n, k) in enumerate(zip(ql, kl))]
            if kernel == "decode"
            else query_pieces(ql, kl, MLA_PREFILL_MAX_Q)
        )
        owners = [keep[r] for r, _, _ in pieces]
        pq, pk = [n for _, n, _ in pieces], [k for _, _, k in pieces]
        qo, kv, lens, owner = to_device([offsets(pq), offsets(pk), pk, owners], self.device)
        rows = b.req_pool_indices if owners == list(range(b.batch_size)) else b.req_pool_indices[owner.long()]
        indices = build_kv_indices(self.req_to_token(b), rows, lens, sum(pk))
        ones = torch.ones(len(pieces), dtype=torch.int32, device=self.device)
        return AiterMetadata(PATHS[kernel], MlaPlan(kernel, qo, kv, indices, ones, max(pq)))

    # ---- CUDA graphs (DECODE) -------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """CSR buffers for `max_bs` requests of up to `max_context_len` keys, the workspace and partition
        count for them (MHA), the query offsets 0..max_bs (MLA)."""
        ctx, dev, i32 = self.ctx, self.device, torch.int32
        per_request = ctx.max_context_len if ctx.is_mla else pages_for(ctx.max_context_len, self.page_size)
        g = dict(
            max_bs=max_bs,
            kv_indptr=torch.zeros(max_bs + 1, dtype=i32, device=dev),
            ids=torch.zeros(max_bs * per_request, dtype=i32, device=dev),
            last=torch.ones(max_bs, dtype=i32, device=dev),
            qo_indptr=torch.arange(max_bs + 1, dtype=i32, device=dev),
            partitions=partitions_for(ctx.max_context_len),
        )
        if not ctx.is_mla:
            size = decode_workspace_bytes(max_bs, ctx.num_q_heads, g["partitions"], ctx.head_dim, self._itemsize())
            g["workspace"] = torch.empty(size, dtype=torch.uint8, device=dev)
        self._graph = g

    def capture_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        self.bind_graph_metadata(self._graph_metadata(step), step)

    def replay_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        self.bind_graph_metadata(self._graph_metadata(step), step)

    def _graph_metadata(self, step: CudaGraphStep) -> AiterMetadata:
        """Rewrite the graph's CSR buffers for this batch (in place) and point a plan at them."""
        g = self._graph
        if g is None:
            raise InvalidArgumentError("init_cuda_graph_state", "called before graph capture / replay", None)
        if step.encoder_lens is not None:
            raise UnsupportedFeatureError(self.name, "encoder-decoder batches")
        if not step.forward_mode.is_decode():
            raise UnsupportedFeatureError(self.name, f"CUDA graphs of {step.forward_mode.name} (DECODE only)")
        bs = step.bs
        if bs > g["max_bs"]:
            raise InvalidArgumentError("bs", f"<= the graph state's max_bs {g['max_bs']}", bs)
        seq = [int(n) for n in step.host_seq_lens().tolist()]
        if max(seq) > self.ctx.max_context_len:
            raise InvalidArgumentError("seq_lens", f"<= max_context_len {self.ctx.max_context_len}", max(seq))
        mla = self.ctx.is_mla
        page = 1 if mla else self.page_size
        indptr, last = g["kv_indptr"][: bs + 1], g["last"][:bs]
        total = sum(pages_for(n, page) for n in seq)
        build_kv_indices(
            self.req_to_token(),
            step.req_pool_indices,
            step.seq_lens,
            total,
            page_size=page,
            out=g["ids"],
            indptr_out=indptr,
            last_page_len_out=last,
            whole_out=True,
        )
        if mla:
            return AiterMetadata(
                PATHS["decode"], MlaPlan("decode", g["qo_indptr"][: bs + 1], indptr, g["ids"], last, 1)
            )
        return AiterMetadata(PAGED_DECODE, PagedDecodePlan(indptr, g["ids"], last, g["partitions"], g["workspace"]))

    # ---- forward -------------------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        """MHA: paged decode over NHD pages; MLA: the MLA path. Returns `[bs, Hq * Dv]`."""
        pool = self.save_kv(k, v, layer, forward_batch) if save_kv_cache else self.kv_pool(forward_batch)
        if self.ctx.is_mla:
            return self._mla_forward(q, layer, pool)
        plan: PagedDecodePlan = self.forward_metadata.plan
        scale, out_scale = fold_kv_scales(layer.scaling, *kv_scales(layer, pool))
        hkv, d, p = layer.num_kv_heads, layer.head_dim, self.page_size
        key_cache = pool.get_key_buffer(layer.layer_id).view(-1, p, hkv, d)
        value_cache = pool.get_value_buffer(layer.layer_id).view(-1, p, hkv, d)
        out = q.new_empty(q.shape)
        self.ops.paged_decode(
            out,
            plan.workspace,
            q.contiguous(),
            key_cache,
            value_cache,
            scale=scale,
            kv_indptr=plan.kv_indptr,
            page_ids=plan.page_ids,
            last_page_lens=plan.last_page_lens,
            page_size=p,
            max_partitions=plan.max_partitions,
        )
        return _scaled(out, out_scale).reshape(q.shape[0], -1)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        """MHA: varlen attention over the gathered keys of the requests with new tokens; MLA: the MLA
        path. Returns `[T, Hq * Dv]`."""
        pool = self.save_kv(k, v, layer, forward_batch) if save_kv_cache else self.kv_pool(forward_batch)
        if self.ctx.is_mla:
            return self._mla_forward(q, layer, pool)
        plan: Optional[VarlenPlan] = self.forward_metadata.plan
        if plan is None:
            return q.new_zeros((0, layer.num_q_heads * layer.v_head_dim))
        scale, out_scale = fold_kv_scales(layer.scaling, *kv_scales(layer, pool))
        keys = pool.get_key_buffer(layer.layer_id).index_select(0, plan.kv_slots)
        values = pool.get_value_buffer(layer.layer_id).index_select(0, plan.kv_slots)
        out = self.ops.varlen_prefill(
            q.contiguous(),
            keys,
            values,
            cu_seqlens_q=plan.cu_seqlens_q,
            cu_seqlens_k=plan.cu_seqlens_k,
            max_seqlen_q=plan.max_seqlen_q,
            max_seqlen_k=plan.max_seqlen_k,
            scale=scale,
        )
        return _scaled(out, out_scale).reshape(q.shape[0], -1)

    def _mla_forward(self, q: torch.Tensor, layer, pool) -> torch.Tensor:
        """Absorbed MLA of q `[T, H, 576]` over the latent pool: `[T, H * 512]`."""
        plan: Optional[MlaPlan] = self.forward_metadata.plan
        t, h, d = q.shape
        dv = layer.v_head_dim
        if plan is None:
            return q.new_zeros((0, h * dv))
        ks, _ = kv_scales(layer, pool)
        scale, out_scale = fold_kv_scales(layer.scaling, ks, ks)
        hp = self.mla_heads
        qp = q.contiguous() if hp == h else torch.cat([q, q.new_zeros(t, hp - h, d)], 1)
        out = q.new_empty((t, hp, dv))
        latent = pool.get_key_buffer(layer.layer_id).view(-1, 1, 1, d)
        self.ops.mla(
            plan.kernel,
            qp,
            latent,
            out,
            qo_indptr=plan.qo_indptr,
            kv_indptr=plan.kv_indptr,
            kv_indices=plan.kv_indices,
            last_page_lens=plan.last_page_lens,
            max_seqlen_q=plan.max_seqlen_q,
            scale=scale,
        )
        return _scaled(out[:, :h], out_scale).reshape(t, h * dv)


def _scaled(out: torch.Tensor, scale: float) -> torch.Tensor:
    """`out` times `scale` (no work when it is 1)."""
    return out if scale == 1.0 else out * scale
