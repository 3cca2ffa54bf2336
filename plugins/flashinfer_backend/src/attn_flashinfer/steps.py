"""Step inputs and the checks around them, free of FlashInfer (so they run and are tested on CPU).

`StepInputs` is what a step's plans are built from, whether it comes from an eager `ForwardBatch` or from
the arguments of a CUDA-graph capture/replay; `LayerKey` names the layer settings that need a plan of
their own; `check_context` refuses what the capabilities cannot express, before any allocation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attn_core.contract.batch import ForwardBatch, SpecInfo
from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import CudaGraphStep


@dataclass(frozen=True)
class LayerKey:
    """Layer settings FlashInfer fixes at plan time. window_left = W - 1 for a window of W keys
    (-1: full attention); logit_cap 0 = off; cross: attends to the encoder tokens; window_pool: a window
    layer whose K/V live in a `SlidingWindowKVPool` (its keys: `window_kv.build_window_kv`); chunk: the
    attention_chunk_size of a chunked local layer (0: none; its keys: `local_kv.py`); causal: False for an
    encoder-only layer (`attn_type="encoder_only"`); span: a bidirectional layer of a step with spans
    (`attn_core.contract.bidirectional`: one masked paged pass)."""

    window_left: int
    logit_cap: float
    scaling: float
    cross: bool
    window_pool: bool = False
    chunk: int = 0
    causal: bool = True
    span: bool = False

    @classmethod
    def of(cls, layer) -> LayerKey:
        cross = bool(layer.is_cross_attention)
        window = layer.sliding_window_size
        left = -1 if window is None or cross else window - 1
        causal = layer.attn_type != "encoder_only"
        span = layer.attn_type == "decoder_bidirectional"
        chunk = int(layer.attention_chunk_size or 0)
        return cls(left, float(layer.logit_cap), float(layer.scaling), cross, chunk=chunk, causal=causal, span=span)


@dataclass(frozen=True)
class Dims:
    """Per-rank head counts, head dim and dtypes every plan repeats."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype


@dataclass(frozen=True)
class GraphBuffers:
    """Fixed device buffers a CUDA-graph wrapper reads (sliced to the captured batch size)."""

    kv_indptr: torch.Tensor  # int32 [bs+1]
    kv_indices: torch.Tensor  # int32 [max pages]
    last_page_len: torch.Tensor  # int32 [bs]
    qo_indptr: Optional[torch.Tensor] = None  # int32 [bs+1] (prefill wrappers)
    custom_mask: Optional[torch.Tensor] = None  # uint8 packed mask (verify with a tree mask)
    mask_indptr: Optional[torch.Tensor] = None  # int32 [bs+1]


@dataclass
class StepInputs:
    """What a step's plans are built from, eager or from CUDA-graph arguments. Device tensors have
    `bs` rows; `*_host` are the same numbers on the host (no device sync needed)."""

    mode: ForwardMode
    bs: int
    num_tokens: int
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_host: torch.Tensor
    q_lens_host: Optional[torch.Tensor] = None  # queries per request (None for DECODE: one each)
    q_lens: Optional[torch.Tensor] = None  # the same on the device (eager extend steps)
    prefix_lens: Optional[torch.Tensor] = None
    prefix_lens_host: Optional[torch.Tensor] = None
    encoder_lens: Optional[torch.Tensor] = None
    encoder_lens_host: Optional[torch.Tensor] = None
    custom_mask: Optional[torch.Tensor] = None  # TARGET_VERIFY: flattened bool, request after request
    spans: Optional[torch.Tensor] = (
        None  # int32 [bs, 2] bidirectional spans (`attn_core.contract.bidirectional`), eager steps
    )


#: smallest head dim served over an fp8 KV cache (see `check_context`)
FP8_MIN_HEAD_DIM = 128


def check_context(ctx, name: str) -> None:
    """What `CAPABILITIES` cannot say (the base class refuses the rest: device, MLA, head dims, dtypes and
    the q/KV dtype mix): FlashInfer's kernels here need v_head_dim == head_dim, and an fp8 cache a head
    dim of at least `FP8_MIN_HEAD_DIM` (FlashInfer 0.6.6's FA2 prefill notes that its fp8 K/V loads do
    not work at head_dim 64)."""
    if ctx.v_head_dim != ctx.head_dim:
        raise UnsupportedFeatureError(name, f"v_head_dim {ctx.v_head_dim} != head_dim {ctx.head_dim}")
    if ctx.kv_dtype.itemsize == 1 and ctx.head_dim < FP8_MIN_HEAD_DIM:
        need = f"fp8 needs head_dim >= {FP8_MIN_HEAD_DIM}"
        raise UnsupportedFeatureError(name, f"kv_dtype {ctx.kv_dtype} at head_dim {ctx.head_dim} ({need})")


def check_window_pool_step(inputs: StepInputs, kv_layout: str, page_size: int, name: str) -> None:
    """What a step over a `SlidingWindowKVPool` cannot serve, refused before any plan or KV write: a
    TARGET_VERIFY custom mask (its columns are the whole sequence, the window layers' keys only the
    window) and an HND pool at page_size > 1 (window layers read the pool per token, an NHD-only view)."""
    if inputs.custom_mask is not None:
        raise UnsupportedFeatureError(name, "a sliding-window KV pool together with a custom mask (TARGET_VERIFY)")
    if kv_layout == "HND" and page_size > 1:
        raise UnsupportedFeatureError(name, f"a sliding-window KV pool with kv_layout HND at page_size {page_size}")


