"""Bad indices found by kernels on the device, reported without a sync in the hot path.

Host checks cannot see the device tensors without a sync (and see nothing of what a CUDA-graph replay
feeds the kernels), so the kernels check every index they follow (request rows, lengths, slots, offsets
into host-sized buffers) with masked loads and stores, and record what they refused in a small int32
device buffer, the *fault word* (`DeviceFaultFlags.buffer`, `FAULT_WORDS` entries):

- entry k < `NUM_FAULT_KINDS`: 1 once a kernel met a fault of kind k (`DeviceFaultKind`; a plain store,
  racing programs store the same value);
- entry `NUM_FAULT_KINDS` + k: `FIRST_REQUEST_BASE` - r for the smallest request index r a kernel blamed
  for kind k (an `atomic_max`, so the first offending request wins whatever the program order), 0 when
  no kernel named one.

Two ways to read it:

- `DeviceFaultFlags.poll()` reads it (one device sync) and clears it: `validation="full"` and tests;
- without a sync (the default on GPUs): `snapshot()` copies it to pinned host memory with a non-blocking
  copy queued after the step's kernels (`AttentionBackend.init_forward_metadata` does at the end of a
  step's metadata), and `read_snapshot()` reads the host copy, which the next step's
  `init_forward_metadata` turns into an `attn_core.contract.errors.DeviceFaultError` (the copy has landed by
  then whenever the engine waited for anything of the step, e.g. its sampled tokens; a copy still in
  flight is read at the step after). On the CPU the word *is* host memory: read directly.

Worked example: a decode replay whose `req_pool_indices` holds -1 at request 2 makes the step check
store 1 at entry `REQUEST_ROW` and `FIRST_REQUEST_BASE - 2` at entry `NUM_FAULT_KINDS + REQUEST_ROW`;
the next step's read gives `DeviceFault(step=..., kinds=(REQUEST_ROW,), first={REQUEST_ROW: 2})`, whose
error names "forward_batch.req_pool_indices" and request 2.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from attn_core.contract.errors import DeviceFaultError


class DeviceFaultKind(enum.IntEnum):
    """Entry of the fault word; the value is the entry's index (kernels use it as a constant)."""

    REQUEST_ROW = 0
    LENGTH = 1
    TABLE_WIDTH = 2
    INDEX_CAPACITY = 3
    SLOT = 4
    KEY_OFFSETS = 5
    QUERY_ROWS = 6
    MASK = 7
    # the step checks of `attn_core.ops.step_checks` (one launch per step, before any K/V write)
    DUPLICATE_ROW = 8
    SEQ_TOTAL = 9
    EXTEND_TOTAL = 10
    EXTEND_LENS = 11
    START_LOC = 12
    MASK_INDPTR = 13
    WRITE_SLOT = 14
    WRITE_OWNER = 15
    KEY_SLOT = 16
    CASCADE = 17
    ENCODER_SLOT = 18


#: what each kind means, in the words `describe_device_faults` reports
FAULT_DESCRIPTIONS: dict[DeviceFaultKind, str] = {
    DeviceFaultKind.REQUEST_ROW: "request row: req_pool_indices outside the req_to_token table's rows",
    DeviceFaultKind.LENGTH: (
        "length: a negative (DECODE: zero) seq_lens / encoder_lens / extend_seq_lens entry on the device"
    ),
    DeviceFaultKind.TABLE_WIDTH: "table width: kv_start + kv length past the req_to_token table's width",
    DeviceFaultKind.INDEX_CAPACITY: (
        "index capacity: the device lengths need more key ids than the index buffer holds "
        "(host seq_lens_sum / seq_lens_cpu smaller than the device seq_lens)"
    ),
    DeviceFaultKind.SLOT: "slot: a req_to_token / kv_indices slot id outside the KV pool",
    DeviceFaultKind.KEY_OFFSETS: "key offsets: kv_indptr outside the kv_indices buffer",
    DeviceFaultKind.QUERY_ROWS: "query rows: qo_indptr outside the step's tokens",
    DeviceFaultKind.MASK: "mask: custom-mask offsets past the end of spec_info.custom_mask",
    DeviceFaultKind.DUPLICATE_ROW: (
        "duplicate row: two requests of the batch at one req_to_token row and length (one slot written twice)"
    ),
    DeviceFaultKind.SEQ_TOTAL: "seq_lens total: the device seq_lens do not sum to the host seq_lens_sum",
    DeviceFaultKind.EXTEND_TOTAL: "extend total: the device extend_seq_lens do not sum to the step's tokens",
    DeviceFaultKind.EXTEND_LENS: (
        "extend lengths: extend_prefix_lens + extend_seq_lens != seq_lens, or a length outside 0..seq_len"
    ),
    DeviceFaultKind.START_LOC: "extend_start_loc: not the prefix sums of extend_seq_lens",
    DeviceFaultKind.MASK_INDPTR: "mask_indptr: not the prefix sums of q_len * seq_len",
    DeviceFaultKind.WRITE_SLOT: "write slot: an out_cache_loc slot outside [1, num_slots) (its K/V write dropped)",
    DeviceFaultKind.WRITE_OWNER: (
        "write owner: an out_cache_loc slot that is not the one req_to_token gives the token's position "
        "(another request's or position's slot, or a duplicate; its K/V write dropped)"
    ),
    DeviceFaultKind.KEY_SLOT: "key slot: a key the request attends to has no slot in [1, num_slots) in req_to_token",
    DeviceFaultKind.CASCADE: "cascade: a request whose first cascade_prefix_len slots are not the first request's",
    DeviceFaultKind.ENCODER_SLOT: (
        "encoder slot: an encoder_out_cache_loc slot outside [1, num_slots) (its K/V write dropped)"
    ),
}

