"""Out-of-range indices found by kernels on the device, reported without a sync in the hot path.

Host checks cannot see what a CUDA-graph replay feeds the kernels, so the kernels bounds-check every
index they follow (request rows, slots, offsets into host-sized buffers) with masked loads and stores,
and record what they refused in a small int32 device buffer, one entry per `DeviceFaultKind`: a kernel
that meets a bad index of kind k stores 1 at entry k (a plain store; racing programs store the same
value). The backend owning the buffer reads and clears it in `poll_device_fault()` (one sync), which
`validation="full"` turns into an `attn_core.errors.DeviceIndexError`.

Worked example: a decode replay whose `req_pool_indices` holds -1 makes the index kernel store 1 at
entry `DeviceFaultKind.REQUEST_ROW` (and give that request no keys); the next poll returns
"request row: req_pool_indices outside the req_to_token table's rows" and zeroes the buffer.
"""

from __future__ import annotations

import enum
from typing import Optional, Sequence

import torch


class DeviceFaultKind(enum.IntEnum):
    """Entry of the fault buffer; the value is the entry's index (kernels use it as a constant)."""

    REQUEST_ROW = 0
    LENGTH = 1
    TABLE_WIDTH = 2
    INDEX_CAPACITY = 3
    SLOT = 4
    KEY_OFFSETS = 5
    QUERY_ROWS = 6
    MASK = 7


#: what each kind means, in the words `describe_device_faults` reports
FAULT_DESCRIPTIONS: dict[DeviceFaultKind, str] = {
    DeviceFaultKind.REQUEST_ROW: "request row: req_pool_indices outside the req_to_token table's rows",
    DeviceFaultKind.LENGTH: "length: a negative seq_lens / encoder_lens / extend_seq_lens entry on the device",
    DeviceFaultKind.TABLE_WIDTH: "table width: kv_start + kv length past the req_to_token table's width",
    DeviceFaultKind.INDEX_CAPACITY: (
        "index capacity: the device lengths need more key ids than the index buffer holds "
        "(host seq_lens_sum / seq_lens_cpu smaller than the device seq_lens)"
    ),
    DeviceFaultKind.SLOT: "slot: a req_to_token / kv_indices slot id outside the KV pool",
    DeviceFaultKind.KEY_OFFSETS: "key offsets: kv_indptr outside the kv_indices buffer",
    DeviceFaultKind.QUERY_ROWS: "query rows: qo_indptr outside the step's tokens",
    DeviceFaultKind.MASK: "mask: custom-mask offsets past the end of spec_info.custom_mask",
}

NUM_FAULT_KINDS = len(DeviceFaultKind)


def describe_device_faults(flags: Sequence[int]) -> Optional[str]:
    """The kinds whose entry is nonzero, joined with "; " (None when every entry is 0).

    Worked example: describe_device_faults([1, 0, 0, 0, 1, 0, 0, 0]) ->
    "request row: req_pool_indices outside ...; slot: a req_to_token / kv_indices slot id outside the KV pool".
    """
    bad = [FAULT_DESCRIPTIONS[kind] for kind in DeviceFaultKind if kind < len(flags) and flags[kind]]
    return "; ".join(bad) if bad else None


class DeviceFaultFlags:
    """The fault buffer of one backend instance: `buffer` int32 `[NUM_FAULT_KINDS]` on `device`, zeros
    when nothing was refused. Kernels get `buffer` as a pointer; captured CUDA graphs keep it (it never
    moves)."""

    def __init__(self, device: torch.device):
        self.buffer = torch.zeros(NUM_FAULT_KINDS, dtype=torch.int32, device=device)

    def poll(self) -> Optional[str]:
        """Read the flags (one device sync), clear them, and describe what was found (None: nothing).
        Not to be called while a CUDA graph is being captured."""
        flags = self.buffer.tolist()
        if not any(flags):
            return None
        self.buffer.zero_()
        return describe_device_faults(flags)
