"""`VisionAttention`: the attention block of a vision tower (ViT), with SGLang's constructor options that
make sense without a quantization stack, over any backend serving the ragged op (`Feature.RAGGED`,
`attn_core.contract.ragged`), chosen by name.

One call: qkv projection (fused `[q | k | v]` weight, as SGLang's `qkv_proj` and
`attn_core.vision.utils.pad_vit_attn_dummy_heads` lay it out), optional q/k RMS normalization (over all
heads, InternVL; or per head), an optional position embedding (rotary by default, or the model's own
applier), attention of each image's patches over its own patches (the backend's ragged op, non-causal),
output projection.

Token layouts (`forward`):
- x `[T, E]` (or `[1, T, E]` with `flatten_batch=True`): packed images; `cu_seqlens` (a `RaggedBatch`, or
  int32 offsets `[n + 1]` on x's device) splits the T rows into images; None: one image.
- x `[b, s, E]` (`flatten_batch=False`): b images of s patches each; with `cu_seqlens` (b + 1 offsets),
  image i has only its first cu[i+1] - cu[i] <= s patches, the rest is padding (attention output 0 there,
  so those rows come out as the projection's bias).

A `RaggedBatch` passed as `cu_seqlens` is built once per tower forward (`attn_core.contract.ragged.ragged_batch`);
a plain offsets tensor costs one device→host copy, made once while layers share a backend and pass the same
tensor object (the backend's `current_ragged_batch` is reused). Backends chosen by name are shared by every
`VisionAttention` of the same settings in the process (`vision_backend`), so a vision tower plans once per
forward, not once per layer.

No tensor parallelism and no attention dropout (inference): `num_dummy_heads` adds zero heads so that
checkpoints padded for a tensor-parallel size (`attn_core.vision.utils`) load unchanged, and a module in
training mode with `dropout > 0` refuses to run. The softmax runs in float32 on every backend, which is
what `softmax_in_single_precision=True` asks for.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from attn_core.contract.backend import AttentionBackend
from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.ragged import RaggedBatch, ragged_batch, ragged_batch_from_cu_seqlens, ragged_context

#: q `[T, Hq, D]`, k `[T, Hkv, D]`, the forward's `position_embeddings` -> (q, k)
PositionEmbeddingApplier = Callable[[torch.Tensor, torch.Tensor, object], tuple[torch.Tensor, torch.Tensor]]

_SHARED: dict[tuple, AttentionBackend] = {}


def vision_backend(
    name: str,
    *,
    device: Union[str, torch.device],
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    **options: Any,
) -> AttentionBackend:
    """The process's backend `name` over a ragged-only context (`Feature.RAGGED`, no paged mode, no pools) of
    these heads, head dim, dtype and device, made on first use (`attn_core.create_backend`) and shared after.

    Example: `vision_backend("triton", device="cuda", dtype=torch.bfloat16, num_heads=16, num_kv_heads=16,
    head_dim=80)` is the same object on every call."""
    key = (name, str(torch.device(device)), dtype, num_heads, num_kv_heads, head_dim, tuple(sorted(options.items())))
    backend = _SHARED.get(key)
    if backend is None:
        from attn_core.discovery.registry import create_backend

        ctx = ragged_context(device, dtype, num_heads, num_kv_heads, head_dim)
        backend = _SHARED[key] = create_backend(name, ctx, **options)
    return backend


@functools.lru_cache(maxsize=64)
def _uniform_batch(images: int, patches: int, device: str) -> RaggedBatch:
    """`images` sequences of `patches` rows each, one object per shape (so layers reuse one plan)."""
    return ragged_batch([patches] * images, device)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] (halves of the last dim) -> [-x2, x1]. Example: [1, 2, 3, 4] -> [-3, -4, 1, 2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """The default position embedding: rotary with (cos, sin), each `[T, D]` or `[T, D / 2]` (then repeated
    over both halves), applied as x·cos + rotate_half(x)·sin to q `[T, Hq, D]` and k `[T, Hkv, D]`."""
    cos, sin = position_embeddings
    d = q.shape[-1]
    if cos.shape[-1] * 2 == d:
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    if tuple(cos.shape) != (q.shape[0], d) or tuple(sin.shape) != (q.shape[0], d):
        raise InvalidArgumentError(
            "position_embeddings", f"(cos, sin) of shape ({q.shape[0]}, {d}) or half that", tuple(cos.shape)
        )
    cos, sin = cos[:, None, :].to(q.dtype), sin[:, None, :].to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class _RMSNorm(nn.Module):
    """RMS normalization of the last dim (float32 inside), its mean square taken over the first `var_width`
    channels only (the real heads, when dummy heads follow), then times `weight`."""

    def __init__(self, width: int, eps: float, var_width: Optional[int] = None, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, device=device, dtype=dtype))
        self.eps = eps
        self.var_width = width if var_width is None else var_width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        var = xf[..., : self.var_width].pow(2).mean(dim=-1, keepdim=True)
        return self.weight * (xf * torch.rsqrt(var + self.eps)).to(x.dtype)


class VisionAttention(nn.Module):
    """Multi-head attention of a vision tower without a KV cache (see the module docstring).

    Arguments (SGLang's names): `embed_dim` E, `num_heads`, `projection_size` (the real heads' q width,
    default num_heads · head_dim), `num_kv_heads` (default num_heads), `head_dim` (default projection_size
    // num_heads, else E // num_heads), `qkv_bias`, `proj_bias`, `qk_normalization` (RMSNorm over all heads
    of q and of k, InternVL) or `qk_normalization_by_head_size` (RMSNorm per head), `layer_norm_eps`,
    `dropout` (must be 0 in training mode: no attention dropout), `softmax_in_single_precision` (always
    true here), `softmax_scale` (default head_dim^-0.5), `flatten_batch` (x `[1, T, E]` holds packed
    images), `num_dummy_heads` (zero heads appended to q, k and v), `position_embedding_applier` (replaces
    the default rotary applier), `backend` (a registered name, made per device / dtype by `vision_backend`,
    with `backend_options`; or a backend object over a context of this module's heads, head dim and dtype).

    Parameters: `qkv_proj` (Linear E → (Hq + 2·Hkv)·D, q then k then v, dummy heads included), `proj`
    (Linear Hq·D → E), `q_norm` / `k_norm` when normalizing.

    Example::

        attn = VisionAttention(1280, 16, backend="triton", device="cuda", dtype=torch.bfloat16)
        ragged = attn_core.contract.ragged.ragged_batch([1024, 4096], "cuda")   # two images' patch counts
        out = attn(x, cu_seqlens=ragged)                                # x [5120, 1280] -> [5120, 1280]
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        projection_size: Optional[int] = None,
        *,
        num_kv_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        qk_normalization: bool = False,
        qk_normalization_by_head_size: bool = False,
        layer_norm_eps: float = 1e-6,
        dropout: float = 0.0,
        softmax_in_single_precision: bool = False,
        softmax_scale: Optional[float] = None,
        flatten_batch: bool = False,
        num_dummy_heads: int = 0,
        position_embedding_applier: Optional[PositionEmbeddingApplier] = None,
        backend: Union[str, AttentionBackend] = "torch_native",
        backend_options: Optional[dict] = None,
        device: Union[str, torch.device, None] = None,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(name, "an int >= 1", value)
        if head_dim is None:
            head_dim = projection_size // num_heads if projection_size is not None else embed_dim // num_heads
        if projection_size is None:
            projection_size = num_heads * head_dim
        if head_dim < 1 or projection_size != num_heads * head_dim:
            raise InvalidArgumentError(
                "projection_size", f"num_heads x head_dim = {num_heads} x {head_dim}", projection_size
            )
        kv = num_heads if num_kv_heads is None else num_kv_heads
        if kv < 1 or num_heads % kv:
            raise InvalidArgumentError("num_kv_heads", f"a divisor of num_heads={num_heads}", num_kv_heads)
        if num_dummy_heads < 0 or (num_dummy_heads and kv != num_heads):
            raise InvalidArgumentError(
                "num_dummy_heads", ">= 0 (and 0 with num_kv_heads != num_heads)", num_dummy_heads
            )
        if qk_normalization and qk_normalization_by_head_size:
            raise InvalidArgumentError(
                "qk_normalization", "one of qk_normalization, qk_normalization_by_head_size", True
            )
        if not 0.0 <= dropout < 1.0:
            raise InvalidArgumentError("dropout", "in [0, 1)", dropout)
        if softmax_scale is not None and not softmax_scale > 0:
            raise InvalidArgumentError("softmax_scale", "None or > 0", softmax_scale)
        if not isinstance(backend, (str, AttentionBackend)):
            raise InvalidArgumentError("backend", "a backend name or an AttentionBackend", type(backend).__name__)
        factory: dict[str, Any] = dict(device=device, dtype=dtype)
        self.embed_dim, self.head_dim = embed_dim, head_dim
        self.num_heads, self.num_kv_heads, self.num_dummy_heads = num_heads, kv, num_dummy_heads
        self.heads, self.kv_heads = num_heads + num_dummy_heads, kv + num_dummy_heads  # as the backend sees them
        self.q_size, self.kv_size = self.heads * head_dim, self.kv_heads * head_dim
        self.scale = head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
        self.dropout = dropout
        self.softmax_in_single_precision = softmax_in_single_precision
        self.flatten_batch = flatten_batch
        self.position_embedding_applier = position_embedding_applier
        self.backend = backend
        self.backend_options = dict(backend_options or {})
        self.qkv_proj = nn.Linear(embed_dim, self.q_size + 2 * self.kv_size, bias=qkv_bias, **factory)
        self.proj = nn.Linear(self.q_size, embed_dim, bias=proj_bias, **factory)
        self.qk_normalization = qk_normalization
        self.qk_normalization_by_head_size = qk_normalization_by_head_size
        if qk_normalization:  # over all heads; the mean square over the real heads' channels only
            self.q_norm = _RMSNorm(self.q_size, layer_norm_eps, num_heads * head_dim, **factory)
            self.k_norm = _RMSNorm(self.kv_size, layer_norm_eps, kv * head_dim, **factory)
        elif qk_normalization_by_head_size:
            self.q_norm = _RMSNorm(head_dim, layer_norm_eps, **factory)
            self.k_norm = _RMSNorm(head_dim, layer_norm_eps, **factory)

    def extra_repr(self) -> str:
        backend = self.backend if isinstance(self.backend, str) else self.backend.name
        return (
            f"embed_dim={self.embed_dim}, heads={self.num_heads}+{self.num_dummy_heads} dummy, "
            f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, backend={backend}"
        )

    # ---- the attention backend ---------------------------------------------------------------------
    def attention_backend(self, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
        """The backend this module's attention runs on for q of `dtype` on `device`."""
        if isinstance(self.backend, str):
            return vision_backend(
                self.backend,
                device=device,
                dtype=dtype,
                num_heads=self.heads,
                num_kv_heads=self.kv_heads,
                head_dim=self.head_dim,
                **self.backend_options,
            )
        ctx = self.backend.ctx
        want = (self.heads, self.kv_heads, self.head_dim, dtype, torch.device(device).type)
        got = (ctx.num_q_heads, ctx.num_kv_heads, ctx.head_dim, ctx.dtype, torch.device(ctx.device).type)
        if want != got:
            raise InvalidArgumentError(
                "backend", f"a context of (heads, kv heads, head_dim, dtype, device) {want}", got
            )
        return self.backend

    # ---- the token layout --------------------------------------------------------------------------
    def _layout(
        self, x: torch.Tensor, cu_seqlens, backend: AttentionBackend
    ) -> tuple[torch.Tensor, RaggedBatch, Optional[torch.Tensor]]:
        """(tokens `[N, E]` as packed rows, the ragged batch over the attended rows, the attended rows'
        indices into the N rows: None when every row is attended)."""
        if x.dim() == 2 or (x.dim() == 3 and self.flatten_batch):
            if x.dim() == 3 and x.shape[0] != 1:
                raise InvalidArgumentError("x", "[1, T, E] packed images with flatten_batch=True", tuple(x.shape))
            tokens = x.reshape(-1, x.shape[-1])
            if cu_seqlens is None:
                return tokens, _uniform_batch(1, tokens.shape[0], str(x.device)), None
            return tokens, self._ragged(cu_seqlens, backend), None
        if x.dim() != 3:
            raise InvalidArgumentError("x", "[T, E], [1, T, E] (flatten_batch) or [b, s, E]", tuple(x.shape))
        b, s = x.shape[0], x.shape[1]
        tokens = x.reshape(b * s, x.shape[-1])
        if cu_seqlens is None:
            return tokens, _uniform_batch(b, s, str(x.device)), None
        ragged = self._ragged(cu_seqlens, backend)
        lens = ragged.seq_lens_cpu
        if lens.shape[0] != b or (b and int(lens.max()) > s):
            raise InvalidArgumentError(
                "cu_seqlens", f"{b} images of at most {s} patches (x is {tuple(x.shape)})", lens.tolist()
            )
        rows = torch.cat([torch.arange(int(n)) + i * s for i, n in enumerate(lens.tolist())]) if b else torch.zeros(0)
        return tokens, ragged, rows.to(torch.int64).to(x.device, non_blocking=True)

    @staticmethod
    def _ragged(cu_seqlens, backend: AttentionBackend) -> RaggedBatch:
        if isinstance(cu_seqlens, RaggedBatch):
            return cu_seqlens
        current = backend.current_ragged_batch
        if current is not None and current.cu_seqlens is cu_seqlens:
            return current
        return ragged_batch_from_cu_seqlens(cu_seqlens)

    # ---- forward -----------------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: Union[RaggedBatch, torch.Tensor, None] = None,
        position_embeddings: Any = None,
    ) -> torch.Tensor:
        """x `[T, E]`, `[1, T, E]` or `[b, s, E]` (see the module docstring) → the same shape. With
        `position_embeddings` (rotary (cos, sin) `[N, D]` over the attended rows, or whatever the module's
        applier takes), q and k get their position embedding after the q/k normalization."""
        if x.shape[-1] != self.embed_dim:
            raise InvalidArgumentError("x", f"a last dim of embed_dim={self.embed_dim}", tuple(x.shape))
        if self.training and self.dropout > 0:
            raise InvalidArgumentError(
                "dropout", "0 in training mode (attention dropout is not served: call .eval())", self.dropout
            )
        backend = self.attention_backend(x.device, self.qkv_proj.weight.dtype)
        tokens, ragged, rows = self._layout(x, cu_seqlens, backend)
        attended = tokens if rows is None else tokens.index_select(0, rows)
        T = attended.shape[0]
        qkv = self.qkv_proj(attended)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_normalization:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (
            q.reshape(T, self.heads, self.head_dim),
            k.reshape(T, self.kv_heads, self.head_dim),
            v.reshape(T, self.kv_heads, -1),
        )
        if self.qk_normalization_by_head_size:
            q, k = self.q_norm(q), self.k_norm(k)
        if position_embeddings is not None:
            q, k = (self.position_embedding_applier or apply_rotary)(q, k, position_embeddings)
        if backend.current_ragged_batch is not ragged:
            backend.init_ragged_metadata(ragged)
        out = backend.ragged_attention(q, k, v, ragged, scaling=self.scale)  # [T, Hq * D] (no LSE asked)
        o = out[0] if isinstance(out, tuple) else out
        if rows is not None:
            o = o.new_zeros(tokens.shape[0], self.q_size).index_copy_(0, rows, o)
        return self.proj(o).reshape(*x.shape[:-1], self.embed_dim)


__all__ = ["PositionEmbeddingApplier", "VisionAttention", "apply_rotary", "rotate_half", "vision_backend"]