#: the batch field each kind blames (the `argument` of the `DeviceFaultError`)
FAULT_FIELDS: dict[DeviceFaultKind, str] = {
    DeviceFaultKind.REQUEST_ROW: "forward_batch.req_pool_indices",
    DeviceFaultKind.LENGTH: "forward_batch.seq_lens",
    DeviceFaultKind.TABLE_WIDTH: "forward_batch.seq_lens",
    DeviceFaultKind.INDEX_CAPACITY: "forward_batch.seq_lens",
    DeviceFaultKind.SLOT: "forward_batch.req_to_token_pool",
    DeviceFaultKind.KEY_OFFSETS: "kv_indptr",
    DeviceFaultKind.QUERY_ROWS: "qo_indptr",
    DeviceFaultKind.MASK: "forward_batch.spec_info.custom_mask",
    DeviceFaultKind.DUPLICATE_ROW: "forward_batch.req_pool_indices",
    DeviceFaultKind.SEQ_TOTAL: "forward_batch.seq_lens",
    DeviceFaultKind.EXTEND_TOTAL: "forward_batch.extend_seq_lens",
    DeviceFaultKind.EXTEND_LENS: "forward_batch.extend_prefix_lens",
    DeviceFaultKind.START_LOC: "forward_batch.extend_start_loc",
    DeviceFaultKind.MASK_INDPTR: "forward_batch.spec_info.mask_indptr",
    DeviceFaultKind.WRITE_SLOT: "forward_batch.out_cache_loc",
    DeviceFaultKind.WRITE_OWNER: "forward_batch.out_cache_loc",
    DeviceFaultKind.KEY_SLOT: "forward_batch.req_to_token_pool",
    DeviceFaultKind.CASCADE: "forward_batch.cascade_prefix_len",
    DeviceFaultKind.ENCODER_SLOT: "forward_batch.encoder_out_cache_loc",
}

NUM_FAULT_KINDS = len(DeviceFaultKind)
#: entries of the fault word: a flag per kind, then the first offending request per kind
FAULT_WORDS = 2 * NUM_FAULT_KINDS
#: entry NUM_FAULT_KINDS + k holds FIRST_REQUEST_BASE - r for the first offending request r (0: none named)
FIRST_REQUEST_BASE = 1 << 30


def describe_device_faults(flags: Sequence[int]) -> Optional[str]:
    """The kinds whose flag is nonzero, joined with "; " (None when every flag is 0); `flags` is the
    fault word (or its first `NUM_FAULT_KINDS` entries).

    Worked example: describe_device_faults([1, 0, 0, 0, 1, 0, 0, 0]) ->
    "request row: req_pool_indices outside ...; slot: a req_to_token / kv_indices slot id outside the KV pool".
    """
    bad = [FAULT_DESCRIPTIONS[kind] for kind in DeviceFaultKind if kind < len(flags) and flags[kind]]
    return "; ".join(bad) if bad else None


@dataclass(frozen=True)
class DeviceFault:
    """What one read of the fault word found: the kinds flagged (in `DeviceFaultKind` order), the first
    offending request of each kind that a kernel named, and the step it is blamed on."""

    kinds: tuple[DeviceFaultKind, ...]
    first: dict[DeviceFaultKind, int]
    step: Optional[int] = None

    @classmethod
    def from_words(cls, words: Sequence[int], step: Optional[int] = None) -> Optional[DeviceFault]:
        """The fault a word read as a list holds, None when no flag is set. Example: words with entry 4
        (SLOT) 1 and entry NUM_FAULT_KINDS + 4 equal to FIRST_REQUEST_BASE - 3 give kinds (SLOT,),
        first {SLOT: 3}."""
        kinds = tuple(k for k in DeviceFaultKind if k < len(words) and words[k])
        if not kinds:
            return None
        first = {}
        for k in kinds:
            code = words[NUM_FAULT_KINDS + k] if NUM_FAULT_KINDS + k < len(words) else 0
            if code > 0:
                first[k] = FIRST_REQUEST_BASE - int(code)
        return cls(kinds, first, step)

    @property
    def argument(self) -> str:
        """The field the first kind blames."""
        return FAULT_FIELDS[self.kinds[0]]

    @property
    def request(self) -> Optional[int]:
        """The first offending request of the first kind that names one (None: no kernel named one)."""
        return next((self.first[k] for k in self.kinds if k in self.first), None)

    def describe(self) -> str:
        return "; ".join(FAULT_DESCRIPTIONS[k] for k in self.kinds)

    def error(self) -> DeviceFaultError:
        """The typed error engines get (`attn_core.contract.errors.DeviceFaultError`)."""
        return DeviceFaultError(self.step, self.argument, self.request, [k.name for k in self.kinds], self.describe())


