"""fp8 KV caches: how a pool quantizes K/V on write and how a reader dequantizes (docs/design.md §3.2).

Convention (the one engines use): a layer's `k_scale` / `v_scale` s > 0 is the dequantization factor,
so the cache stores q = e4m3(x / s) and a kernel reads x̂ = float(q) · s. `quantize_kv` divides by s,
saturates to e4m3's finite range ±448 (the format has no infinity; NaN stays NaN) and rounds to nearest
(torch's cast). A scale of None means 1.

Precision of one cached element (e4m3: 3 mantissa bits, exponent bias 7): normal values (|x/s| ≥ 2^-6)
lie a relative 2^-3 apart at most, so round-to-nearest errs by at most half a step, a relative 2^-4;
below 2^-6 (subnormals) the step is 2^-9, an absolute error ≤ 2^-10·s. `e4m3_error_bound` gives that
bound per element.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from attn_core.contract.capabilities import FP8_KV_DTYPES
from attn_core.contract.errors import InvalidArgumentError

#: largest finite float8_e4m3fn magnitude
E4M3_MAX = 448.0
#: smallest normal float8_e4m3fn magnitude (2^-6) and the subnormal step (2^-9)
E4M3_MIN_NORMAL = 2.0**-6
E4M3_SUBNORMAL_STEP = 2.0**-9


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether `dtype` is a one-byte float (a KV pool keeps it as raw bytes). `is_fp8(torch.float8_e4m3fn)`
    is True, `is_fp8(torch.bfloat16)` False."""
    return dtype.itemsize == 1 and dtype.is_floating_point


def check_scale(name: str, scale: Optional[float]) -> float:
    """`scale` as a float (None → 1.0); raises InvalidArgumentError naming `name` unless it is a finite
    number > 0. `check_scale("layer.k_scale", None) == 1.0`, `check_scale("layer.k_scale", 0.5) == 0.5`."""
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise InvalidArgumentError(name, "a positive finite scalar (one per layer)", tuple(scale.shape))
        scale = float(scale)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0.0 < float(scale) < float("inf")):
        raise InvalidArgumentError(name, "a positive finite number (the fp8 dequantization factor) or None", scale)
    return float(scale)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: Optional[float] = None) -> torch.Tensor:
    """x `[...]` (any float dtype) / scale as `dtype`: for an fp8 `dtype` saturated to its finite range
    (±448 for e4m3) and rounded to nearest; for other dtypes a plain cast of x / scale (readers multiply
    by the scale whatever the cache dtype, so the pair stays consistent).

    Example: `quantize_kv(torch.tensor([1.0, 1000.0, 0.3]), torch.float8_e4m3fn, 0.5).float()` is
    `[2.0, 448.0, 0.625]` (0.6 rounds to 0.625, the nearest e4m3 value: 2^-1 · 1.25)."""
    s = check_scale("scale", scale)
    if not is_fp8(dtype):
        return (x if s == 1.0 else x / s).to(dtype)
    limit = torch.finfo(dtype).max
    y = x.float() if s == 1.0 else x.float() / s
    return y.clamp(-limit, limit).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: Optional[float] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float(x) · scale in `dtype`: the values an fp8 cache stands for. `dequantize_kv(q, 0.5)` of the
    example in `quantize_kv` is `[1.0, 224.0, 0.3125]`."""
    s = check_scale("scale", scale)
    y = x.to(dtype)
    return y if s == 1.0 else y * s


def as_cached(x: torch.Tensor, kv_dtype: torch.dtype, scale: Optional[float], out_dtype: torch.dtype) -> torch.Tensor:
    """x `[...]` as a reader of a `kv_dtype` cache sees it once stored with `scale`, in `out_dtype`:
    dequantize(quantize(x)) for an fp8 cache (a backend that attends to the new tokens without reading
    them back from the pool must see the values the pool holds), x itself (cast) otherwise.

    Example: `as_cached(torch.tensor([0.3]), torch.float8_e4m3fn, 0.5, torch.float32)` is `[0.3125]`;
    with `torch.bfloat16` as kv_dtype it is `[0.3]` (as float32)."""
    if not is_fp8(kv_dtype):
        return x.to(out_dtype)
    return dequantize_kv(quantize_kv(x, kv_dtype, scale), scale, out_dtype)


def e4m3_error_bound(x: torch.Tensor, scale: Union[float, None] = None) -> torch.Tensor:
    """Per element, the largest |dequantize(quantize(x)) − x| round-to-nearest e4m3 allows for values
    inside the range (|x/s| ≤ 448): 2^-4·|x| for normals, 2^-10·s below 2^-6·s (subnormals), in float64.

    Example: with s = 1, x = [1.0, 0.001] gives [0.0625, 2^-10 ≈ 0.000977]."""
    s = check_scale("scale", scale)
    a = x.double().abs()
    return torch.where(a / s >= E4M3_MIN_NORMAL, a * 2.0**-4, torch.full_like(a, E4M3_SUBNORMAL_STEP / 2 * s))


__all__ = [
    "E4M3_MAX",
    "E4M3_MIN_NORMAL",
    "E4M3_SUBNORMAL_STEP",
    "FP8_KV_DTYPES",
    "as_cached",
    "check_scale",
    "dequantize_kv",
    "e4m3_error_bound",
    "is_fp8",
    "quantize_kv",
]
