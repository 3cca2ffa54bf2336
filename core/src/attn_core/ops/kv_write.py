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

Layouts (`layout`, FlashInfer's names): "NHD" caches are `[num_slots, H, D]` (any tensor whose first
dimension is the slot: an MLA latent `[num_slots, 1, R]` too); "HND" caches are `[num_pages, H,
page_size, D]`, slot s at page s // page_size, offset s % page_size. An fp8 cache (a one-byte float
view) stores e4m3(x / scale) saturated (`attn_core.memory.fp8.quantize_kv`), written as raw bytes.

Worked example (NHD, 6 slots, raw slots on a GPU): slots [3, -1, 9] write rows 3, 0 and 0 (the last
two refused, fault WRITE_SLOT recorded); on the CPU the same call raises `InvalidArgumentError("loc",
...)` and writes nothing.
"""

from __future__ import annotations

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
) -> None:
    """Write the K (and V) rows of `T` new tokens to `slots` of a cache (see the module docstring).

    k_cache / v_cache: cache tensors of `layout` (v_cache None: a single latent cache, MLA); slots: int
    `[T]` or `CheckedSlots`; k `[T, H, D]` / v `[T, H, Dv]` in any float dtype, quantized to the cache's
    dtype with k_scale / v_scale (`quantize_kv`; None means 1); fault: the fault word refusals are
    recorded in on an accelerator. Shapes are the caller's to check (the pools do)."""
    from attn_core.memory.fp8 import quantize_kv  # here: the memory package imports this module

    num_slots = num_cache_slots(k_cache, layout)
    ids = slot_ids(slots, num_slots, fault)
    scatter_rows(k_cache, ids, quantize_kv(k, k_cache.dtype, k_scale), layout, page_size)
    if v_cache is not None and v is not None:
        scatter_rows(v_cache, ids, quantize_kv(v, v_cache.dtype, v_scale), layout, page_size)


__all__ = [
    "CheckedSlots",
    "LAYOUTS",
    "SlotIds",
    "check_host_slots",
    "guard_slots",
    "num_cache_slots",
    "record_fault",
    "record_first",
    "scatter_rows",
    "slot_ids",
    "write_kv",
]