class DeviceFaultFlags:
    """The fault word of one backend instance: `buffer` int32 `[FAULT_WORDS]` on `device`, zeros when
    nothing was refused. Kernels get `buffer` as a pointer; captured CUDA graphs keep it (it never moves).
    On a CUDA device a pinned host copy takes `snapshot()`s of it without a sync."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.buffer = torch.zeros(FAULT_WORDS, dtype=torch.int32, device=self.device)
        self._host: Optional[torch.Tensor] = None  # the host copy (accelerators only), made by `_make_host`
        self._host_view: Optional[memoryview] = None  # `_host`'s memory, read without a torch or numpy call
        if self.device.type == "cuda":  # pinned now, not in a step: a truly asynchronous copy, no allocation per step
            self._make_host()
        self._host_step: Optional[int] = None  # the step the host copy's snapshot is blamed on
        self._host_valid = False  # a snapshot was queued since the last clear

    def _make_host(self) -> torch.Tensor:
        """The host copy (pinned on CUDA: a truly asynchronous copy; plain memory on other accelerators) and
        its memoryview."""
        self._host = torch.zeros(FAULT_WORDS, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self._host_view = memoryview(self._host.numpy())
        return self._host

    @property
    def on_host(self) -> bool:
        """Whether the buffer lives in host memory (read directly, no snapshot needed)."""
        return self.device.type == "cpu"

    def poll(self) -> Optional[str]:
        """Read the flags (one device sync), clear them, and describe what was found (None: nothing).
        Not to be called while a CUDA graph is being captured."""
        flags = self.buffer.tolist()
        if not any(flags[:NUM_FAULT_KINDS]):
            return None
        self.clear()
        return describe_device_faults(flags)

    def poll_fault(self, step: Optional[int] = None) -> Optional[DeviceFault]:
        """`poll` (one device sync, clears the word) as a `DeviceFault` blamed on `step`."""
        fault = DeviceFault.from_words(self.buffer.tolist(), step)
        if fault is not None:
            self.clear()
        return fault

    def clear(self) -> None:
        """Zero the word (stream-ordered on a GPU: after every kernel queued so far) and forget the host
        copy, whose next snapshot is taken after the clear."""
        self.buffer.zero_()
        self._host_step = None
        self._host_valid = False
        if self._host is not None:
            self._host.zero_()

    def snapshot(self, step: Optional[int] = None) -> None:
        """Queue a non-blocking copy of the word to pinned host memory after the kernels queued so far on
        the current stream (no sync; nothing to do on the CPU, where the word is host memory). `step`
        is what `read_snapshot` blames a fault on."""
        self.mark_snapshot(step)
        self.copy_to_host()

    def copy_to_host(self) -> None:
        """Queue the non-blocking copy of the word into the pinned host copy, and nothing else: the device work
        of `snapshot`, which a CUDA graph can capture (`CudaGraphRunner` does, so a replay makes the copy with
        no host call); the host then calls `mark_snapshot` after each replay. Nothing to do on the CPU."""
        if self.on_host:
            return
        host = self._host if self._host is not None else self._make_host()
        host.copy_(self.buffer, non_blocking=True)

    def mark_snapshot(self, step: Optional[int] = None) -> None:
        """Record that a copy of the word to the host copy was queued (by `copy_to_host`, or by a replayed
        graph that captured it) for `step`: `read_snapshot` then reads that copy and blames `step`. Host
        bookkeeping only."""
        self._host_step = step
        self._host_valid = True

    def read_snapshot(self) -> Optional[DeviceFault]:
        """The fault in the last snapshot that has landed (None: none, or no snapshot since the last
        clear). Reads host memory only: never a sync. A fault returned here is cleared (the word too,
        stream-ordered), so it is reported once."""
        if self.on_host:
            words = self.buffer.tolist()
            if not any(words[:NUM_FAULT_KINDS]):
                return None
        elif self._host is None or self._host_view is None or not self._host_valid:
            return None  # nothing queued since the last clear (a copy still landing from before it is stale)
        elif not any(self._host_view[:NUM_FAULT_KINDS]):  # the flags, with no torch or numpy call per step
            return None
        else:
            words = self._host.tolist()
        fault = DeviceFault.from_words(words, self._host_step)
        self.clear()
        return fault
