"""The Triton backend's plans: what `build_forward_metadata` decides once per step, and what each layer
call then runs.

A `StepPlan` (the backend's per-step metadata) holds one *path* per kind of layer the step can serve:
`plain` (self attention over the step's keys), and where the step has them `cross` (encoder tokens),
`local` (chunked local layers of the context's chunk size), `window` (window layers kept in a
`SlidingWindowKVPool`), `cascade` (layers that split into a shared-prefix pass and a suffix pass,
`attn_core.batching.cascade`) and, in extend-like steps, `noncausal` (encoder-only layers) and `spans`
(bidirectional layers of a batch with spans, `attn_core.contract.bidirectional`). `path_for(layer, sinks)` picks
a layer's path with a few attribute tests (typed errors for a layer the step cannot serve, before any KV
write); the path's `run` makes the launches (`launchers.py`). Every path carries `path`, a short name of
the kernels it runs (e.g. "decode", "verify (q_len 4)", "mla-decode", "extend+decode (mixed split)",
"cascade: decode + extend prefix").

Which kernel a path runs is decided when the plan is built, from the step (mode, batch size, tokens,
longest query) and the context (MLA, the pool's dtype):
- DECODE: the split-KV decode kernel (`DecodePath`); absorbed MLA over a pool of the q dtype: the MLA
  kernel (`MLAPath`, q_len 1, the same splits).
- extend-like: MHA/GQA TARGET_VERIFY / DRAFT_EXTEND steps whose requests all carry the same 1..16 tokens
  (`kernels.verify.verify_q_len`) the verify kernel, absorbed MLA with 2..16 such tokens the MLA kernel
  (folded), every other step the extend kernel (`ExtendPath`). Cross, local, cascade, encoder-only and
  bidirectional layers always take the extend kernel (the decode kernel in DECODE).
- MIXED with the split on: `mixed.MixedPath` (decodes through the decode kernel, the rest through the
  extend kernel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from attn_core.batching.cascade import splits_into_cascade
from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.layer import AttentionLayer
from attn_core.memory.window_pool import SlidingWindowKVPool
from attn_triton.launchers import Launch, launch_decode, launch_extend, launch_mla, merge_prefix_pass
from attn_triton.metadata import CascadeKeys, KVIndex, Splits

Output = object  # `[T, Hq*Dv]`, or (that, LSE `[T, Hq]` float32) with return_lse


class Path(Protocol):
    """One layer's launches in one step: `run(q, k_buf, v_buf, layer, sinks, return_lse)` with q
    `[T, Hq, D]` and the layer's pool buffers (K/V of the new tokens already written) returns the output
    `[T, Hq*Dv]` (and the LSE with return_lse); `path` names the kernels it runs."""

    path: str

    def run(
        self, q, k_buf, v_buf, layer: AttentionLayer, sinks: Optional[torch.Tensor], return_lse: bool
    ) -> Output: ...


@dataclass(frozen=True)
class DecodeKeys:
    """A DECODE step's split parameters and split scratch (part_o `[bs, Hq, max_splits, Dv]`, part_lse
    `[bs, Hq, max_splits]` float32), shared by every decode path of the step."""

    splits: Splits
    part_o: torch.Tensor
    part_lse: torch.Tensor


class DecodePath:
    """The split-KV decode kernel over `keys` (one query per request) with the step's splits and scratch.
    `attend` returns the raw (o `[T, Hq, Dv]`, LSE or None) pair (a cascade's suffix pass asks for the LSE
    whatever the caller wants); `run` the layer's output."""

    path = "decode"

    def __init__(self, ln: Launch, keys: KVIndex, split: DecodeKeys):
        self.ln, self.keys, self.split = ln, keys, split

    def attend(self, q, k_buf, v_buf, layer, sinks, want_lse: bool):
        T, hq, dv = q.shape[0], layer.num_q_heads, layer.v_head_dim
        o = q.new_empty((T, hq, dv))
        lse = torch.empty((T, hq), dtype=torch.float32, device=q.device) if want_lse else None
        s = self.split
        launch_decode(self.ln, q, k_buf, v_buf, o, lse, layer, self.keys, s.splits, s.part_o, s.part_lse, sinks)
        return o, lse

    def run(self, q, k_buf, v_buf, layer, sinks, return_lse):
        o, lse = self.attend(q, k_buf, v_buf, layer, sinks, return_lse)
        o = o.view(q.shape[0], layer.num_q_heads * layer.v_head_dim)
        return (o, lse) if return_lse else o


class MLAPath:
    """The absorbed-MLA kernel over `keys`: DECODE (q_len 1, with the step's decode splits) or `q_len`
    2..16 folded tokens per request (with the step's custom mask)."""

    def __init__(
        self,
        ln: Launch,
        keys: KVIndex,
        q_len: int,
        split: Optional[DecodeKeys] = None,
        qo_indptr: Optional[torch.Tensor] = None,
        custom_mask: Optional[torch.Tensor] = None,
        mask_indptr: Optional[torch.Tensor] = None,
    ):
        self.ln, self.keys, self.q_len, self.split = ln, keys, q_len, split
        self.qo_indptr, self.custom_mask, self.mask_indptr = qo_indptr, custom_mask, mask_indptr
        self.path = "mla-decode" if split is not None else f"mla-verify (q_len {q_len})"

    def run(self, q, k_buf, v_buf, layer, sinks, return_lse):
        s = self.split
        return launch_mla(
            self.ln,
            q,
            k_buf,
            layer,
            self.keys,
            sinks,
            return_lse,
            q_len=self.q_len,
            splits=None if s is None else s.splits,
            part_o=None if s is None else s.part_o,
            part_lse=None if s is None else s.part_lse,
            qo_indptr=self.qo_indptr,
            custom_mask=self.custom_mask,
            mask_indptr=self.mask_indptr,
        )