def check_local_step(inputs: StepInputs, kv_layout: str, page_size: int, key_page_size: int, name: str) -> None:
    """What a step of a context with chunked local layers cannot serve, refused before any plan or KV
    write: a TARGET_VERIFY custom mask (its columns are the whole sequence, a virtual request's keys one
    chunk) and an HND pool when the local key lists are per token (`key_page_size` 1, see
    `local_kv.local_page_size`) at page_size > 1 (an NHD-only view)."""
    if inputs.custom_mask is not None:
        raise UnsupportedFeatureError(name, "chunked local attention together with a custom mask (TARGET_VERIFY)")
    if kv_layout == "HND" and page_size > 1 and key_page_size == 1:
        raise UnsupportedFeatureError(
            name, f"chunked local attention with kv_layout HND at page_size {page_size} (chunks off the pages)"
        )


def refuse_while_capturing(device: torch.device, what: str, setting: object) -> None:
    """A typed error (naming "layer") when a plan for a layer setting first met in `forward` would be made
    while a CUDA graph is being captured on `device` (FlashInfer's public plan syncs): `what` names the
    setting ("layer settings", "layer scalings"), `setting` is its value."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        expected = f"{what} met before CUDA-graph capture (run the captured batch once eagerly first)"
        raise InvalidArgumentError("layer", expected, setting)


def eager_inputs(b: ForwardBatch, r2t: torch.Tensor) -> StepInputs:
    """The inputs of an eager step, from a batch the base class validated."""
    mode, bs = b.forward_mode, b.batch_size
    extend = not mode.is_decode()
    custom_mask = None
    if mode.is_target_verify() and b.spec_info is not None and b.spec_info.custom_mask is not None:
        custom_mask = verify_mask(b.spec_info, b.extend_seq_lens_cpu, b.seq_lens_cpu, pad=False)
    return StepInputs(
        mode=mode,
        bs=bs,
        num_tokens=b.num_tokens,
        req_to_token=r2t,
        req_pool_indices=b.req_pool_indices,
        seq_lens=b.seq_lens,
        seq_lens_host=b.seq_lens_cpu,
        q_lens_host=b.extend_seq_lens_cpu if extend else None,
        q_lens=b.extend_seq_lens if extend else None,
        prefix_lens=b.extend_prefix_lens if extend else None,
        prefix_lens_host=b.extend_prefix_lens_cpu if extend else None,
        encoder_lens=b.encoder_lens,
        encoder_lens_host=b.encoder_lens_cpu,
        custom_mask=custom_mask,
        spans=b.bidirectional_spans,
    )


def graph_inputs(
    r2t: torch.Tensor, step: CudaGraphStep, num_tokens: int, seq_host: torch.Tensor, enc_host
) -> StepInputs:
    """The inputs of a graph batch: `step` with `num_tokens` new tokens (the captured count at replay)
    and host copies of its seq_lens / encoder_lens (`[step.bs]`)."""
    mode, bs = step.forward_mode, step.bs
    per_req = num_tokens // bs
    q_lens = None if mode.is_decode() else torch.full((bs,), per_req, dtype=torch.int32)
    custom_mask = None
    if mode.is_target_verify() and step.spec_info is not None and step.spec_info.custom_mask is not None:
        custom_mask = verify_mask(step.spec_info, q_lens, seq_host, pad=True)
    return StepInputs(
        mode=mode,
        bs=bs,
        num_tokens=num_tokens,
        req_to_token=r2t,
        req_pool_indices=step.req_pool_indices,
        seq_lens=step.seq_lens,
        seq_lens_host=seq_host.to(torch.int32),
        q_lens_host=q_lens,
        encoder_lens=step.encoder_lens,
        encoder_lens_host=enc_host,
        custom_mask=custom_mask,
    )


def verify_mask(spec: SpecInfo, q_lens_host: torch.Tensor, seq_lens_host: torch.Tensor, pad: bool) -> torch.Tensor:
    """The step's tree mask as FlashInfer reads it: per request a row-major bool `[q_len, seq_len]`,
    concatenated (SpecInfo's layout, so `mask_indptr` is implied). In a CUDA-graph batch the padding rows
    have no mask of their own: `pad` appends all-visible entries for them; and a graph's static mask
    buffer (`CudaGraphRunner`'s, sized for its largest batch) holds the step's mask at its start: `pad`
    takes its first entries."""
    need = int((q_lens_host.to(torch.int64) * seq_lens_host.to(torch.int64)).sum())
    mask = spec.custom_mask.reshape(-1)
    if mask.dtype != torch.bool:
        raise InvalidArgumentError("spec_info.custom_mask", "a bool tensor", mask.dtype)
    if mask.numel() == need:
        return mask
    if pad and mask.numel() < need:
        return torch.cat([mask, torch.ones(need - mask.numel(), dtype=torch.bool, device=mask.device)])
    if pad:
        return mask[:need]
    raise InvalidArgumentError(
        "spec_info.custom_mask", f"{need} entries (sum of q_len * seq_len over requests)", mask.numel()
    )
