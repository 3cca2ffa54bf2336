"""CUDA-graph state of the Triton backend: persistent buffers that captured kernels read and that
replay refreshes in place (DECODE and TARGET_VERIFY).

Per captured (bs, mode) the metadata is a set of views of the buffers; replay reruns the index kernel
into those views (and copies the verify mask), so the graph's pointers and grid stay valid. Decode
split counts follow each replay's lengths on the device; only `max_splits` (the grid) is fixed per bs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import torch

from attn_core.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.forward_mode import ForwardMode
from attn_core.graph_step import CudaGraphStep
from attn_triton.metadata import DecodeMetadata, ExtendMetadata, KVIndex, SplitScratch, fill_kv

if TYPE_CHECKING:
    from attn_triton.backend import TritonAttnBackend

Metadata = Union[DecodeMetadata, ExtendMetadata]


class GraphState:
    """Buffers for batches of up to `max_bs` requests and `max_num_tokens` tokens."""

    def __init__(self, backend: TritonAttnBackend, max_bs: int, max_num_tokens: int):
        ctx = backend.ctx
        dev = backend.device
        self.backend = backend
        self.max_bs = max_bs
        self.max_num_tokens = max_num_tokens
        width = ctx.max_context_len

        def i32(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=dev)

        self.kv = KVIndex(i32(max_bs + 1), i32(max_bs * width))
        self.cross = KVIndex(i32(max_bs + 1), i32(max_bs * width)) if ctx.is_encoder_decoder else None
        self.qo_indptr = i32(max_bs + 1)
        self.q_lens = i32(max_bs)
        self.mask_indptr = torch.zeros(max_bs + 1, dtype=torch.int64, device=dev)
        self.mask: Optional[torch.Tensor] = None  # allocated at the first TARGET_VERIFY capture
        self.scratch = SplitScratch(ctx.num_q_heads, ctx.v_head_dim, dev)
        self.scratch.reserve(max(bs * backend.decode_splits(bs).max_splits for bs in range(1, max_bs + 1)))
        self.captured: dict[tuple[int, ForwardMode], Metadata] = {}

    def _views(self, kv: KVIndex, bs: int) -> KVIndex:
        return KVIndex(kv.indptr[: bs + 1], kv.indices)

    def capture(self, step: CudaGraphStep) -> Metadata:
        bs, num_tokens, mode = step.bs, step.num_tokens, step.forward_mode
        if not (mode.is_decode() or mode.is_target_verify()):
            raise UnsupportedFeatureError("triton", f"CUDA graphs for {mode.name} (DECODE and TARGET_VERIFY only)")
        if not bs <= self.max_bs or not num_tokens <= self.max_num_tokens:
            raise InvalidArgumentError(
                "bs/num_tokens", f"bs <= {self.max_bs} and num_tokens <= {self.max_num_tokens} (init_cuda_graph_state)", (bs, num_tokens)
            )
        if step.encoder_lens is not None and self.cross is None:
            raise InvalidArgumentError("encoder_lens", "None (the context is not encoder-decoder)", "a tensor")
        ctx = self.backend.ctx
        has_cross = step.encoder_lens is not None
        if mode.is_decode():
            splits = self.backend.decode_splits(bs)
            meta: Metadata = DecodeMetadata(
                self._views(self.kv, bs),
                self._views(self.cross, bs) if has_cross else None,
                splits,
                *self.scratch.views(bs, splits.max_splits),
            )
        else:
            per_req = step.tokens_per_request
            spec_info = step.spec_info
            use_mask = spec_info is not None and spec_info.custom_mask is not None
            if use_mask and self.mask is None:
                self.mask = torch.zeros(self.max_num_tokens * ctx.max_context_len, dtype=torch.uint8, device=self.backend.device)
            self.q_lens[:bs].fill_(per_req)
            meta = ExtendMetadata(
                self.qo_indptr[: bs + 1],
                per_req,
                self._views(self.kv, bs),
                self._views(self.cross, bs) if has_cross else None,
                self.mask if use_mask else None,
                self.mask_indptr[: bs + 1] if use_mask else None,
            )
        self.captured[(bs, mode)] = meta
        self._refresh(meta, step)
        return meta

    def replay(self, step: CudaGraphStep) -> Metadata:
        meta = self.captured.get((step.bs, step.forward_mode))
        if meta is None:
            raise InvalidArgumentError("bs", f"a batch size captured for {step.forward_mode.name}", step.bs)
        self._refresh(meta, step)
        return meta

    def _refresh(self, meta: Metadata, step: CudaGraphStep) -> None:
        """Rewrite the captured views for the graph batch of this replay (already padded to its bs)."""
        b = self.backend
        bs = step.bs
        r2t, fault = b.req_to_token(), b.device_faults.buffer
        rpi, lens = step.req_pool_indices, _int32(step.seq_lens)
        enc = None if step.encoder_lens is None else _int32(step.encoder_lens)
        if isinstance(meta, DecodeMetadata):
            fill_kv(meta.kv, r2t, rpi, lens, fault, kv_start=enc)
            if meta.cross is not None:
                fill_kv(meta.cross, r2t, rpi, enc, fault)
            return
        fill_kv(
            meta.kv, r2t, rpi, lens, fault, kv_start=enc, q_lens=self.q_lens[:bs], qo_indptr=meta.qo_indptr, mask_indptr=meta.mask_indptr
        )
        if meta.cross is not None:
            fill_kv(meta.cross, r2t, rpi, enc, fault)
        if meta.custom_mask is not None:
            mask = step.spec_info.custom_mask if step.spec_info is not None else None
            if mask is None or mask.dtype != torch.bool or mask.numel() > meta.custom_mask.numel():
                raise InvalidArgumentError("spec_info.custom_mask", f"a bool mask of at most {meta.custom_mask.numel()} entries", mask)
            n = mask.numel()
            if step.seq_lens_cpu is not None:  # copy only the entries this batch's layout reaches
                n = min(n, meta.max_q_len * step.seq_lens_sum)
            meta.custom_mask[:n].copy_(mask.view(torch.uint8)[:n])


def _int32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.int32 else x.to(torch.int32)
