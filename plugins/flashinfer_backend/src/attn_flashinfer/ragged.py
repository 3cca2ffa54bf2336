"""The ragged op (`attn_core.contract.ragged`) on FlashInfer's `BatchPrefillWithRaggedKVCacheWrapper` (FA2 kernels).

Every packed sequence is one "request" whose queries and keys are its own rows: the wrapper is planned with
cu_seqlens as both qo_indptr and kv_indptr (the host copy: FlashInfer plans on the host, no sync), causal
as the batch says, and the softmax scale (FlashInfer fixes it at plan time), so the backend plans one
wrapper per scale per batch (`RaggedPlan`), the first time a layer with that scale runs it.

Head dims: FlashInfer's FA2 prefill kernels work only at head dims that are multiples of 64 (64 / 128 /
256 here; other widths read out of bounds or give wrong results: flashinfer-ai/flashinfer#4299), while
ViTs use 72 / 80 / 96. `padded_head_dim` rounds such a width up to the next of 64 / 128 / 256; q, k and v
are zero-padded to it (the extra channels add 0 to every score and produce 0 columns), the scale stays
the true head dim's, and the output is cut back. The copies cost what they cost: the benchmark
(benchmarks/ragged_vs_peers.py) times FlashInfer on pre-padded inputs as its peer, and this path with them.

FlashInfer's LSE is base 2; `run_ragged_op` returns it in natural log (docs/design.md §3.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Union

import torch
import torch.nn.functional as F

from attn_core.contract.ragged import RaggedBatch
from attn_flashinfer.steps import Dims

LN2 = math.log(2.0)
#: the head dims FlashInfer's FA2 prefill kernels serve
NATIVE_HEAD_DIMS = (64, 128, 256)


def padded_head_dim(head_dim: int) -> int:
    """The FA2 head dim a ragged call of `head_dim` channels runs at: the smallest of 64 / 128 / 256 that
    holds it.

    >>> [padded_head_dim(d) for d in (64, 72, 80, 96, 128, 136, 256)]
    [64, 128, 128, 128, 128, 256, 256]
    """
    for d in NATIVE_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head_dim {head_dim} > {NATIVE_HEAD_DIMS[-1]}")


@dataclass(eq=False)
class RaggedPlan:
    """A `RaggedBatch`'s planned wrappers, by softmax scale (the backend's `ragged_metadata`)."""

    batch: RaggedBatch
    wrappers: dict[float, object] = field(default_factory=dict)


def plan_ragged_op(wrapper, ragged: RaggedBatch, dims: Dims, scaling: float) -> None:
    """Plan `wrapper` (a `BatchPrefillWithRaggedKVCacheWrapper`) for the sequences of `ragged`: each over its
    own rows, causal as `ragged.causal`, scores scaled by `scaling`, at the padded head dim."""
    indptr = ragged.cu_seqlens_cpu.to(torch.int32)
    d = padded_head_dim(dims.head_dim)
    wrapper.plan(
        indptr,
        indptr,
        dims.num_q_heads,
        dims.num_kv_heads,
        d,
        causal=ragged.causal,
        sm_scale=scaling,
        q_data_type=dims.q_dtype,
        kv_data_type=dims.q_dtype,
        non_blocking=True,
    )


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.shape[-1] == width:
        return x if x.stride(-1) == 1 else x.contiguous()
    return F.pad(x, (0, width - x.shape[-1]))


def run_ragged_op(
    wrapper, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Run a planned wrapper: q `[T, Hq, D]`, k / v `[T, Hkv, D]` → `[T, Hq·D]` (and the natural-log LSE
    `[T, Hq]` float32), padding the channels to `padded_head_dim(D)` around FlashInfer's call."""
    T, hq, d = q.shape
    width = padded_head_dim(d)
    res = wrapper.run(_padded(q, width), _padded(k, width), _padded(v, width), return_lse=return_lse)
    o, lse = res if return_lse else (res, None)
    if width != d:
        o = o[..., :d]
    o = o.reshape(T, hq * d)
    return (o, lse * LN2) if return_lse else o


__all__ = ["NATIVE_HEAD_DIMS", "RaggedPlan", "padded_head_dim", "plan_ragged_op", "run_ragged_op"]
