"""The K/V write of `attn_core.ops.kv_write` in one Triton launch: every new token's K and V rows to their
slots, a (token, head) whose value is not finite stored as K = NaN, V = 0 (`kv_write.clean_nonfinite`, the
rule and why), for caches that need no quantization (16- or 32-bit, scales of 1). Used on accelerators, where
the same work in torch ops costs six launches a layer (the finiteness test, two fills, two scatters); this is
one (`CachedLaunch`: no per-call specialization work), and writes the same bytes.

Program t (grid `[T]`) writes token t: its slot s = SLOTS[t] (already checked: `kv_write.slot_ids`), at
element offset `(s // PAGE) * stride_page + (s % PAGE) * stride_token + h * stride_head + d` of each cache
(NHD `[num_slots, H, D]`: PAGE 1, stride_page the slot stride; HND `[pages, H, PAGE, D]`), heads in blocks
of BLOCK_H. With SHARED (an MLA latent cache, no V cache) the value is the first DV columns of the K row:
a bad value zeroes them and sets the others to NaN.

Worked example (NHD, 2 heads, D 2): token 0 at slot 3 with k [[1, 2], [3, 4]], v [[5, 6], [inf, 7]] stores
k_cache[3] = [[1, 2], [nan, nan]], v_cache[3] = [[5, 6], [0, 0]].
Importing this module imports Triton.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from attn_core.ops.triton_launch import CachedLaunch

#: dtypes the kernel stores as they come (no quantization)
PLAIN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

WRITE_INTS = ["num_tokens", "stride_kt", "stride_kh", "stride_vt", "stride_vh"]
WRITE_INTS += ["stride_kcp", "stride_kcs", "stride_kch", "stride_vcp", "stride_vcs", "stride_vch"]
WRITE_POINTERS = ["K_CACHE", "V_CACHE", "SLOTS", "K", "V"]


@triton.jit(do_not_specialize=WRITE_INTS, do_not_specialize_on_alignment=WRITE_POINTERS)
def _write_kv_kernel(
    K_CACHE,
    V_CACHE,
    SLOTS,
    K,
    V,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcp,
    stride_kcs,
    stride_kch,
    stride_vcp,
    stride_vcs,
    stride_vch,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAGE: tl.constexpr,
    SHARED: tl.constexpr,
    CLEAN_INPUTS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    s = tl.load(SLOTS + t).to(tl.int64)
    page, off = s // PAGE, s % PAGE
    k_row = page * stride_kcp + off * stride_kcs
    v_row = page * stride_vcp + off * stride_vcs
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    dtype = K_CACHE.dtype.element_ty
    for h0 in tl.static_range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        k_ok = (hs[:, None] < H) & (dk[None, :] < DK)
        k = tl.load(K + t * stride_kt + hs[:, None] * stride_kh + dk[None, :], mask=k_ok, other=0.0).to(dtype)
        if SHARED:
            val = dk[None, :] < DV
            bad_entry = val & k_ok & ~(tl.abs(k.to(tl.float32)) < float("inf"))
            bad = tl.max(bad_entry.to(tl.int32), 1) != 0
            clean = tl.where(val, tl.zeros_like(k), tl.full([BLOCK_H, BLOCK_DK], float("nan"), dtype))
            k = tl.where(bad[:, None], clean, k)
        else:
            v_ok = (hs[:, None] < H) & (dv[None, :] < DV)
            v = tl.load(V + t * stride_vt + hs[:, None] * stride_vh + dv[None, :], mask=v_ok, other=0.0).to(dtype)
            bad_entry = v_ok & ~(tl.abs(v.to(tl.float32)) < float("inf"))  # False for NaN too
            bad = tl.max(bad_entry.to(tl.int32), 1) != 0
            v = tl.where(bad[:, None], tl.zeros_like(v), v)
            k = tl.where(bad[:, None], tl.full([BLOCK_H, BLOCK_DK], float("nan"), dtype), k)
            tl.store(V_CACHE + v_row + hs[:, None] * stride_vch + dv[None, :], v, mask=v_ok)
            if CLEAN_INPUTS:  # the cleaned rows into the inputs too, where a row changed (no store otherwise)
                in_v = V + t * stride_vt + hs[:, None] * stride_vh + dv[None, :]
                tl.store(in_v, v.to(V.dtype.element_ty), mask=v_ok & bad[:, None])
                in_k = K + t * stride_kt + hs[:, None] * stride_kh + dk[None, :]
                tl.store(in_k, k.to(K.dtype.element_ty), mask=k_ok & bad[:, None])
        tl.store(K_CACHE + k_row + hs[:, None] * stride_kch + dk[None, :], k, mask=k_ok)


_LAUNCH = CachedLaunch(_write_kv_kernel)


def _cache_strides(cache: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """(page, token-in-page, head) element strides of a cache: NHD `[num_slots, H, D]` -> (slot stride, 0,
    head stride); HND `[pages, H, page, D]` -> (page stride, token stride, head stride)."""
    st = cache.stride()
    return (st[0], 0, st[1]) if layout == "NHD" else (st[0], st[2], st[1])


def _blocks(dk: int, dv: int, heads: int) -> tuple[int, int, int]:
    """(BLOCK_DK, BLOCK_DV, BLOCK_H): powers of two covering the dims, heads in blocks of <= 4096 elements."""
    block_dk, block_dv = triton.next_power_of_2(dk), triton.next_power_of_2(max(dv, 1))
    return block_dk, block_dv, max(1, min(triton.next_power_of_2(heads), 4096 // max(block_dk, block_dv)))


#: the bound launches (`CachedLaunch.bind`) by (tokens, heads, DK, DV, PAGE, SHARED, CLEAN_INPUTS): a layer's
#: write then passes its runtime arguments alone (the constexprs' keyword handling costs a few µs a call,
#: 32+ calls a step); emptied when it reaches `_MAX_BOUND` entries (extend steps bring new token counts)
_BOUND: dict[tuple, object] = {}
_MAX_BOUND = 4096


def _bound_launch(num_tokens: int, heads: int, dk: int, dv: int, page: int, shared: bool, clean: bool):
    key = (num_tokens, heads, dk, dv, page, shared, clean)
    bound = _BOUND.get(key)
    if bound is None:
        if len(_BOUND) >= _MAX_BOUND:
            _BOUND.clear()
        block_dk, block_dv, block_h = _blocks(dk, dv, heads)
        bound = _BOUND[key] = _LAUNCH.bind(
            (num_tokens,),
            H=heads,
            DK=dk,
            DV=dv,
            BLOCK_H=block_h,
            BLOCK_DK=block_dk,
            BLOCK_DV=block_dv,
            PAGE=page,
            SHARED=shared,
            CLEAN_INPUTS=clean,
            num_warps=4,
        )
    return bound


def fused_write_fits(
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    k: torch.Tensor,
    v: Optional[torch.Tensor],
    k_scale: float,
    v_scale: float,
) -> bool:
    """Whether `write_kv_triton` takes this write: caches of one plain dtype (`PLAIN_DTYPES`) and scales of 1
    (nothing to quantize), K (and V) `[T, H, D]` inputs of a float dtype, every last dimension contiguous.
    Example: a bf16 pool and bf16 rows with scales 1.0 fit; an fp8 pool, or a scale of 0.5, does not."""
    # one expression a tensor, no containers (called for every layer's write)
    dtype = k_cache.dtype
    if k_scale != 1.0 or v_scale != 1.0 or dtype not in PLAIN_DTYPES or k_cache.stride(-1) != 1:
        return False
    if k is None or not k.dtype.is_floating_point or k.stride(-1) != 1 or k.dim() != 3:
        return False
    if v_cache is None:
        return v is None or v.dim() == 3
    if v_cache.dtype != dtype or v_cache.stride(-1) != 1:
        return False
    return v is not None and v.dtype.is_floating_point and v.stride(-1) == 1 and v.dim() == 3


def write_kv_triton(
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    slots: torch.Tensor,
    k: torch.Tensor,
    v: Optional[torch.Tensor],
    layout: str = "NHD",
    page_size: int = 1,
    value_cols: int = 0,
    clean_inputs: bool = False,
) -> None:
    """Write rows k `[T, H, DK]` (and v `[T, H, DV]`) of T tokens to `slots` (int64 `[T]`, checked) of
    k_cache / v_cache (`layout` as in `attn_core.ops.kv_write`), a non-finite value stored as K = NaN, V = 0
    (module doc). v_cache None: one latent cache whose first `value_cols` columns are the value (MLA).
    `clean_inputs` (with a V cache): the rows that changed are stored into k and v as well, in place.
    Requires `fused_write_fits`. One launch; nothing when T is 0."""
    num_tokens, heads, dk = k.shape
    if num_tokens == 0:
        return
    shared = v_cache is None
    kcp, kcs, kch = _cache_strides(k_cache, layout)
    if shared:
        v_cache, v, dv = k_cache, k, value_cols
        vcp, vcs, vch = kcp, kcs, kch
    else:
        assert v is not None and v_cache is not None, "a V cache needs the V rows"
        dv = v.shape[2]
        vcp, vcs, vch = _cache_strides(v_cache, layout)
    kst, vst = k.stride(), v.stride()
    page = page_size if layout == "HND" else 1
    launch = _bound_launch(num_tokens, heads, dk, dv, page, shared, clean_inputs and not shared)
    launch(
        k_cache,
        v_cache,
        slots,
        k,
        v,
        num_tokens,
        kst[0],
        kst[1],
        vst[0],
        vst[1],
        kcp,
        kcs,
        kch,
        vcp,
        vcs,
        vch,
    )


__all__ = ["PLAIN_DTYPES", "fused_write_fits", "write_kv_triton"]
