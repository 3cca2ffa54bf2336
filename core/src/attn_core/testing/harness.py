"""Run one attention case against a backend and check it against the float64 reference.

A case builds real pools and a batch with `build_forward_batch`, poisons every KV slot with NaN, writes
random K/V into the slots the requests have cached (keeping dense host copies), builds metadata once,
runs several layers, and checks for each layer: the output (and LSE) against `reference_attention`,
the new K/V written to exactly `out_cache_loc`, and every other slot untouched.

An fp8 KV case (`kv_dtype="float8_e4m3fn"`) gives every layer its own k_scale / v_scale (`FP8_SCALES`):
the cache holds e4m3(x / scale), the dense host copies hold the dequantized values (stored · scale, in
float64) the reference runs on, new K/V must be stored exactly as `quantize_kv` stores them, and their
dequantized values must lie within e4m3's rounding bound of the originals (`e4m3_error_bound`).

A case with `steps` splits its requests into several batches built on the same pools and runs them one
after the other on one backend object (metadata rebuilt per step), as an engine does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch

from attn_core.contract.batch import ForwardBatch
from attn_core.contract.capabilities import ARCH_MHA, ARCH_MLA, Feature
from attn_core.contract.context import BackendContext
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.layer import AttentionLayer
from attn_core.memory import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    PagedTokenAllocator,
    ReqToTokenPool,
    SlidingWindowAllocator,
    SlidingWindowKVPool,
)
from attn_core.memory.fp8 import dequantize_kv, e4m3_error_bound, is_fp8, quantize_kv
from attn_core.memory.pools import kv_scales
from attn_core.testing.batch_builder import RequestShape, build_forward_batch
from attn_core.testing.reference import fp8_kv_tolerance, reference_attention, relative_error, tolerance

BackendFactory = Callable[[BackendContext], object]

#: (k_scale, v_scale) of layer i of an fp8 KV case: FP8_SCALES[i % 2]. Random normal K/V divided by
#: them reach |x/s| ≈ 5/0.02 = 250 < 448 (no saturation) on the first and fall to the subnormal range
#: (< 2^-6) for |x| < 0.0078 on the second, so both ends of e4m3 are exercised.
FP8_SCALES = ((0.02, 0.03), (0.5, 0.25))


@dataclass(frozen=True)
class AttnCase:
    """One conformance case. `requests` are (prefix_len, extend_len[, encoder_len])."""

    mode: ForwardMode
    requests: tuple[RequestShape, ...]
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    v_head_dim: Optional[int] = None
    dtype: str = "float32"
    kv_dtype: Optional[str] = None
    page_size: int = 1
    arch: str = ARCH_MHA
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    sliding_window: Optional[int] = None
    logit_cap: float = 0.0
    sinks: bool = False
    cross_attention: bool = False
    return_lse: bool = False
    num_layers: int = 2
    device: str = "cpu"
    seed: int = 0
    #: TARGET_VERIFY only: give the batch random tree masks (False: no mask, drafts attend causally)
    custom_mask: bool = True
    #: request indices of each step (empty: one step with every request)
    steps: tuple[tuple[int, ...], ...] = ()
    #: CUDA-graph level the context announces (`CudaGraphLevel` value)
    cuda_graph_level: int = 0
    #: sliding window on even layers only (odd layers attend fully), as interleaved-window models do
    window_even_layers_only: bool = False
    #: chunked local attention (`AttentionLayer.attention_chunk_size`) on every layer, or on even layers
    #: only (odd layers attend fully, as Llama-4 interleaves them) with `chunk_even_layers_only`
    attention_chunk_size: Optional[int] = None
    chunk_even_layers_only: bool = False
    #: keep the window layers' K/V in a `SlidingWindowKVPool` (needs `sliding_window`; MHA, no encoder):
    #: window slots differ from full slots, and those of prefix keys outside every window are released
    #: (their translation is the NaN-poisoned dummy slot) before the step runs
    window_pool: bool = False
    #: layout of the KV pool's buffers ("NHD" or "HND"; MHA only)
    kv_layout: str = "NHD"
    #: cascade attention: every request's first `cascade_prefix` cached tokens are the same slots (the
    #: first request's; the others' own slots for them stay poisoned) and the batch says so through
    #: `cascade_prefix_len` (one step, no encoder tokens, every prefix_len >= cascade_prefix)
    cascade_prefix: int = 0
    #: every layer's `AttentionLayer.attn_type`: "decoder", "encoder_only" (non-causal) or
    #: "decoder_bidirectional" (causal plus the batch's spans)
    attn_type: str = "decoder"
    #: one bidirectional span (a, b) per request (decoder positions), given to every step's batch as
    #: `bidirectional_spans`; empty: the batches carry none
    spans: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "mode", ForwardMode.parse(self.mode))
        object.__setattr__(
            self, "requests", tuple(r if isinstance(r, RequestShape) else RequestShape(*r) for r in self.requests)
        )
        object.__setattr__(self, "steps", tuple(tuple(int(i) for i in s) for s in self.steps))
        object.__setattr__(self, "spans", tuple((int(a), int(b)) for a, b in self.spans))

    def step_requests(self) -> list[tuple[int, ...]]:
        """Request indices of each step."""
        return list(self.steps) if self.steps else [tuple(range(len(self.requests)))]

    def describe(self) -> str:
        reqs = [(r.prefix_len, r.extend_len) + ((r.encoder_len,) if r.encoder_len else ()) for r in self.requests]
        parts = [
            self.mode.name,
            f"reqs={reqs}",
            f"heads={self.num_q_heads}/{self.num_kv_heads}",
            f"d={self.head_dim}",
            self.dtype,
            f"page={self.page_size}",
        ]
        if self.arch == ARCH_MLA:
            parts.append(f"mla={self.kv_lora_rank}+{self.qk_rope_head_dim}")
        if self.kv_dtype and self.kv_dtype != self.dtype:
            parts.append(f"kv={self.kv_dtype}")
        for name in ("sliding_window", "attention_chunk_size", "logit_cap", "sinks", "cross_attention", "return_lse"):
            if getattr(self, name):
                parts.append(f"{name}={getattr(self, name)}")
        if self.window_even_layers_only:
            parts.append("window on even layers only")
        if self.chunk_even_layers_only:
            parts.append("chunk on even layers only")
        if self.window_pool:
            parts.append("window pool")
        if self.kv_layout != "NHD":
            parts.append(f"kv_layout={self.kv_layout}")
        if self.cascade_prefix:
            parts.append(f"cascade_prefix={self.cascade_prefix}")
        if self.attn_type != "decoder":
            parts.append(f"attn_type={self.attn_type}")
        if self.spans:
            parts.append(f"spans={[list(s) for s in self.spans]}")
        if self.mode.is_target_verify() and not self.custom_mask:
            parts.append("no custom mask")
        if self.steps:
            parts.append(f"steps={[list(s) for s in self.steps]}")
        return " ".join(parts)

    def features(self) -> frozenset[Feature]:
        f = set()
        if self.sliding_window is not None:
            f.add(Feature.SLIDING_WINDOW)
        if self.attention_chunk_size is not None:
            f.add(Feature.CHUNKED_LOCAL_ATTENTION)
        if self.window_pool:
            f.add(Feature.SLIDING_WINDOW_POOL)
        if self.logit_cap:
            f.add(Feature.LOGIT_CAP)
        if self.sinks:
            f.add(Feature.SINKS)
        if self.cross_attention:
            f.add(Feature.CROSS_ATTENTION)
        if self.return_lse:
            f.add(Feature.LSE_OUTPUT)
        if self.mode.is_target_verify() and self.custom_mask:
            f.add(Feature.CUSTOM_MASK)
        if self.attn_type == "encoder_only":
            f.add(Feature.NON_CAUSAL)
        if self.spans:
            f.add(Feature.BIDIRECTIONAL_SPAN)
        return frozenset(f)


@dataclass
class CaseEnv:
    """Pools, context and batch of a case, plus the dense host copies of every cached K/V."""

    case: AttnCase
    ctx: BackendContext
    req_to_token_pool: ReqToTokenPool
    allocator: Union[PagedTokenAllocator, SlidingWindowAllocator]
    kv_pool: Union[MHATokenToKVPool, MLATokenToKVPool, SlidingWindowKVPool]
    batch: ForwardBatch  # the first step's batch
    batches: list[ForwardBatch] = field(default_factory=list)  # one per step
    cached_k: list[list[torch.Tensor]] = field(default_factory=list)  # [layer][request] [L, Hkv, D]
    cached_v: list[list[torch.Tensor]] = field(default_factory=list)
    cached_enc_k: list[list[torch.Tensor]] = field(default_factory=list)
    cached_enc_v: list[list[torch.Tensor]] = field(default_factory=list)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def make_env(case: AttnCase) -> CaseEnv:
    """Build pools, context and batch for `case` and fill every cached slot with random K/V."""
    gen = torch.Generator().manual_seed(case.seed)
    dev = torch.device(case.device)
    dtype, kv_dtype = _dtype(case.dtype), _dtype(case.kv_dtype or case.dtype)
    ps = case.page_size
    rows = [r.encoder_len + r.prefix_len + r.extend_len for r in case.requests]
    pages = sum(-(-n // ps) for n in rows) + 2
    max_ctx = max(rows + [1]) + ps
    mla = case.arch == ARCH_MLA
    head_dim = case.kv_lora_rank + case.qk_rope_head_dim if mla else case.head_dim
    req_pool = ReqToTokenPool(max(len(case.requests), 1), max_ctx, dev)
    if case.window_pool:
        if mla or case.sliding_window is None or any(r.encoder_len for r in case.requests):
            raise ValueError("window_pool cases need an MHA case with sliding_window and no encoder tokens")
        allocator = SlidingWindowAllocator(pages * ps, (pages + 1) * ps, case.sliding_window, ps, dev)
        allocator.window_alloc.alloc(ps)  # one page taken first: a token's window slot never equals its full slot
        window_layers = [i for i in range(case.num_layers) if make_layer(case, i).sliding_window_size is not None]
        kv_pool = SlidingWindowKVPool(
            allocator, kv_dtype, case.num_kv_heads, head_dim, case.num_layers, window_layers, dev, case.v_head_dim
        )
    elif mla:
        allocator = PagedTokenAllocator(pages * ps, ps, dev)
        kv_pool = MLATokenToKVPool(
            pages * ps, ps, kv_dtype, case.kv_lora_rank, case.qk_rope_head_dim, case.num_layers, dev
        )
    else:
        allocator = PagedTokenAllocator(pages * ps, ps, dev)
        kv_pool = MHATokenToKVPool(
            pages * ps, ps, kv_dtype, case.num_kv_heads, head_dim, case.num_layers, dev, case.v_head_dim, case.kv_layout
        )
    ctx = BackendContext(
        device=dev,
        dtype=dtype,
        kv_dtype=kv_dtype,
        num_q_heads=case.num_q_heads,
        num_kv_heads=1 if mla else case.num_kv_heads,
        head_dim=head_dim,
        v_head_dim=case.kv_lora_rank if mla else case.v_head_dim,
        page_size=ps,
        max_batch_size=max(len(case.requests), 1),
        max_context_len=max_ctx,
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
        sliding_window_size=case.sliding_window,
        attention_chunk_size=case.attention_chunk_size,
        attention_arch=case.arch,
        kv_lora_rank=case.kv_lora_rank,
        qk_rope_head_dim=case.qk_rope_head_dim,
        is_encoder_decoder=case.cross_attention,
        features=case.features() - {Feature.SLIDING_WINDOW, Feature.CROSS_ATTENTION, Feature.CHUNKED_LOCAL_ATTENTION},
        forward_modes=frozenset({case.mode}),
        cuda_graph=case.cuda_graph_level,
        validation="full",  # the kit checks the device tensors of every batch too
    )
    batches = []
    for idx in case.step_requests():
        reqs = [case.requests[i] for i in idx]
        batch = build_forward_batch(
            case.mode, reqs, req_to_token_pool=req_pool, allocator=allocator, token_to_kv_pool=kv_pool, generator=gen
        )
        if batch.spec_info is not None and not case.custom_mask:
            batch.spec_info.custom_mask = batch.spec_info.mask_indptr = None
        batches.append(batch)
    if case.window_pool:  # prefix keys no query of the step can see leave the window pool
        for batch, idx in zip(batches, case.step_requests()):
            for row, i in zip(batch.req_pool_indices.tolist(), idx):
                prefix = case.requests[i].prefix_len
                allocator.release_out_of_window(req_pool.req_to_token[row, :prefix].cpu(), prefix)
    if case.cascade_prefix:
        _share_prefix(case, req_pool, batches)
    if case.spans:
        for batch, idx in zip(batches, case.step_requests()):
            host = torch.tensor([case.spans[i] for i in idx], dtype=torch.int64).reshape(len(idx), 2)
            batch.bidirectional_spans, batch.bidirectional_spans_cpu = host.to(dev, torch.int32), host
    env = CaseEnv(case, ctx, req_pool, allocator, kv_pool, batches[0], batches)
    _fill_cache(env, gen)
    return env


def _share_prefix(case: AttnCase, req_pool: ReqToTokenPool, batches: list[ForwardBatch]) -> None:
    """Point the first `case.cascade_prefix` tokens of every request at the first request's slots and
    mark the batch as a cascade step."""
    p = case.cascade_prefix
    if len(batches) != 1 or any(r.encoder_len or r.prefix_len < p for r in case.requests):
        raise ValueError("cascade_prefix cases need one step, no encoder tokens and every prefix_len >= cascade_prefix")
    rows = batches[0].req_pool_indices.tolist()
    table = req_pool.req_to_token
    for row in rows[1:]:
        table[row, :p] = table[rows[0], :p]
    batches[0].cascade_prefix_len = p


def token_major(pool, buf: torch.Tensor) -> torch.Tensor:
    """A layer buffer of `pool` as `[num_slots, H, D]` rows by slot: the buffer itself (NHD) or a
    token-major copy (HND)."""
    if pool.kv_layout == "NHD":
        return buf
    return buf.permute(0, 2, 1, 3).reshape(-1, buf.shape[1], buf.shape[3])


def _poison(buf: torch.Tensor) -> None:
    """Fill a layer buffer with NaN (for fp8, the e4m3fn NaN byte 0x7F through a byte view)."""
    if is_fp8(buf.dtype):
        buf.view(torch.uint8).fill_(0x7F)
    else:
        buf.fill_(float("nan"))


class _CachedValues:
    """The values a case caches for one layer: `k(x)` / `v(x)` give what the cache stands for (x in the
    pool dtype; for fp8, the dequantized e4m3(x / scale) in float64) and `stored_k` / `stored_v` what the
    buffer holds for those values (for fp8, the e4m3 bytes)."""

    def __init__(self, pool, layer: AttentionLayer):
        self.dtype = pool.dtype
        self.fp8 = is_fp8(pool.dtype)
        self.scales = kv_scales(layer, pool)

    def _value(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if not self.fp8:
            return x.to(self.dtype)
        return dequantize_kv(quantize_kv(x, self.dtype, scale), scale, torch.float64)

    def _stored(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        # x holds dequantized values (exact multiples of the scale): quantizing them again is exact
        return quantize_kv(x, self.dtype, scale) if self.fp8 else x

    def k(self, x: torch.Tensor) -> torch.Tensor:
        return self._value(x, self.scales[0])

    def v(self, x: torch.Tensor) -> torch.Tensor:
        return self._value(x, self.scales[1])

    def stored_k(self, x: torch.Tensor) -> torch.Tensor:
        return self._stored(x, self.scales[0])

    def stored_v(self, x: torch.Tensor) -> torch.Tensor:
        return self._stored(x, self.scales[1])


def _write_rows(pool, buf: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """buf's rows of `slots` = x, in the pool's layout (a cached K/V fill, no dtype conversion; fp8
    through byte views, which every device's index_put takes)."""
    if is_fp8(buf.dtype):
        buf, x = buf.view(torch.uint8), x.view(torch.uint8)
    if pool.kv_layout == "NHD":
        buf[slots] = x
    else:
        buf[torch.div(slots, pool.page_size, rounding_mode="floor"), :, slots % pool.page_size] = x


def layer_slots(env: CaseEnv, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
    """Where the K/V of the tokens at full `slots` sit in the buffers of layer `layer_id`: the same slots,
    or for a window-pool layer their window slots (0, the dummy, for released tokens)."""
    pool = env.kv_pool
    if isinstance(pool, SlidingWindowKVPool) and pool.is_window_layer(layer_id):
        return pool.window_slots(slots).long()
    return slots


def _rand(shape, dtype, gen, device) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype).to(device)


def _kv_shapes(env: CaseEnv) -> tuple[tuple[int, int], tuple[int, int]]:
    pool = env.kv_pool
    return (pool.head_num, pool.head_dim), (pool.head_num, pool.v_head_dim)


def _fill_cache(env: CaseEnv, gen: torch.Generator) -> None:
    """NaN everywhere, then random K/V in every cached (prefix / encoder) slot."""
    pool, case = env.kv_pool, env.case
    (hk, dk), (hv, dv) = _kv_shapes(env)
    r2t = env.req_to_token_pool.req_to_token
    for layer in range(case.num_layers):
        k_buf, v_buf = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
        _poison(k_buf)
        _poison(v_buf)
        cache = _CachedValues(pool, make_layer(case, layer))
        n = len(case.requests)
        ks, vs, eks, evs = [None] * n, [None] * n, [None] * n, [None] * n
        rows = [row for b in env.batches for row in b.req_pool_indices.tolist()]
        order = [i for idx in case.step_requests() for i in idx]
        for row, i in zip(rows, order):
            r = case.requests[i]
            enc_slots = r2t[row, : r.encoder_len].long()
            pre_slots = layer_slots(env, layer, r2t[row, r.encoder_len : r.encoder_len + r.prefix_len].long())
            kept = pre_slots != 0  # released window slots stay poisoned (slot 0 is the dummy)
            k = cache.k(_rand((r.prefix_len, hk, dk), torch.float32, gen, pool.device))
            v = (
                k[..., :dv]
                if case.arch == ARCH_MLA
                else cache.v(_rand((r.prefix_len, hv, dv), torch.float32, gen, pool.device))
            )
            if case.cascade_prefix and ks[order[0]] is not None:  # the shared prefix's K/V are the first request's
                p = case.cascade_prefix
                k[:p], v[:p] = ks[order[0]][:p], vs[order[0]][:p]
            _write_rows(pool, k_buf, pre_slots[kept], cache.stored_k(k[kept]))
            if case.arch != ARCH_MLA:
                _write_rows(pool, v_buf, pre_slots[kept], cache.stored_v(v[kept]))
            ks[i], vs[i] = k, v
            ek = cache.k(_rand((r.encoder_len, hk, dk), torch.float32, gen, pool.device))
            ev = (
                ek[..., :dv]
                if case.arch == ARCH_MLA
                else cache.v(_rand((r.encoder_len, hv, dv), torch.float32, gen, pool.device))
            )
            if r.prefix_len > 0:  # encoder K/V of running requests are cached; new requests bring theirs
                _write_rows(pool, k_buf, enc_slots, cache.stored_k(ek))
                if case.arch != ARCH_MLA:
                    _write_rows(pool, v_buf, enc_slots, cache.stored_v(ev))
            eks[i], evs[i] = ek, ev
        env.cached_k.append(ks)
        env.cached_v.append(vs)
        env.cached_enc_k.append(eks)
        env.cached_enc_v.append(evs)


@dataclass
class LayerResult:
    layer_id: int
    out_error: float
    lse_error: Optional[float]
    kv_ok: bool
    kv_message: str
    step: int = 0


@dataclass
class CaseResult:
    case: AttnCase
    layers: list[LayerResult]

    def tolerance(self) -> float:
        """Relative output bar: the q dtype's (`tolerance`), for fp8 KV `fp8_kv_tolerance` (the same bar;
        its docstring derives why e4m3 does not widen it against the dequantized reference)."""
        q = _dtype(self.case.dtype)
        return fp8_kv_tolerance(q) if is_fp8(_dtype(self.case.kv_dtype or self.case.dtype)) else tolerance(q)

    @property
    def ok(self) -> bool:
        tol = self.tolerance()
        return all(
            lr.kv_ok and lr.out_error <= tol and (lr.lse_error is None or lr.lse_error <= max(tol, 1e-4))
            for lr in self.layers
        )

    def message(self) -> str:
        tol = self.tolerance()
        lines = [f"case: {self.case.describe()} (tolerance {tol:g})"]
        for lr in self.layers:
            lse = "" if lr.lse_error is None else f", lse abs err {lr.lse_error:.3g}"
            step = f"step {lr.step} " if self.case.steps else ""
            lines.append(f"  {step}layer {lr.layer_id}: out rel err {lr.out_error:.3g}{lse}; kv: {lr.kv_message}")
        return "\n".join(lines)


def make_layer(case: AttnCase, layer_id: int) -> AttentionLayer:
    mla = case.arch == ARCH_MLA
    head_dim = case.kv_lora_rank + case.qk_rope_head_dim if mla else case.head_dim
    return AttentionLayer(
        layer_id=layer_id,
        num_q_heads=case.num_q_heads,
        num_kv_heads=1 if mla else case.num_kv_heads,
        head_dim=head_dim,
        v_head_dim=case.kv_lora_rank if mla else case.v_head_dim,
        scaling=(head_dim**-0.5) * 1.3,
        logit_cap=case.logit_cap,
        sliding_window_size=None if case.window_even_layers_only and layer_id % 2 else case.sliding_window,
        is_cross_attention=case.cross_attention,
        attention_chunk_size=None if case.chunk_even_layers_only and layer_id % 2 else case.attention_chunk_size,
        attn_type=case.attn_type,
        **_fp8_scales(case, layer_id),
    )


def _fp8_scales(case: AttnCase, layer_id: int) -> dict:
    """{k_scale, v_scale} of an fp8 KV case's layer (`FP8_SCALES`), {} otherwise."""
    if not is_fp8(_dtype(case.kv_dtype or case.dtype)):
        return {}
    k, v = FP8_SCALES[layer_id % len(FP8_SCALES)]
    return {"k_scale": k, "v_scale": v}


def layer_inputs(
    env: CaseEnv,
    layer_id: int,
    gen: torch.Generator,
    batch: Optional[ForwardBatch] = None,
    requests: Optional[Sequence[int]] = None,
) -> dict:
    """Random q (and new K/V) of one layer for `batch` (default: the first step), whose requests are
    `requests` (indices into the case's requests; default: the first step's), in the case's dtypes and device."""
    case, pool = env.case, env.kv_pool
    batch = env.batch if batch is None else batch
    requests = case.step_requests()[0] if requests is None else requests
    (hk, dk), (hv, dv) = _kv_shapes(env)
    T = batch.num_tokens
    dtype = _dtype(case.dtype)
    q = _rand((T, case.num_q_heads, dk), dtype, gen, pool.device)
    if case.cross_attention:
        news = [i for i in requests if case.requests[i].prefix_len == 0 and case.requests[i].encoder_len]
        k = torch.cat([env.cached_enc_k[layer_id][i] for i in news]) if news else None
        v = torch.cat([env.cached_enc_v[layer_id][i] for i in news]) if news else None
        if k is not None:
            k, v = k.to(dtype), v.to(dtype)
    else:
        k = _rand((T, hk, dk), dtype, gen, pool.device)
        v = None if case.arch == ARCH_MLA else _rand((T, hv, dv), dtype, gen, pool.device)
    sinks = torch.randn(case.num_q_heads, generator=gen).to(pool.device) if case.sinks else None
    return {"q": q, "k": k, "v": v, "sinks": sinks}


def reference_for_layer(
    env: CaseEnv,
    layer: AttentionLayer,
    inputs: dict,
    batch: Optional[ForwardBatch] = None,
    requests: Optional[Sequence[int]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float64 reference of every new token of `batch` (default: the first step; its requests are
    `requests`, indices into the case's requests): output `[T, Hq, Dv]`, LSE `[T, Hq]`."""
    case = env.case
    batch = env.batch if batch is None else batch
    requests = case.step_requests()[0] if requests is None else requests
    lid = layer.layer_id
    outs = [torch.zeros(0, layer.num_q_heads, layer.v_head_dim, dtype=torch.float64)]
    lses = [torch.zeros(0, layer.num_q_heads, dtype=torch.float64)]
    start = 0
    cache = _CachedValues(env.kv_pool, layer)
    masks = _verify_masks(batch)
    for j, i in enumerate(requests):
        r = case.requests[i]
        n = r.extend_len
        q = inputs["q"][start : start + n]
        positions = torch.arange(r.prefix_len, r.prefix_len + n)
        if case.cross_attention:
            k, v = env.cached_enc_k[lid][i], env.cached_enc_v[lid][i]
            o, lse = reference_attention(
                q,
                k,
                v,
                q_positions=positions,
                scale=layer.scaling,
                causal=False,
                logit_cap=layer.logit_cap,
                sinks=inputs["sinks"],
            )
        else:
            new_k = cache.k(inputs["k"][start : start + n])
            k = torch.cat([env.cached_k[lid][i], new_k])
            if case.arch == ARCH_MLA:
                v = k[..., : case.kv_lora_rank]
            else:
                v = torch.cat([env.cached_v[lid][i], cache.v(inputs["v"][start : start + n])])
            span = case.spans[i] if case.spans and case.attn_type == "decoder_bidirectional" else None
            o, lse = reference_attention(
                q,
                k,
                v,
                q_positions=positions,
                scale=layer.scaling,
                causal=case.attn_type != "encoder_only",
                bidirectional_span=span,
                window=layer.sliding_window_size,
                logit_cap=layer.logit_cap,
                sinks=inputs["sinks"],
                mask=None if masks is None else masks[j],
                chunk_size=layer.attention_chunk_size,
            )
        outs.append(o)
        lses.append(lse)
        start += n
    return torch.cat(outs), torch.cat(lses)


def _verify_masks(batch: ForwardBatch) -> Optional[list[torch.Tensor]]:
    spec = batch.spec_info
    if not batch.forward_mode.is_target_verify() or spec is None or spec.custom_mask is None:
        return None
    mask, indptr = spec.custom_mask.cpu(), spec.mask_indptr.cpu().tolist()
    n = spec.num_draft_tokens
    return [mask[indptr[i] : indptr[i + 1]].view(n, -1) for i in range(batch.batch_size)]


def check_kv_writes(
    env: CaseEnv,
    layer: AttentionLayer,
    before: list[torch.Tensor],
    inputs: dict,
    batch: Optional[ForwardBatch] = None,
    ignore_slots: Sequence[int] = (),
) -> tuple[bool, str]:
    """New K/V at the step's slots, every other slot (but `ignore_slots`) bit-identical to `before`
    (the layer's [K, V] buffers before the step). An fp8 pool must hold exactly `quantize_kv(new, scale)`
    and, dequantized, lie within `e4m3_error_bound` of the new K/V."""
    pool = env.kv_pool
    batch = env.batch if batch is None else batch
    if layer.is_cross_attention:
        loc, k, v = batch.encoder_out_cache_loc, inputs["k"], inputs["v"]
    else:
        loc, k, v = layer_slots(env, layer.layer_id, batch.out_cache_loc), inputs["k"], inputs["v"]
    after = [
        token_major(pool, pool.get_key_buffer(layer.layer_id)),
        token_major(pool, pool.get_value_buffer(layer.layer_id)),
    ]
    before = [token_major(pool, b) for b in before]
    expected_new = [] if k is None else [k, k[..., : pool.v_head_dim] if v is None else v]
    fp8 = is_fp8(pool.dtype)
    for name, b, a, new, scale in zip(("K", "V"), before, after, expected_new or [None, None], kv_scales(layer, pool)):
        mask = torch.ones(a.shape[0], dtype=torch.bool, device=a.device)
        mask[list(ignore_slots)] = False
        if new is not None and loc is not None and loc.numel():
            mask[loc] = False
            got = a[loc].double()
            new = new.reshape(got.shape)
            want = (quantize_kv(new, pool.dtype, scale) if fp8 else new.to(pool.dtype)).double()
            if not torch.equal(got, want):
                bad = (got != want).reshape(got.shape[0], -1).any(-1).nonzero().flatten()[:5].tolist()
                return False, f"{name} of new tokens not written to their slots (first bad rows {bad})"
            if fp8 and not bool(
                ((got * scale - new.double()).abs() <= e4m3_error_bound(new, scale) * (1 + 1e-9)).all()
            ):
                return (
                    False,
                    f"{name} of new tokens: dequantized cache farther from the input than e4m3 rounding allows",
                )
        if not torch.equal(
            torch.nan_to_num(a[mask].double(), nan=12345.0), torch.nan_to_num(b[mask].double(), nan=12345.0)
        ):
            changed = (
                (torch.nan_to_num(a, nan=12345.0) != torch.nan_to_num(b, nan=12345.0)).reshape(a.shape[0], -1).any(-1)
            )
            changed &= mask
            return False, f"{name} written outside out_cache_loc (slots {changed.nonzero().flatten()[:8].tolist()})"
    return True, "ok"


def forward_extras(case: AttnCase, inputs: dict) -> dict:
    """The forward() keyword extras a case passes (sinks, return_lse)."""
    extras = {}
    if inputs["sinks"] is not None:
        extras["sinks"] = inputs["sinks"]
    if case.return_lse:
        extras["return_lse"] = True
    return extras


def compare_layer(
    env: CaseEnv, layer: AttentionLayer, inputs: dict, result, batch: ForwardBatch, requests: Sequence[int]
) -> tuple[float, Optional[float]]:
    """Relative output error and absolute LSE error (None without return_lse) of one layer's result."""
    out, lse = result if env.case.return_lse else (result, None)
    ref_o, ref_lse = reference_for_layer(env, layer, inputs, batch, requests)
    out_err = relative_error(out.reshape(ref_o.shape), ref_o) if out.shape[0] == ref_o.shape[0] else float("inf")
    return out_err, (_lse_error(lse, ref_lse) if env.case.return_lse else None)


def run_case(factory: BackendFactory, case: AttnCase) -> CaseResult:
    """Run `case` on the backend made by `factory(ctx)`: per step, metadata once, then every layer."""
    env = make_env(case)
    backend = factory(env.ctx)
    gen = torch.Generator().manual_seed(case.seed + 1)
    results = []
    for step, (batch, requests) in enumerate(zip(env.batches, case.step_requests())):
        batch.attn_backend = backend
        backend.init_forward_metadata(batch)
        for lid in range(case.num_layers):
            layer = make_layer(case, lid)
            inputs = layer_inputs(env, lid, gen, batch, requests)
            before = [env.kv_pool.get_key_buffer(lid).clone(), env.kv_pool.get_value_buffer(lid).clone()]
            res = layer(inputs["q"], inputs["k"], inputs["v"], batch, **forward_extras(case, inputs))
            out_err, lse_err = compare_layer(env, layer, inputs, res, batch, requests)
            kv_ok, kv_msg = check_kv_writes(env, layer, before, inputs, batch)
            results.append(LayerResult(lid, out_err, lse_err, kv_ok, kv_msg, step))
    return CaseResult(case, results)


def _lse_error(lse: torch.Tensor, ref: torch.Tensor) -> float:
    """Absolute error of the LSE (it is a log: absolute error is relative error of the denominator)."""
    lse, ref = lse.double().cpu().reshape(ref.shape), ref.double()
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(lse), finite) or not torch.equal(lse[~finite], ref[~finite]):
        return float("inf")
    return float((lse[finite] - ref[finite]).abs().max()) if finite.any() else 0.0


def assert_case(factory: BackendFactory, case: AttnCase) -> CaseResult:
    """`run_case`, raising AssertionError with a description of the case when it fails."""
    result = run_case(factory, case)
    if not result.ok:
        raise AssertionError("attention mismatch\n" + result.message())
    return result


__all__: Sequence[str] = [
    "AttnCase",
    "CaseEnv",
    "CaseResult",
    "assert_case",
    "check_kv_writes",
    "compare_layer",
    "forward_extras",
    "layer_inputs",
    "layer_slots",
    "make_env",
    "make_layer",
    "reference_for_layer",
    "run_case",
]
