"""CUDA-graph state of the Triton backend: persistent buffers that captured kernels read and that
replay refreshes in place (DECODE and TARGET_VERIFY).

Per captured (mode, bs) the plan is built once, at capture, by the planner's `decode_step` /
`extend_step` over views of the buffers (attn-core's `GraphCaptures` keeps it); replay reruns the index
kernel into those views (and copies the verify mask), so the graph's pointers and grid stay valid and
no plan is rebuilt. Decode split counts follow each replay's lengths on the device; only `max_splits`
(the grid) is fixed per bs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.engine.graph_captures import GraphCaptures
from attn_core.memory.scratch import DeviceScratch
from attn_triton.metadata import KVIndex, fill_kv, split_views
from attn_triton.planner import StepPlanner
from attn_triton.plans import StepPlan


@dataclass
class Captured:
    """A captured graph's plan and the views its replays refresh: keys (and cross keys), and for
    TARGET_VERIFY the query offsets, the per-request token count and the mask with its offsets."""

    plan: StepPlan
    kv: KVIndex
    cross: Optional[KVIndex]
    qo_indptr: Optional[torch.Tensor] = None
    q_lens: Optional[torch.Tensor] = None
    max_q_len: int = 1
    mask: Optional[torch.Tensor] = None
    mask_indptr: Optional[torch.Tensor] = None


class GraphState:
    """Buffers for batches of up to `max_bs` requests and `max_num_tokens` tokens, and the captures;
    `req_to_token()` gives the request table the replays read (the backend's)."""

    def __init__(
        self, planner: StepPlanner, req_to_token: Callable[[], torch.Tensor], max_bs: int, max_num_tokens: int
    ):
        ctx = planner.ctx
        self.captures: GraphCaptures[Captured] = GraphCaptures("triton", max_bs, max_num_tokens)
        self.planner, self.req_to_token = planner, req_to_token
        dev, width = ctx.device, ctx.max_context_len

        def i32(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=dev)

        self.kv = KVIndex(i32(max_bs + 1), i32(max_bs * width))
        self.cross = KVIndex(i32(max_bs + 1), i32(max_bs * width)) if ctx.is_encoder_decoder else None
        self.qo_indptr = i32(max_bs + 1)
        self.q_lens = i32(max_bs)
        self.mask_indptr = torch.zeros(max_bs + 1, dtype=torch.int64, device=dev)
        self.mask: Optional[torch.Tensor] = None  # allocated at the first TARGET_VERIFY capture
        # the split scratch every captured size reads, reserved at its largest now (it never moves)
        self.scratch = DeviceScratch(dev)
        pairs = max(bs * planner.decode_splits(bs).max_splits for bs in range(1, max_bs + 1))
        split_views(self.scratch, pairs, 1, ctx.num_q_heads, ctx.v_head_dim)

    def capture(self, step: CudaGraphStep) -> StepPlan:
        self.captures.check_capture(step)
        if step.encoder_lens is not None and self.cross is None:
            raise InvalidArgumentError("encoder_lens", "None (the context is not encoder-decoder)", "a tensor")
        bs, planner = step.bs, self.planner
        kv = KVIndex(self.kv.indptr[: bs + 1], self.kv.indices)
        cross = KVIndex(self.cross.indptr[: bs + 1], self.cross.indices) if step.encoder_lens is not None else None
        if step.forward_mode.is_decode():
            entry = Captured(planner.decode_step(kv, cross, planner.decode_keys(bs, self.scratch)), kv, cross)
        else:
            per_req = step.tokens_per_request
            spec_info = step.spec_info
            use_mask = spec_info is not None and spec_info.custom_mask is not None
            if use_mask and self.mask is None:
                n = self.captures.max_num_tokens * planner.ctx.max_context_len
                self.mask = torch.zeros(n, dtype=torch.uint8, device=planner.ctx.device)
            self.q_lens[:bs].fill_(per_req)
            qo_indptr = self.qo_indptr[: bs + 1]
            mask = self.mask if use_mask else None
            mask_indptr = self.mask_indptr[: bs + 1] if use_mask else None
            plan = planner.extend_step(
                step.forward_mode, bs, step.num_tokens, qo_indptr, per_req, kv, cross, mask, mask_indptr
            )
            entry = Captured(plan, kv, cross, qo_indptr, self.q_lens[:bs], per_req, mask, mask_indptr)
        self.captures.add(step, entry)
        self._refresh(entry, step)
        return entry.plan

    def replay(self, step: CudaGraphStep) -> StepPlan:
        entry = self.captures.captured(step)
        self._refresh(entry, step)
        return entry.plan

    def _refresh(self, c: Captured, step: CudaGraphStep) -> None:
        """Rewrite the captured views for the graph batch of this replay (already padded to its bs)."""
        r2t, fault = self.req_to_token(), self.planner.launch.fault
        rpi, lens = step.req_pool_indices, _int32(step.seq_lens)
        enc = None if step.encoder_lens is None else _int32(step.encoder_lens)
        fill_kv(
            c.kv, r2t, rpi, lens, fault, kv_start=enc, q_lens=c.q_lens, qo_indptr=c.qo_indptr, mask_indptr=c.mask_indptr
        )
        if c.cross is not None:
            fill_kv(c.cross, r2t, rpi, enc, fault)
        if c.mask is not None:
            mask = step.spec_info.custom_mask if step.spec_info is not None else None
            if mask is None or mask.dtype != torch.bool or mask.numel() > c.mask.numel():
                raise InvalidArgumentError(
                    "spec_info.custom_mask", f"a bool mask of at most {c.mask.numel()} entries", mask
                )
            n = mask.numel()
            if step.seq_lens_cpu is not None:  # copy only the entries this batch's layout reaches
                n = min(n, c.max_q_len * step.seq_lens_sum)
            c.mask[:n].copy_(mask.view(torch.uint8)[:n])


def _int32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.int32 else x.to(torch.int32)
