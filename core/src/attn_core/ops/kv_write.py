"""The one K/V write of attn-core: new tokens' K/V into their slots of a paged cache, never outside it.

Every K/V write goes through this module: `write_kv` (plain cache tensors, strided views of an
engine-owned tensor included) and, for the pools' per-layer path, its two halves `slot_ids` (the check)
and `scatter_rows` (the write): `set_kv_buffer` of every core pool, and through it every backend's
`save_kv`. Slot 0 is the reserved dummy: page 0 is never handed out, so it is
where writes that must land somewhere harmless go (CUDA-graph padding rows, tokens another rank stores,
refused tokens). A slot outside the cache is never written where it points, never wrapped:

- a step's own slots come pre-checked: `AttentionBackend.init_forward_metadata` checks the step's
  `out_cache_loc` once (each slot in [1, num_slots) and the one `req_to_token` gives the token's
  position: the full validation on the CPU, the step check of `attn_core.ops.step_checks` on an
  accelerator, one launch, no sync) and hands the layers a `CheckedSlots` in which every refused token's
  slot is the dummy 0 (the refusal recorded in the fault word, `attn_core.ops.device_faults`, raised as
  a `DeviceFaultError` at the next step); `write_kv` writes through it with no further work: the
  per-layer cost is the scatter alone, as before;
- a raw slot tensor (a direct `set_kv_buffer` call) is range-checked against [0, num_slots): on the CPU
  at once (no sync exists to avoid), `InvalidArgumentError` naming the slots before anything is
  written; on an accelerator without a sync, a slot outside the cache written to the dummy slot 0 and
  recorded in the fault word (kind WRITE_SLOT).

A (token, head) whose value is not finite as stored (Inf or NaN in a 16- or 32-bit cache; NaN in an fp8
one, which saturates Inf) is stored as K = NaN, V = 0 (`clean_nonfinite`): a query that does not see the
token multiplies V = 0 by its probability 0 and gets exactly nothing from it, where 0 · Inf would have been
NaN in any kernel that runs P·V over a tile holding keys some rows do not see (a tensor-core MMA cannot skip
them); a query that sees it gets a NaN score, so its output is NaN, as the true output is not finite either.
So masked keys add nothing on every backend for K/V written through this module (docs/design.md §3.2). On
an accelerator, caches that need no quantization take one Triton launch for the whole write
(`attn_core.ops.kv_write_triton`); everything else goes through torch ops with the same result.

Layouts (`layout`, FlashInfer's names): "NHD" caches are `[num_slots, H, D]` (any tensor whose first
dimension is the slot: an MLA latent `[num_slots, 1, R]` too); "HND" caches are `[num_pages, H,
page_size, D]`, slot s at page s // page_size, offset s % page_size. An fp8 cache (a one-byte float
view) stores e4m3(x / scale) saturated (`attn_core.memory.fp8.quantize_kv`), written as raw bytes.

Worked example (NHD, 6 slots, raw slots on a GPU): slots [3, -1, 9] write rows 3, 0 and 0 (the last
two refused, fault WRITE_SLOT recorded); on the CPU the same call raises `InvalidArgumentError("loc",
...)` and writes nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Union

import torch

from attn_core.contract.errors import InvalidArgumentError
from attn_core.ops.device_faults import FIRST_REQUEST_BASE, NUM_FAULT_KINDS, DeviceFaultKind

LAYOUTS = ("NHD", "HND")


@dataclass(frozen=True)
class CheckedSlots:
    """Slot ids a step check produced for a cache of `num_slots` slots: every entry is either a slot in
    [1, num_slots) that passed the check or 0 (the dummy slot) where the check refused the token's write
    (or a padding row's token).
    `slots`: int64 `[T]` on the cache's device. `write_kv` writes through these with no further check."""

    slots: torch.Tensor
    num_slots: int

    @property
    def shape(self) -> torch.Size:
        return self.slots.shape

    def dim(self) -> int:
        return self.slots.dim()

    def numel(self) -> int:
        return self.slots.numel()


SlotIds = Union[torch.Tensor, CheckedSlots]


def record_fault(fault: Optional[torch.Tensor], kind: DeviceFaultKind, bad: torch.Tensor) -> None:
    """Set the flag of `kind` in the fault word `fault` where any entry of the bool tensor `bad` is True
    (device ops only, no sync; nothing when `fault` is None). Example: bad [False, True] sets entry
    `kind` to 1; bad all False leaves it as it was."""
    if fault is None or bad.numel() == 0:
        return
    hit = bad.any().to(torch.int32)
    fault[int(kind)] = torch.maximum(fault[int(kind)], hit)


def record_first(fault: Optional[torch.Tensor], kind: DeviceFaultKind, bad_requests: torch.Tensor) -> None:
    """`record_fault` for a per-request bool `[bs]` tensor, also recording the first offending request
    (entry NUM_FAULT_KINDS + kind: FIRST_REQUEST_BASE - r, the largest code wins). Device ops only."""
    if fault is None or bad_requests.numel() == 0:
        return
    record_fault(fault, kind, bad_requests)
    idx = torch.arange(bad_requests.numel(), device=bad_requests.device, dtype=torch.int32)
    code = torch.where(bad_requests, FIRST_REQUEST_BASE - idx, torch.zeros_like(idx)).amax()
    at = NUM_FAULT_KINDS + int(kind)
    fault[at] = torch.maximum(fault[at], code)


def guard_slots(
    loc: torch.Tensor,
    num_slots: int,
    fault: Optional[torch.Tensor] = None,
    kind: DeviceFaultKind = DeviceFaultKind.WRITE_SLOT,
) -> torch.Tensor:
    """`loc` (int `[T]`) as int64 with every entry outside [0, num_slots) replaced by the dummy slot 0,
    the refusal recorded in `fault` under `kind`: a few elementwise device ops, no sync, graph-capturable.
    Example: guard_slots(tensor([3, -1, 9]), 6) -> [3, 0, 0]."""
    loc = loc.to(torch.int64)
    bad = (loc < 0) | (loc >= num_slots)
    record_fault(fault, kind, bad)
    return torch.where(bad, torch.zeros_like(loc), loc)


def check_host_slots(loc: torch.Tensor, num_slots: int, name: str = "loc") -> torch.Tensor:
    """A CPU slot tensor checked at once: `InvalidArgumentError` naming `name` unless every entry lies in
    [0, num_slots) (slot 0: the reserved dummy). Returns `loc`. Example: check_host_slots(tensor([3,
    -1]), 6) raises ("loc: expected slots in [0, 6) ..., found [-1]")."""
    if loc.numel() == 0:
        return loc
    lo, hi = (int(x) for x in torch.aminmax(loc))
    if lo < 0 or hi >= num_slots:
        bad = loc[(loc < 0) | (loc >= num_slots)][:8].tolist()
        raise InvalidArgumentError(name, f"slots in [0, {num_slots}) (0: the reserved dummy slot)", bad)
    return loc


def slot_ids(slots: SlotIds, num_slots: int, fault: Optional[torch.Tensor] = None, name: str = "loc") -> torch.Tensor:
    """The slot ids a write may use for a cache of `num_slots` slots: a `CheckedSlots` as checked (for a
    cache of its size); a raw 1-D tensor checked at once on the CPU (`check_host_slots`) or guarded on an
    accelerator (`guard_slots`, refusals to slot 0 and `fault`)."""
    if isinstance(slots, CheckedSlots):
        if slots.num_slots != num_slots:
            raise InvalidArgumentError(name, f"slots checked for a cache of {num_slots} slots", slots.num_slots)
        return slots.slots
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise InvalidArgumentError(
            name, "a 1-D int32/int64 tensor of slot ids", getattr(slots, "shape", type(slots).__name__)
        )
    if slots.device.type == "cpu":
        return check_host_slots(slots, num_slots, name)
    return guard_slots(slots, num_slots, fault)


def num_cache_slots(cache: torch.Tensor, layout: str = "NHD") -> int:
    """Slots a cache tensor of `layout` holds: NHD `[num_slots, ...]` -> num_slots; HND `[pages, H, page,
    D]` -> pages * page. Example: an HND cache `[5, 2, 16, 64]` holds 80 slots."""
    if layout == "NHD":
        return cache.shape[0]
    if layout == "HND" and cache.dim() == 4:
        return cache.shape[0] * cache.shape[2]
    raise InvalidArgumentError(
        "layout", f"one of {list(LAYOUTS)} (HND caches are [pages, H, page, D])", (layout, tuple(cache.shape))
    )


def scatter_rows(
    cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, layout: str = "NHD", page_size: int = 1
) -> None:
    """cache's rows of `slots` (int64 `[T]`, already checked: `slot_ids`) = `rows` (`[T, H, D]` in the
    cache's dtype; an fp8 cache and its rows are written as raw bytes, which index_put takes everywhere).
    The scatter alone: one index_put, no check. Example: NHD cache `[8, 2, 4]`, slots [3, 5] -> cache[3],
    cache[5] = rows[0], rows[1]; HND `[2, 2, 4, 4]` (page 4) -> cache[0, :, 3], cache[1, :, 1]."""
    if cache.dtype.itemsize == 1 and cache.dtype.is_floating_point:
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    if layout == "NHD":
        cache[slots] = rows
    else:
        cache[torch.div(slots, page_size, rounding_mode="floor"), :, slots % page_size] = rows


def clean_rows(k: torch.Tensor, v: Optional[torch.Tensor], bad: torch.Tensor, value_cols: int = 0) -> tuple:
    """(k, v) with the (token, head) rows where `bad` (bool `[T, H, 1]`) is True stored as K = NaN, V = 0
    (`clean_nonfinite`'s second half). v None: k is an MLA latent whose first `value_cols` columns are the
    value: those become 0, the rest NaN. Example: k [[[1, 2]]], v [[[5, 6]]], bad [[[True]]] -> k [[[nan,
    nan]]], v [[[0, 0]]]."""
    if v is not None:
        return k.masked_fill(bad, float("nan")), v.masked_fill(bad, 0.0)
    cols = torch.arange(k.shape[-1], device=k.device) < value_cols
    clean = torch.full_like(k[:1, :1], float("nan")).masked_fill(cols, 0.0)
    return torch.where(bad, clean, k), None


def nonfinite_rows(value: torch.Tensor) -> Optional[torch.Tensor]:
    """bool `[T, H, 1]`: the (token, head) rows of `value` `[T, H, D]` (a 16/32-bit float dtype) holding an Inf or
    NaN; None on the CPU when a finite sum shows there is none (no sync to avoid there; a sum that overflows
    gives the mask). Example: value [[[1, 2]], [[inf, 7]]] -> [[[False]], [[True]]]."""
    if value.device.type == "cpu" and bool(torch.isfinite(value.sum(dtype=torch.float32))):
        return None
    return ~torch.isfinite(value).all(-1, keepdim=True)


def clean_nonfinite(k: torch.Tensor, v: Optional[torch.Tensor] = None, value_cols: int = 0) -> tuple:
    """(k, v) with every (token, head) row whose value holds an Inf or NaN stored as K = NaN, V = 0 (the
    module docstring says why). k `[T, H, DK]`, v `[T, H, DV]` of a 16/32-bit float dtype; v None: k is an MLA
    latent whose first `value_cols` columns are the value (0: nothing to clean). Torch ops, no sync.
    Example: k [[[1, 2]], [[3, 4]]], v [[[5, 6]], [[inf, 7]]] -> k [[[1, 2]], [[nan, nan]]], v [[[5, 6]],
    [[0, 0]]]."""
    if v is None and value_cols <= 0:
        return k, v
    bad = nonfinite_rows(v if v is not None else k[..., :value_cols])
    return (k, v) if bad is None else clean_rows(k, v, bad, value_cols)


@functools.cache
def _fused_writer():
    """(`kv_write_triton.fused_write_fits`, `kv_write_triton.write_kv_triton`), or None without Triton
    (looked up once: this is per-layer code)."""
    try:
        from attn_core.ops import kv_write_triton
    except ImportError:
        return None
    return kv_write_triton.fused_write_fits, kv_write_triton.write_kv_triton


def write_kv_rows(
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    slots: torch.Tensor,
    k: torch.Tensor,
    v: Optional[torch.Tensor] = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    layout: str = "NHD",
    page_size: int = 1,
    value_cols: int = 0,
    clean_inputs: bool = False,
) -> None:
    """The write itself, for checked `slots` (int64 `[T]`, from `slot_ids`): k `[T, H, DK]` to k_cache and v
    `[T, H, DV]` to v_cache (v_cache None: one MLA latent cache, its value the first `value_cols` columns),
    quantized with k_scale / v_scale (floats > 0, `quantize_kv`), a value not finite as stored written as K =
    NaN, V = 0 (`clean_nonfinite`; in an fp8 cache that is a NaN: e4m3 saturates Inf). `clean_inputs`: the
    same rows of k and v cleaned in place too (K = NaN, V = 0), for a kernel that reads the new tokens' K/V
    from the inputs rather than the cache (FlashInfer's ragged prefill). On an accelerator, caches that need
    no quantization take one Triton launch (`kv_write_triton`); else torch ops, the same bytes."""
    if v_cache is None:
        v = None
    fused = _fused_writer() if k_cache.is_cuda else None
    if fused is not None and fused[0](k_cache, v_cache, k, v, k_scale, v_scale):
        fused[1](k_cache, v_cache, slots, k, v, layout, page_size, value_cols, clean_inputs)
        return
    from attn_core.memory.fp8 import is_fp8, quantize_kv  # here: the memory package imports this module

    k_in, v_in = k, v
    v_dtype = k_cache.dtype if v_cache is None else v_cache.dtype
    fp8 = is_fp8(k_cache.dtype) or is_fp8(v_dtype)
    bad = None
    if fp8 and (v is not None or value_cols > 0):  # e4m3 saturates Inf: a stored NaN is an input NaN (x / s)
        bad = torch.isnan(v if v is not None else k[..., :value_cols]).any(-1, keepdim=True)
        k, v = clean_rows(k, v, bad, value_cols)
    kq = quantize_kv(k, k_cache.dtype, k_scale)
    vq = None if v is None else quantize_kv(v, v_dtype, v_scale)
    if not fp8 and (vq is not None or value_cols > 0):  # the values as stored
        bad = nonfinite_rows(vq if vq is not None else kq[..., :value_cols])
        if bad is not None:
            kq, vq = clean_rows(kq, vq, bad, value_cols)
    if clean_inputs and v_in is not None and bad is not None:  # the same rows, in the caller's k and v
        k_in.masked_fill_(bad, float("nan"))
        v_in.masked_fill_(bad, 0.0)
    scatter_rows(k_cache, slots, kq, layout, page_size)
    if v_cache is not None and vq is not None:
        scatter_rows(v_cache, slots, vq, layout, page_size)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    slots: SlotIds,
    k: torch.Tensor,
    v: Optional[torch.Tensor] = None,
    *,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
    layout: str = "NHD",
    page_size: int = 1,
    fault: Optional[torch.Tensor] = None,
    value_cols: int = 0,
) -> None:
    """Write the K (and V) rows of `T` new tokens to `slots` of a cache (see the module docstring).

    k_cache / v_cache: cache tensors of `layout` (v_cache None: a single latent cache, MLA); slots: int
    `[T]` or `CheckedSlots`; k `[T, H, D]` / v `[T, H, Dv]` in any float dtype, quantized to the cache's
    dtype with k_scale / v_scale (`quantize_kv`; None means 1); fault: the fault word refusals are
    recorded in on an accelerator; value_cols: with v_cache None, the columns of the latent that are the
    value (`write_kv_rows`). Shapes are the caller's to check (the pools do)."""
    from attn_core.memory.fp8 import check_scale  # here: the memory package imports this module

    num_slots = num_cache_slots(k_cache, layout)
    ids = slot_ids(slots, num_slots, fault)
    k_scale, v_scale = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
    if v_cache is not None and v is None:
        v_cache = None  # K alone (the V cache left as it is)
    write_kv_rows(
        k_cache,
        v_cache,
        ids,
        k,
        v,
        k_scale=k_scale,
        v_scale=v_scale,
        layout=layout,
        page_size=page_size,
        value_cols=value_cols,
    )


__all__ = [
    "CheckedSlots",
    "LAYOUTS",
    "SlotIds",
    "check_host_slots",
    "clean_nonfinite",
    "clean_rows",
    "nonfinite_rows",
    "guard_slots",
    "num_cache_slots",
    "record_fault",
    "record_first",
    "scatter_rows",
    "slot_ids",
    "write_kv",
    "write_kv_rows",
]