class ExtendPath:
    """The extend kernel (queries `qo_indptr` / `max_q_len` over `keys`; non-causal for cross and
    encoder-only layers; with `spans`, a bidirectional layer's spans), or with `verify_len` (every request
    carries that many tokens) the verify kernel."""

    def __init__(
        self,
        ln: Launch,
        qo_indptr: torch.Tensor,
        max_q_len: int,
        keys: KVIndex,
        *,
        causal: bool = True,
        custom_mask: Optional[torch.Tensor] = None,
        mask_indptr: Optional[torch.Tensor] = None,
        verify_len: Optional[int] = None,
        spans: Optional[torch.Tensor] = None,
        path: Optional[str] = None,
    ):
        self.ln, self.qo_indptr, self.max_q_len, self.keys = ln, qo_indptr, max_q_len, keys
        self.causal, self.custom_mask, self.mask_indptr, self.verify_len = causal, custom_mask, mask_indptr, verify_len
        self.spans = spans
        self.path = path or ("extend" if verify_len is None else f"verify (q_len {verify_len})")

    def attend(self, q, k_buf, v_buf, layer, sinks, want_lse: bool):
        return launch_extend(
            self.ln,
            q,
            k_buf,
            v_buf,
            layer,
            self.qo_indptr,
            self.keys,
            self.max_q_len,
            causal=self.causal,
            custom_mask=self.custom_mask,
            mask_indptr=self.mask_indptr,
            sinks=sinks,
            want_lse=want_lse,
            verify_len=self.verify_len,
            spans=self.spans,
        )

    def run(self, q, k_buf, v_buf, layer, sinks, return_lse):
        o, lse = self.attend(q, k_buf, v_buf, layer, sinks, return_lse)
        o = o.view(q.shape[0], layer.num_q_heads * layer.v_head_dim)
        return (o, lse) if return_lse else o


class CascadePath:
    """A cascade layer: the suffix pass (`suffix`: a `DecodePath` or `ExtendPath` over each request's keys
    after the shared prefix, with its LSE) and the prefix pass (every query over the shared keys, one
    extend launch), merged by LSE."""

    def __init__(self, ln: Launch, keys: CascadeKeys, suffix):
        self.ln, self.keys, self.suffix = ln, keys, suffix
        self.path = f"cascade: {suffix.path} + extend prefix"

    def run(self, q, k_buf, v_buf, layer, sinks, return_lse):
        o, lse = self.suffix.attend(q, k_buf, v_buf, layer, None, True)
        o, lse = merge_prefix_pass(self.ln, q, k_buf, v_buf, layer, self.keys, o, lse)
        o = o.view(q.shape[0], layer.num_q_heads * layer.v_head_dim)
        return (o, lse) if return_lse else o


class StepPlan:
    """One step's plan: `decode` (a DECODE step's plan; else extend-like) and its paths (see the module
    docstring; extend-like steps also hold `noncausal`, the extend kernel without a causal mask for
    encoder-only layers, and, when the batch has bidirectional spans, `spans` for its bidirectional
    layers). `kv`: the step's main key index (what `plain` reads; tests and benchmarks read it)."""

    def __init__(
        self,
        decode: bool,
        kv: KVIndex,
        plain: Path,
        *,
        cross: Optional[Path] = None,
        local: Optional[Path] = None,
        chunk: Optional[int] = None,
        window: Optional[Path] = None,
        window_pool: Optional[SlidingWindowKVPool] = None,
        cascade: Optional[Path] = None,
        noncausal: Optional[Path] = None,
        spans: Optional[Path] = None,
    ):
        self.decode, self.kv, self.plain = decode, kv, plain
        self.cross, self.local, self.chunk = cross, local, chunk
        self.window, self.window_pool, self.cascade = window, window_pool, cascade
        self.noncausal, self.spans = noncausal, spans

    @property
    def path(self) -> str:
        """The kernels a plain self-attention layer of this step runs."""
        return self.plain.path

    def path_for(self, layer: AttentionLayer, sinks: Optional[torch.Tensor] = None) -> Path:
        """The path of `layer` (with `sinks`, a cascade step runs its layers unsplit). Typed errors for a
        cross-attention layer without encoder tokens and for a chunked local layer of another chunk size
        than the one the step was built for."""
        if self.cascade is not None and sinks is None and splits_into_cascade(layer):
            return self.cascade
        if layer.attention_chunk_size is not None:
            if self.local is None or layer.attention_chunk_size != self.chunk:
                raise InvalidArgumentError(
                    f"layer {layer.layer_id} attention_chunk_size",
                    f"the context's attention_chunk_size ({self.chunk}), for which the step's metadata is built",
                    layer.attention_chunk_size,
                )
            return self.local
        if self.window is not None and self.window_pool.is_window_layer(layer.layer_id):
            return self.window
        if layer.is_cross_attention:
            if self.cross is None:
                raise InvalidArgumentError(
                    "forward_batch.encoder_lens", "encoder lengths for a cross-attention layer", None
                )
            return self.cross
        kind = layer.attn_type  # only plain self-attention layers have another kind than "decoder"
        if kind != "decoder":
            if kind == "encoder_only" and self.noncausal is not None:
                return self.noncausal
            if kind == "decoder_bidirectional" and self.spans is not None:
                return self.spans
        return self.plain

    def describe(self, layer: AttentionLayer, sinks: Optional[torch.Tensor] = None) -> str:
        """The kernels `layer` runs in this step (`path_for(layer, sinks).path`)."""
        return self.path_for(layer, sinks).path
