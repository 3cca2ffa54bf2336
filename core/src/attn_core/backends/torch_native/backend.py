"""Reference attention in plain torch: correct first, vectorized over the batch.

Per step, the metadata holds padded tables: for each request its query rows `[bs, Lq]`, its key slots
`[bs, W]` and the base visibility mask `[bs, Lq, W]` (valid ∧ (causal or custom mask)). A layer gathers
K/V of those slots, masks (plus its sliding window), and runs a softmax in float32, chunked over the
query axis so the score tensor stays under `max_score_bytes`. A chunked local layer (attention_chunk_size
C) further keeps the keys at or after the start of the query's chunk, (q_pos // C) * C. A window layer
kept in a `SlidingWindowKVPool` gathers its keys at their window slots (released keys, outside every
window, translate to the dummy slot and are masked). K/V are read by slot from either pool layout
(NHD or HND). A cascade step (`attn_core.batching.cascade`) adds the tables of its prefix pass (all queries
over the shared keys) and suffix pass (each request over keys cascade_prefix_len … seq_len-1); plain
causal layers run both and merge them by LSE. In CUDA-graph mode the widths are fixed
(W = max_context_len) and replay rewrites the tables in place.

Bounds: every gather clamps its indices (request rows into the table, columns into its width, key
slots into the pool, query rows into the step's tokens), so a batch the host checks could not see
through (device tensors on a GPU at validation "basic", a graph replay) never reads out of bounds: a
request row outside the table gives that request no keys, a slot outside the pool reads nothing (the
key is masked), and the step check (`attn_core.ops.step_checks`) or, in graph replays, these builds
record the fault. Masked keys add exactly nothing: V entries that are not finite are zeroed before the
P·V product and a query that *sees* such a key gets NaN (so 0 · Inf never turns a masked key into NaN).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Optional

import torch

from attn_core.backends.torch_native.ragged import dense_ragged_attention
from attn_core.backends.torch_native.spec import CAPABILITIES
from attn_core.batching.cascade import splits_into_cascade
from attn_core.contract.backend import AttentionBackend
from attn_core.contract.batch import ForwardBatch, SpecInfo, batch_field
from attn_core.contract.bidirectional import span_visible
from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.contract.layer import AttentionLayer, AttentionType
from attn_core.memory.pools import kv_scales, token_rows
from attn_core.memory.window_pool import window_pool_of
from attn_core.ops.device_faults import DeviceFaultKind
from attn_core.ops.kv_write import record_first
from attn_core.ops.merge_state import merge_state


@dataclass
class _KeyTable:
    slots: torch.Tensor  # [bs, W] int64 KV slots (0 where padded)
    allowed: torch.Tensor  # [bs, Lq, W] bool, before the sliding window


@dataclass
class _Metadata:
    num_tokens: int
    q_rows: torch.Tensor  # [bs, Lq] int64 row of q per (request, query); num_tokens where padded
    q_pos: torch.Tensor  # [bs, Lq] int64 position of that query among the request's decoder keys
    self_keys: _KeyTable
    cross_keys: Optional[_KeyTable] = None
    #: cascade steps (`attn_core.batching.cascade`): (prefix pass, suffix pass) metadata
    cascade: Optional[tuple[_Metadata, _Metadata]] = None
    #: [bs] int64 keys of each request in self_keys (non-causal and bidirectional layers' visibility)
    kv_lens: Optional[torch.Tensor] = None
    #: [bs, 2] int64 bidirectional spans of the batch (`attn_core.contract.bidirectional`), None without
    spans: Optional[torch.Tensor] = None
    #: a TARGET_VERIFY custom mask decides the self-attention visibility of every layer
    custom_mask: bool = False


def _copy_into(dst, src) -> None:
    """In-place refresh of graph metadata (same shapes)."""
    for f in fields(dst):
        a, b = getattr(dst, f.name), getattr(src, f.name)
        if isinstance(a, torch.Tensor):
            a.copy_(b)
        elif is_dataclass(a):
            _copy_into(a, b)


def _build_metadata(
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    q_lens: torch.Tensor,
    q_start: torch.Tensor,
    num_tokens: int,
    width: int,
    q_width: int,
    encoder_lens: Optional[torch.Tensor],
    encoder_width: int,
    spec_info: Optional[SpecInfo],
    use_custom_mask: bool,
    kv_start: int = 0,
    num_slots: Optional[int] = None,
    fault: Optional[torch.Tensor] = None,
) -> _Metadata:
    """The padded tables of the module docstring; with `kv_start` s each request's keys are its
    decoder keys s … seq_len-1 (positions counted from s). Every gather is clamped (see the module
    docstring); with `fault`, request rows outside the table and key slots outside [0, num_slots) are
    recorded in that fault word (device ops, no sync)."""
    dev = req_to_token.device
    max_col = req_to_token.shape[1] - 1
    rows_in = req_pool_indices.to(torch.int64)
    row_ok = (rows_in >= 0) & (rows_in < req_to_token.shape[0])
    record_first(fault, DeviceFaultKind.REQUEST_ROW, ~row_ok)
    rows = torch.where(row_ok, rows_in, 0)[:, None]
    seq = torch.where(row_ok, seq_lens.to(torch.int64), 0) - kv_start
    qi = torch.arange(q_width, device=dev)
    q_valid = (qi[None, :] < q_lens.to(torch.int64)[:, None]) & row_ok[:, None]
    q_rows = q_start.to(torch.int64)[:, None] + qi
    q_valid = q_valid & (q_rows >= 0) & (q_rows < num_tokens)
    q_rows = torch.where(q_valid, q_rows, num_tokens)
    q_pos = (seq - q_lens.to(torch.int64))[:, None] + qi

    kj = torch.arange(width, device=dev)
    kv_valid = kj[None, :] < seq[:, None]
    enc = torch.zeros_like(seq) if encoder_lens is None else encoder_lens.to(torch.int64)
    cols = (enc[:, None] + kv_start + kj).clamp(0, max_col)
    slots = req_to_token[rows, cols].to(torch.int64)
    if num_slots is not None:
        in_pool = (slots >= 0) & (slots < num_slots)
        record_first(fault, DeviceFaultKind.SLOT, (kv_valid & ~in_pool).any(1))
        kv_valid = kv_valid & in_pool
    slots = torch.where(kv_valid, slots, 0)
    allowed = kv_valid[:, None, :] & q_valid[:, :, None]
    if (
        use_custom_mask
        and spec_info is not None
        and spec_info.custom_mask is not None
        and spec_info.mask_indptr is not None
    ):
        mask, indptr = spec_info.custom_mask, spec_info.mask_indptr.to(torch.int64)
        flat = indptr[: seq.shape[0], None, None] + qi[None, :, None] * seq[:, None, None] + kj[None, None, :]
        allowed = allowed & mask[flat.clamp(0, max(mask.numel() - 1, 0))]
    else:
        allowed = allowed & (kj[None, None, :] <= q_pos[:, :, None])
    self_keys = _KeyTable(slots, allowed)
    meta = _Metadata(num_tokens=num_tokens, q_rows=q_rows, q_pos=q_pos, self_keys=self_keys, kv_lens=seq)
    meta.custom_mask = use_custom_mask

    if encoder_lens is not None:
        ej = torch.arange(encoder_width, device=dev)
        e_valid = ej[None, :] < enc[:, None]
        e_slots = req_to_token[rows, ej.clamp(max=max_col)[None, :]].to(torch.int64)
        if num_slots is not None:
            e_valid = e_valid & (e_slots >= 0) & (e_slots < num_slots)
        e_slots = torch.where(e_valid, e_slots, 0)
        meta.cross_keys = _KeyTable(e_slots, e_valid[:, None, :] & q_valid[:, :, None])
    return meta


def _prefix_metadata(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, p: int, num_tokens: int) -> _Metadata:
    """A cascade's prefix pass: all `num_tokens` queries as one group over the first request's first
    `p` key slots (shared by every request), every key visible to every query."""
    dev = req_to_token.device
    row = req_pool_indices[:1].to(torch.int64).clamp(0, req_to_token.shape[0] - 1)
    slots = req_to_token[row, :p].to(torch.int64)  # [1, p]
    q_rows = torch.arange(num_tokens, device=dev)[None, :]
    allowed = torch.ones((1, num_tokens, p), dtype=torch.bool, device=dev)
    return _Metadata(num_tokens=num_tokens, q_rows=q_rows, q_pos=q_rows + p, self_keys=_KeyTable(slots, allowed))


class TorchNativeBackend(AttentionBackend[_Metadata]):
    """The reference backend. Option `max_score_bytes` bounds the float32 score tensor of one chunk."""

    name = "torch_native"
    capabilities = CAPABILITIES

    def __init__(self, ctx, *, max_score_bytes: int = 256 << 20, **options):
        super().__init__(ctx, **options)
        if max_score_bytes < 1:
            raise InvalidArgumentError("max_score_bytes", ">= 1", max_score_bytes)
        self.max_score_bytes = max_score_bytes
        self._graph_metadata: Optional[dict[tuple[int, ForwardMode], _Metadata]] = None

    # ---- metadata --------------------------------------------------------------------------
    def build_forward_metadata(self, forward_batch: ForwardBatch) -> _Metadata:
        b = forward_batch
        if b.forward_mode.is_decode():
            q_lens = torch.ones_like(b.seq_lens)
            q_start = torch.arange(b.batch_size, device=b.device, dtype=torch.int32)
            q_width = 1
        else:
            q_lens, q_start = (
                batch_field(b.extend_seq_lens, "extend_seq_lens"),
                batch_field(b.extend_start_loc, "extend_start_loc"),
            )
            q_width = max(int(batch_field(b.extend_seq_lens_cpu, "extend_seq_lens_cpu").max()), 1)
        args: dict[str, Any] = dict(
            req_to_token=self.req_to_token(b),
            req_pool_indices=b.req_pool_indices,
            seq_lens=b.seq_lens,
            q_lens=q_lens,
            q_start=q_start,
            num_tokens=b.num_tokens,
            width=max(b.max_seq_len, 1),
            q_width=q_width,
            encoder_lens=b.encoder_lens,
            encoder_width=max(int(b.encoder_lens_cpu.max()), 1) if b.encoder_lens_cpu is not None else 0,
            spec_info=b.spec_info,
            use_custom_mask=_has_custom_mask(b.forward_mode, b.spec_info),
            num_slots=self.kv_pool(b).num_slots,
        )
        meta = _build_metadata(**args)
        if b.bidirectional_spans is not None:
            meta.spans = b.bidirectional_spans.to(torch.int64)
        p = b.cascade_prefix_len
        if p:
            suffix = _build_metadata(**{**args, "width": max(b.max_seq_len - p, 1)}, kv_start=p)
            meta.cascade = (_prefix_metadata(args["req_to_token"], b.req_pool_indices, p, b.num_tokens), suffix)
        return meta

    # ---- CUDA graphs -------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self._graph_metadata = {}

    def _graph_build(self, step: CudaGraphStep, num_tokens: int) -> _Metadata:
        if self._graph_metadata is None:
            raise InvalidArgumentError("init_cuda_graph_state", "called before capture/replay", None)
        mode, bs = step.forward_mode, step.bs
        if not (mode.is_decode() or mode.is_target_verify()):
            raise UnsupportedFeatureError(self.name, f"CUDA graphs for {mode.name}")
        per_req = num_tokens // bs
        dev = step.seq_lens.device
        width = self.ctx.max_context_len
        return _build_metadata(
            req_to_token=self.req_to_token(),
            req_pool_indices=step.req_pool_indices,
            seq_lens=step.seq_lens,
            q_lens=torch.full((bs,), per_req, dtype=torch.int32, device=dev),
            q_start=torch.arange(0, num_tokens, per_req, dtype=torch.int32, device=dev),
            num_tokens=num_tokens,
            width=width,
            q_width=per_req,
            encoder_lens=step.encoder_lens,
            encoder_width=width,
            spec_info=step.spec_info,
            use_custom_mask=_has_custom_mask(mode, step.spec_info),
            num_slots=self.ctx.token_to_kv_pool.num_slots if self.ctx.token_to_kv_pool is not None else None,
            fault=self.device_faults.buffer,
        )

    def capture_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        graphs = self._graph_metadata
        if graphs is None:
            raise InvalidArgumentError("init_cuda_graph_state", "called before capture/replay", None)
        if step.num_tokens is None:
            raise InvalidArgumentError(
                "num_tokens", f"a fixed token count for a {step.forward_mode.name} capture", None
            )
        meta = self._graph_build(step, step.num_tokens)
        graphs[(step.bs, step.forward_mode)] = meta
        self.bind_graph_metadata(meta, step)

    def replay_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        meta = self._graph_metadata.get((step.bs, step.forward_mode)) if self._graph_metadata is not None else None
        if meta is None:
            raise InvalidArgumentError("bs", f"a batch size captured for {step.forward_mode.name}", step.bs)
        if step.num_tokens not in (None, meta.num_tokens):
            raise InvalidArgumentError("num_tokens", f"{meta.num_tokens} as captured for bs={step.bs}", step.num_tokens)
        fresh = self._graph_build(step, meta.num_tokens)
        _copy_into(meta, fresh)
        self.bind_graph_metadata(meta, step)

    # ---- attention ---------------------------------------------------------------------------
    def describe_path(self, layer: AttentionLayer, forward_batch: ForwardBatch) -> str:
        """The path `_forward` takes for `layer` on this step (`attn_core.contract.debug_paths`): the cascade's two
        passes merged by LSE, or one gather of each request's key slots with the masks that apply, the
        compute dtype and how many query chunks the score budget (`max_score_bytes`) splits it into."""
        meta: Optional[_Metadata] = self.forward_metadata
        if meta is None:
            return "no tokens: empty output"
        cd = "float64" if self.ctx.dtype in (torch.float32, torch.float64) else "float32"
        if meta.cascade is not None and splits_into_cascade(layer):
            return f"cascade: shared-prefix pass + per-request suffix pass (gather + einsum, {cd}), merged by LSE"
        keys = meta.cross_keys if layer.is_cross_attention else meta.self_keys
        masks = ["encoder keys" if layer.is_cross_attention else "causal self keys"]
        if layer.sliding_window_size is not None and not layer.is_cross_attention:
            masks.append(f"window {layer.sliding_window_size}")
        if layer.attention_chunk_size is not None:
            masks.append(f"chunked local {layer.attention_chunk_size}")
        window_pool = window_pool_of(self.ctx.token_to_kv_pool)
        if window_pool is not None and window_pool.is_window_layer(layer.layer_id):
            masks.append("slots translated to the window pool")
        bs, q_width = meta.q_rows.shape
        width = keys.slots.shape[1] if keys is not None else 0
        chunks = -(-q_width // max(1, self.max_score_bytes // max(1, bs * layer.num_q_heads * width * 4)))
        return (
            f"gather + einsum over each request's key slots ({', '.join(masks)}; {cd}; "
            f"{chunks} query chunk(s) of {q_width})"
        )

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **extras)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **extras)

    def _forward(self, q, k, v, layer, batch, save_kv_cache, sinks=None, return_lse=False):
        pool = self.save_kv(k, v, layer, batch) if save_kv_cache else self.kv_pool(batch)
        meta: _Metadata = self.forward_metadata
        if meta.cascade is not None and sinks is None and splits_into_cascade(layer):
            return self._cascade(q, layer, pool, meta.cascade, return_lse)
        keys = meta.cross_keys if layer.is_cross_attention else meta.self_keys
        if keys is None:
            raise InvalidArgumentError(
                "forward_batch.encoder_lens", "encoder lengths for a cross-attention layer", None
            )
        allowed = keys.allowed
        if not layer.is_cross_attention and not meta.custom_mask:
            allowed = _attn_type_visibility(layer.attn_type, allowed, meta)
        if layer.sliding_window_size is not None and not layer.is_cross_attention:
            kj = torch.arange(allowed.shape[-1], device=allowed.device)
            allowed = allowed & (kj[None, None, :] > meta.q_pos[:, :, None] - layer.sliding_window_size)
        if layer.attention_chunk_size is not None:  # chunked local: keys of the query's own chunk only
            kj = torch.arange(allowed.shape[-1], device=allowed.device)
            chunk_start = (
                torch.div(meta.q_pos, layer.attention_chunk_size, rounding_mode="floor") * layer.attention_chunk_size
            )
            allowed = allowed & (kj[None, None, :] >= chunk_start[:, :, None])
        slots = keys.slots
        window_pool = window_pool_of(pool)
        if window_pool is not None and window_pool.is_window_layer(layer.layer_id):  # keys live in the window pool
            slots = window_pool.window_slots(slots).long()
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        keys = token_rows(k_buf, slots, pool.kv_layout, pool.page_size)  # [bs, W, Hkv, D]
        vals = token_rows(v_buf, slots, pool.kv_layout, pool.page_size)
        return _attention(
            q, keys, vals, allowed, meta, layer, sinks, return_lse, self.max_score_bytes, kv_scales(layer, pool)
        )

    # ---- the ragged op ----------------------------------------------------------------------------
    def forward_ragged(self, q, k, v, ragged, *, scaling, return_lse):
        return dense_ragged_attention(q, k, v, ragged, scaling, return_lse, self.max_score_bytes)

    def _cascade(self, q, layer, pool, passes: tuple[_Metadata, _Metadata], return_lse: bool):
        """Prefix pass (every query over the shared keys) and suffix pass (each request over its own
        keys), merged by LSE."""
        results = []
        for meta in passes:
            k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
            keys = token_rows(k_buf, meta.self_keys.slots, pool.kv_layout, pool.page_size)
            vals = token_rows(v_buf, meta.self_keys.slots, pool.kv_layout, pool.page_size)
            scales = kv_scales(layer, pool)
            o, lse = _attention(
                q, keys, vals, meta.self_keys.allowed, meta, layer, None, True, self.max_score_bytes, scales
            )
            results.append((o.view(q.shape[0], layer.num_q_heads, layer.v_head_dim), lse))
        (o_p, lse_p), (o_s, lse_s) = results
        o, lse = merge_state(o_p, lse_p, o_s, lse_s)
        o = o.flatten(1)  # [T, H * Dv] (T may be 0)
        return (o, lse) if return_lse else o


def _attn_type_visibility(attn_type: AttentionType, causal: torch.Tensor, meta: _Metadata) -> torch.Tensor:
    """Self-attention visibility `[bs, Lq, W]` of a layer of `attn_type`: `causal` (the metadata's) for
    decoder layers and for bidirectional ones without spans; every valid key for encoder-only layers;
    causal plus the request's span (`attn_core.contract.bidirectional.span_visible`) for bidirectional ones."""
    if attn_type is AttentionType.DECODER or (attn_type is AttentionType.DECODER_BIDIRECTIONAL and meta.spans is None):
        return causal
    kj = torch.arange(causal.shape[-1], device=causal.device)
    kv_lens = meta.kv_lens
    assert kv_lens is not None, "_build_metadata always sets kv_lens"
    valid = (kj[None, None, :] < kv_lens[:, None, None]) & (meta.q_rows < meta.num_tokens)[:, :, None]
    if attn_type is AttentionType.ENCODER_ONLY:
        return valid
    spans = meta.spans
    assert spans is not None, "a bidirectional layer with spans (the other cases returned above)"
    a, b = spans[:, 0, None, None], spans[:, 1, None, None]
    return valid & span_visible(meta.q_pos[:, :, None], kj[None, None, :], a, b)


def _has_custom_mask(mode: ForwardMode, spec_info: Optional[SpecInfo]) -> bool:
    return mode.is_target_verify() and spec_info is not None and spec_info.custom_mask is not None


def _attention(q, keys, vals, allowed, meta: _Metadata, layer, sinks, return_lse, max_score_bytes, scales):
    """keys `[bs, W, Hkv, D]` / vals `[bs, W, Hkv, Dv]`: the gathered K/V of each request's key slots, as
    stored (fp8 caches included); `scales` (k, v) dequantize them (`attn_core.memory.kv_scales`)."""
    T, hq, d = q.shape
    hkv = keys.shape[2]
    group = hq // hkv
    dv = layer.v_head_dim
    # fp32 inputs are computed in float64: the CPU's fp32 GEMM paths were seen to lose precision
    # (rel. error 2e-5 > the 1e-5 fp32 bar) on rare first calls; half-precision inputs use fp32.
    cd = torch.float64 if q.dtype in (torch.float32, torch.float64) else torch.float32
    bs, q_width = meta.q_rows.shape
    width = keys.shape[1]

    keys = keys.to(cd)
    # masked keys add nothing whatever their values (0 · Inf would be NaN): V entries that are not finite
    # are zeroed, and a query that sees such a key is given NaN below (its output is not finite either way)
    vals = vals.to(cd)
    # on the CPU (no sync to avoid) a finite sum shows every entry finite, and the masking work is skipped
    # (a sum of finite values that overflows takes the full path: the same result)
    all_finite = vals.device.type == "cpu" and bool(torch.isfinite(vals.sum()))
    sees_bad = None
    if not all_finite:
        finite = torch.isfinite(vals)
        bad_key = ~finite.all(dim=-1)  # [bs, W, Hkv]
        vals = torch.where(finite, vals, torch.zeros((), dtype=cd, device=vals.device))
        # [bs, Hkv, Lq]: the query rows that see a key whose V was not finite
        sees_bad = torch.einsum("bqw,bwk->bkq", allowed.to(torch.float32), bad_key.to(torch.float32)) > 0
    keys, vals = keys * scales[0], vals * scales[1]  # dequantize: x = stored · scale
    q_pad = torch.cat([q.to(cd), q.new_zeros((1, hq, d), dtype=cd)])
    qb = q_pad[meta.q_rows].view(bs, q_width, hkv, group, d)
    sink = None if sinks is None else sinks.to(cd).view(1, hkv, group, 1)

    out = torch.zeros((T + 1, hkv, group, dv), dtype=cd, device=q.device)
    lse = torch.zeros((T + 1, hkv, group), dtype=torch.float32, device=q.device)
    chunk = max(1, max_score_bytes // max(1, bs * hq * width * 4))
    for c0 in range(0, q_width, chunk):
        c1 = min(q_width, c0 + chunk)
        s = torch.einsum("bqkgd,bwkd->bkgqw", qb[:, c0:c1], keys) * layer.scaling
        if layer.logit_cap > 0:
            s = layer.logit_cap * torch.tanh(s / layer.logit_cap)
        s = s.masked_fill(~allowed[:, None, None, c0:c1, :], float("-inf"))
        m = s.amax(dim=-1)
        if sink is not None:
            m = torch.maximum(m, sink.expand_as(m))
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = torch.exp(s - m[..., None])
        denom = e.sum(dim=-1)
        if sink is not None:
            denom = denom + torch.exp(sink - m)
        o = torch.einsum("bkgqw,bwkd->bqkgd", e, vals)
        if sees_bad is not None:
            poisoned = sees_bad[:, :, c0:c1].permute(0, 2, 1)[:, :, :, None, None]  # [bs, q, Hkv, 1, 1]
            o = o.masked_fill(poisoned, float("nan"))
        inv = torch.where(denom > 0, 1.0 / denom, torch.zeros_like(denom)).permute(0, 3, 1, 2)
        rows = meta.q_rows[:, c0:c1].reshape(-1)
        out.index_copy_(0, rows, (o * inv[..., None]).reshape(-1, hkv, group, dv))
        chunk_lse = (torch.log(denom) + m).permute(0, 3, 1, 2).reshape(-1, hkv, group)
        lse.index_copy_(0, rows, chunk_lse.to(torch.float32))
    o = out[:T].reshape(T, hq * dv).to(q.dtype)
    if return_lse:
        return o, lse[:T].reshape(T, hq)
    return o
