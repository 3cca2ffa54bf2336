"""`AttentionBackend`: the contract every backend implements.

Life of a step: the engine calls `init_forward_metadata(batch)` once, then every layer calls
`forward(q, k, v, layer, batch)`. `init_forward_metadata` is a template: it validates the batch
(`attn_core.contract.validation`, at the context's `validation` level), calls the backend's
`build_forward_metadata(batch)`, stores the result in `forward_metadata` and remembers the batch;
`forward` with any other batch raises `StaleMetadataError`. With CUDA graphs: `init_cuda_graph_state`
once, then per captured batch size `capture_cuda_graph_metadata(step)` before capture, and per replay
`replay_cuda_graph_metadata(step)` (which writes into the buffers the graph reads); `step` is an
`attn_core.contract.graph_step.CudaGraphStep`, and both make their metadata current with
`bind_graph_metadata(metadata, step)`. SGLang's positional `init_forward_metadata_capture_cuda_graph` /
`init_forward_metadata_replay_cuda_graph` stay as the public entry points that build the step.

Safe by default (docs/engine-authors.md, "What attn checks, when, and what it costs"): on the CPU the
batch validation runs every check ("full") whatever `ctx.validation` says; on an accelerator "basic"
checks the host copies and the step check (`attn_core.ops.step_checks`, one launch, no sync) checks the
device tensors, so that the step's K/V writes go only to the batch's own slots (`CheckedSlots`); what it
refuses is recorded in the fault word (`self.device_faults`), copied to pinned host memory without a
sync at the end of the step's metadata, and raised as a `DeviceFaultError` by the next
`init_forward_metadata` / graph replay, or by `raise_device_faults()`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Optional, TypeVar, Union

import torch

import attn_core.ops.kv_indices as kv_indices_ops
from attn_core.batching.cascade import check_cascade_prefix
from attn_core.contract import debug_paths
from attn_core.contract.batch import ForwardBatch, SpecInfo
from attn_core.contract.bidirectional import check_bidirectional_spans
from attn_core.contract.capabilities import Capabilities, Feature
from attn_core.contract.context import BackendContext
from attn_core.contract.errors import (
    DeviceIndexError,
    GraphShapeError,
    IncompatibleBackendError,
    InvalidArgumentError,
    StaleMetadataError,
    UnsupportedFeatureError,
)
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.contract.layer import AttentionLayer, AttentionType
from attn_core.contract.ragged import RaggedBatch, check_ragged_batch, ragged_heads
from attn_core.contract.validation import (
    FULL,
    check_forward_batch,
    check_forward_dtypes,
    check_kv_pool,
    effective_level,
)
from attn_core.memory.kv_pool import KVPool
from attn_core.memory.pools import kv_scales
from attn_core.memory.window_pool import window_pool_of
from attn_core.ops.device_faults import DeviceFault, DeviceFaultFlags, DeviceFaultKind
from attn_core.ops.kv_write import CheckedSlots, check_host_slots, guard_slots
from attn_core.ops.step_checks import PendingStepCheck, check_step, step_tensors

Output = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]

#: forward() keyword extras every backend understands (when it declares the matching feature):
#: sinks: float32 `[num_q_heads]` per-head sink logits; return_lse: also return the natural-log LSE.
CORE_EXTRAS = frozenset({"sinks", "return_lse"})

#: the per-step metadata class of a backend (`AttentionBackend[MyMetadata]`)
MetadataT = TypeVar("MetadataT")


@dataclass(frozen=True)
class GraphBatchKey:
    """What graph metadata was made current for (`bind_graph_metadata`): inside a CUDA graph the batch
    object `forward` sees is the runner's static batch, rebuilt per replay, so the check is by mode and
    batch size instead of identity."""

    forward_mode: ForwardMode
    batch_size: int

    def matches(self, batch: ForwardBatch) -> bool:
        return batch.forward_mode is self.forward_mode and batch.batch_size == self.batch_size


class AttentionBackend(abc.ABC, Generic[MetadataT]):
    """Base class of attention backends, generic over the backend's per-step metadata class:
    `class MyBackend(AttentionBackend[MyMetadata])`. Subclasses set `name` and `capabilities` and
    implement `build_forward_metadata`, `forward_decode` and `forward_extend` (and
    `init_cuda_graph_state`, `capture_cuda_graph_metadata` and `replay_cuda_graph_metadata` when
    `capabilities.cuda_graph` is above NEVER).

    `forward_decode` / `forward_extend` receive q as `[T, Hq, D]`, k/v as `[T, Hkv, D]` (or None),
    inputs already validated, and must return `[T, Hq*Dv]` (plus LSE `[T, Hq]` float32 when
    `return_lse`). They must not synchronize with the host.

    Construction refuses a context whose device, dtypes (or q/KV dtype pair), head dim, page size or
    arch the class's `capabilities` do not declare (`IncompatibleBackendError`, every reason listed), so
    a backend re-checks none of these.

    Per step, `init_forward_metadata` (not to be overridden by backends) validates the batch with
    attn-core's one batch validation (`attn_core.contract.validation`; level `ctx.validation`), then calls
    `build_forward_metadata`, which may assume a valid batch; `forward` refuses a batch other than the
    one the current metadata was built for (`StaleMetadataError`).

    Options: a subclass takes its own as keyword-only arguments and passes `**options` on to
    `AttentionBackend.__init__`, which rejects unknown ones with a typed error.
    """

    name: ClassVar[str] = ""
    capabilities: Capabilities  # set on the class; wrappers derive theirs per instance
    #: the current step's metadata (None before the first step and for no-token modes)
    forward_metadata: Optional[MetadataT]
    #: backend-specific forward() extras accepted on top of CORE_EXTRAS
    extra_forward_args: ClassVar[frozenset[str]] = frozenset()
    #: True: the backend's `build_forward_metadata` hands the step check (`take_step_check`) to its index launch
    step_check_in_index_launch: ClassVar[bool] = False

    def __init__(self, ctx: BackendContext, **options: Any):
        if options:
            raise InvalidArgumentError("options", f"no unknown options for backend {self.name!r}", sorted(options))
        caps = getattr(type(self), "capabilities", None)  # wrappers derive theirs from checked children
        if caps is not None:
            reasons = caps.mismatches(ctx.requirements(), layout_only=True)
            if reasons:
                raise IncompatibleBackendError(self.name or type(self).__name__, reasons)
            if ctx.token_to_kv_pool is not None:
                check_kv_pool(ctx.token_to_kv_pool, ctx, "ctx.token_to_kv_pool")
        self.ctx = ctx
        self.device = torch.device(ctx.device)
        self.forward_metadata = None
        # the batch (or GraphBatchKey) forward_metadata was built for; None: no metadata
        self._metadata_for: Union[ForwardBatch, GraphBatchKey, None] = None
        #: the fault word the step check and this backend's kernels record into (`attn_core.ops.device_faults`);
        #: a backend may replace it in its own __init__ with another `DeviceFaultFlags` of its device
        self.device_faults = DeviceFaultFlags(self.device)
        #: steps this backend made metadata for (init_forward_metadata and graph replays), the number a
        #: `DeviceFaultError` names
        self.step_count = 0
        # the bound step's checked write slots (out_cache_loc, encoder_out_cache_loc), see `write_slots`
        self._write_slots: Optional[CheckedSlots] = None
        self._encoder_slots: Optional[CheckedSlots] = None
        self._slot_scratch: Optional[torch.Tensor] = None
        # the step check of the step being built, while a backend's index launch may still take it
        self._pending_step_check: Optional[PendingStepCheck] = None
        # a graph batch's checked slots: (slot tensor, (cross, its version, capturing), layer id, CheckedSlots),
        # see `write_slots`
        self._graph_slots: Optional[tuple[torch.Tensor, tuple[bool, int, bool], int, CheckedSlots]] = None
        # a graph runner's static slot buffer, holding checked slots only (`trust_graph_slots`)
        self._trusted_slots: Optional[torch.Tensor] = None
        # (mode, bs) -> (num_tokens, draft tokens) of every graph shape captured (`capture_graph_step`)
        self._graph_shapes: dict[tuple[ForwardMode, int], tuple[Optional[int], int]] = {}
        #: the ragged op's metadata (`build_ragged_metadata`) and the `RaggedBatch` it was built for
        self.ragged_metadata: object = None
        self._ragged_for: Optional[RaggedBatch] = None

    # ---- per-step metadata -------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Once per step: validate `forward_batch`, build its metadata (`build_forward_metadata`, skipped
        for the no-token modes, whose metadata is None), make it current for this batch object.

        Raises `DeviceFaultError` when the fault word holds what an earlier step's device checks or
        kernels refused (read from its pinned host copy: no sync), `UnsupportedFeatureError` for a mode
        the backend does not declare, `InvalidBatchError` (naming the field) for a malformed batch,
        `StaleRequestError` for a batch of `build_step` whose requests changed since,
        `DeviceIndexError` (validation "full") when `poll_device_fault` reports an out-of-range index
        met by an earlier kernel. On any error the previous metadata is dropped, so a later `forward`
        raises `StaleMetadataError`; nothing has been written.

        On the CPU every check is "full" (`attn_core.contract.validation.effective_level`); on an accelerator at
        "basic" the step check (`attn_core.ops.step_checks`) runs on the device before the backend's build (or
        in the build's index launch: `take_step_check`), and the fault word's host copy is refreshed after it
        (see the module docstring).
        """
        self.forward_metadata = None
        self._metadata_for = None
        self._write_slots = self._encoder_slots = self._graph_slots = None
        self.raise_pending_fault()
        b = forward_batch
        if b.forward_mode not in self.capabilities.forward_modes:
            raise UnsupportedFeatureError(self.name, f"forward mode {b.forward_mode.name}")
        level = effective_level(self.ctx)
        r2t, pool = self.req_to_token(b), self.kv_pool(b)
        if b.request_guard is not None:
            b.request_guard.check()
        check_forward_batch(b, r2t, pool, self.ctx, level=level)
        if b.cascade_prefix_len:
            check_cascade_prefix(b, r2t if level == FULL else None)
        if b.bidirectional_spans is not None or b.bidirectional_spans_cpu is not None:
            self.require(Feature.BIDIRECTIONAL_SPAN, "bidirectional spans (forward_batch.bidirectional_spans)")
            check_bidirectional_spans(b, self.device, full=level == FULL)
        if level == FULL:
            fault = self.poll_device_fault()
            if fault is not None:
                raise DeviceIndexError(fault)
        self.step_count += 1
        if not b.forward_mode.is_no_tokens():
            self._check_step(b, r2t, pool, level)
        try:
            metadata = None if b.forward_mode.is_no_tokens() else self.build_forward_metadata(b)
        finally:  # not taken by the backend's index launch (or the build failed): its own launch, before any write
            pending, self._pending_step_check = self._pending_step_check, None
            if pending is not None:
                check_step(pending.tensors, pending.safe, pending.fault)
        self.device_faults.snapshot(self.step_count)
        self.forward_metadata = metadata
        self._metadata_for = b

    def _check_step(self, b: ForwardBatch, r2t: torch.Tensor, pool: KVPool, level: str) -> None:
        """The bound step's write slots: at "full" the batch's own (already checked on the host); else the
        step check's allowed slots (`attn_core.ops.step_checks`), written into a scratch buffer reused
        across steps, and the encoder slots guarded (range only, `guard_slots`)."""
        n = pool.num_slots
        enc = b.encoder_out_cache_loc
        if level == FULL:
            self._write_slots = CheckedSlots(b.out_cache_loc, n)
            self._encoder_slots = None if enc is None else CheckedSlots(enc, n)
            return
        T = b.out_cache_loc.shape[0]
        if self._slot_scratch is None or self._slot_scratch.shape[0] < T:
            self._slot_scratch = torch.empty(max(T, 64) * 5 // 4, dtype=torch.int64, device=self.device)
        safe = self._slot_scratch[:T]
        pending = PendingStepCheck(step_tensors(b, r2t, n), safe, self.device_faults.buffer)
        if self.step_check_in_index_launch and kv_indices_ops.index_kernel_runs_on(r2t):  # the Triton index kernel
            self._pending_step_check = pending  # `take_step_check`; else launched after the build
        else:
            check_step(pending.tensors, safe, pending.fault)
        self._write_slots = CheckedSlots(safe, n)
        if enc is not None:
            guarded = guard_slots(enc, n, self.device_faults.buffer, DeviceFaultKind.ENCODER_SLOT)
            self._encoder_slots = CheckedSlots(guarded, n)

    # ---- device faults (no sync unless said) ---------------------------------------------------
    def read_device_fault(self) -> Optional[DeviceFault]:
        """What the fault word's last host copy holds (None: nothing), without a sync: the host copy is
        taken at the end of every step's metadata (and graph replay metadata), after the step check and
        the metadata kernels. A fault read here is cleared. On the CPU the word is read directly."""
        return self.device_faults.read_snapshot()

    def raise_pending_fault(self) -> None:
        """Raise `DeviceFaultError` for what `read_device_fault()` returns (no sync); called first thing
        by `init_forward_metadata` and every graph replay."""
        fault = self.read_device_fault()
        if fault is not None:
            raise fault.error()

    def raise_device_faults(self) -> None:
        """An engine's explicit check after a step: wait for the device (one sync), read and clear the
        fault word, and raise `DeviceFaultError` for anything the step check, the metadata kernels or
        the layers' kernels refused so far (also what raw-slot writes through the context's KV pool
        recorded in the pool's own word). Does nothing when all is well. Not during graph capture."""
        fault = self.device_faults.poll_fault(self.step_count)
        pool = self.ctx.token_to_kv_pool
        if fault is None and pool is not None and getattr(pool, "_device_faults", None) is not None:
            fault = pool.device_faults.poll_fault(self.step_count)
        if fault is not None:
            raise fault.error()

    def take_step_check(self) -> Optional[PendingStepCheck]:
        """The step check of the step `build_forward_metadata` is building, for a backend whose class sets
        `step_check_in_index_launch` to run it in its index launch (`build_kv_indices(..., step_check=...)`,
        `kv_indices_triton`): one launch a step instead of two (~50 µs of host time each on the GPU machine).
        Returns it once (later calls None); None also at validation "full", on the CPU, and for a backend that
        does not declare it. A check not taken is launched by `init_forward_metadata` after the build, still
        before any K/V write. Hand it to the launch covering the batch's requests (another set of requests
        gets it in a launch of its own)."""
        pending, self._pending_step_check = self._pending_step_check, None
        return pending

    def write_slots(self, forward_batch: ForwardBatch, layer: Optional[AttentionLayer] = None) -> CheckedSlots:
        """The slots the step's new K/V go to, for a backend that writes them itself instead of through
        `save_kv` (attn-ascend's operator): the step's checked `out_cache_loc` (`encoder_out_cache_loc`
        for a cross-attention layer) when `forward_batch` is the bound batch; in a CUDA-graph batch the
        batch's own slots guarded on the device (`guard_slots`: refusals to the dummy slot 0, recorded
        in the fault word), on the CPU range-checked at once (`InvalidArgumentError`), once per pass over
        the layers: the first layer's write checks them, the later layers (increasing layer ids, the tensor
        not written in between) reuse the result (a captured graph holds one guard, a few elementwise nodes,
        not one per layer); none for a view of the buffer given to `trust_graph_slots`. Always a
        `CheckedSlots` (its `.slots`: int64 `[T]`)."""
        cross = layer is not None and layer.is_cross_attention
        slots: Union[CheckedSlots, torch.Tensor, None]
        if forward_batch is self._metadata_for and self._write_slots is not None:
            slots = self._encoder_slots if cross else self._write_slots
        else:
            slots = forward_batch.encoder_out_cache_loc if cross else forward_batch.out_cache_loc
        if slots is None:
            expected = "the new encoder tokens' slots, to write their K/V"
            raise InvalidArgumentError("forward_batch.encoder_out_cache_loc", expected, None)
        if isinstance(slots, CheckedSlots):
            return slots
        # a graph batch's own slots, checked once per pass over the layers: the first layer's write checks
        # them and the later layers of the same pass reuse the result (inside a captured graph: one guard
        # per replay, not one per layer, each a handful of graph nodes the replay launches). Checked again
        # for another slot tensor or layer kind, once the tensor was written in place, when the capture
        # state changes, when the layer ids stop increasing (a new pass: another warm-up, another capture),
        # and after every (re)binding
        loc = slots
        capturing = loc.is_cuda and torch.cuda.is_current_stream_capturing()
        lid = -1 if layer is None else layer.layer_id
        key = (cross, loc._version, capturing)
        done = self._graph_slots
        if done is not None and done[0] is loc and done[1] == key and 0 <= done[2] < lid:
            self._graph_slots = (loc, key, lid, done[3])
            return done[3]  # (kept for CUDA and CPU tensors only: other devices' capture state is not read here)
        n = self.kv_pool(forward_batch).num_slots
        kind = DeviceFaultKind.ENCODER_SLOT if cross else DeviceFaultKind.WRITE_SLOT
        if self._in_trusted_slots(loc, cross):
            checked = CheckedSlots(loc, n)
        elif loc.device.type == "cpu":
            checked = CheckedSlots(check_host_slots(loc, n, "forward_batch.out_cache_loc"), n)
        else:
            checked = CheckedSlots(guard_slots(loc, n, self.device_faults.buffer, kind), n)
        if loc.device.type in ("cuda", "cpu"):
            self._graph_slots = (loc, key, lid, checked)
        return checked

    def trust_graph_slots(self, buffer: torch.Tensor) -> None:
        """Declare `buffer` (int64 `[N]` on this backend's device) a graph runner's static `out_cache_loc`
        that holds checked slots only whenever a graph batch reads it: its owner fills it before every replay
        from the step check's allowed slots (or, at validation "full", from slots checked on the host) and
        its padding rows with the dummy slot 0. A graph batch's self-attention writes through a view of it
        then skip `write_slots`' guard (a few graph nodes a replay). `CudaGraphRunner` calls it for its own
        buffer; a wrapper passes it on to the backends it runs graphs on. Anything else keeps the guard."""
        if buffer.dtype != torch.int64 or buffer.dim() != 1 or buffer.device != self.device:
            raise InvalidArgumentError("buffer", f"an int64 1-D tensor on {self.device}", (buffer.dtype, buffer.device))
        self._trusted_slots = buffer

    def _in_trusted_slots(self, loc: torch.Tensor, cross: bool) -> bool:
        """Whether `loc` (a graph batch's slots) is an int64 1-D view into the buffer of `trust_graph_slots`."""
        buf = self._trusted_slots
        if buf is None or cross or loc.dtype != torch.int64 or loc.dim() != 1 or loc.device != buf.device:
            return False
        return loc.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()

    @abc.abstractmethod
    def build_forward_metadata(self, forward_batch: ForwardBatch) -> MetadataT:
        """Everything the layers of this step need (once per step, shared by all layers), from a batch
        already validated (`attn_core.contract.validation`: fields present, dtypes, shapes, devices, lengths and
        host copies consistent; device ranges too at validation "full"). Never called for no-token
        modes. Must not synchronize with the device beyond what the batch's host copies allow."""

    def bind_graph_metadata(self, metadata: MetadataT, step: CudaGraphStep) -> None:
        """Make `metadata` current for the CUDA-graph batch `step` (`capture_cuda_graph_metadata` and
        `replay_cuda_graph_metadata` end with it): `forward` then accepts any batch of `step`'s mode and
        size, since a graph runner rebuilds its static batch object per replay."""
        self.forward_metadata = metadata
        self._metadata_for = GraphBatchKey(step.forward_mode, step.bs)
        self._graph_slots = None  # a new graph step: its slots are checked again at its first write

    def poll_device_fault(self) -> Optional[str]:
        """A description of an out-of-range index a kernel of this backend met since the last poll (and
        clear it), or None. Called by `init_forward_metadata` at validation "full" (it may synchronize).
        The default reads `self.device_faults` (one sync on an accelerator)."""
        return self.device_faults.poll()

    # ---- CUDA graphs ---------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the persistent buffers graphs will read (sized for `max_bs` requests and
        `max_num_tokens` tokens)."""
        raise UnsupportedFeatureError(self.name, "CUDA graphs")

    def capture_graph_step(self, step: CudaGraphStep) -> None:
        """Capture-time metadata for the graph batch `step` (`capture_cuda_graph_metadata`), its shape
        remembered so every replay is checked against it (`replay_graph_step`). The entry point of the
        graph runner, the draft wrapper, the kit and SGLang's `init_forward_metadata_capture_cuda_graph`."""
        self.capture_cuda_graph_metadata(step)
        nd = step.spec_info.num_draft_tokens if step.spec_info is not None else 0
        self._graph_shapes[(step.forward_mode, step.bs)] = (step.num_tokens, nd)

    def check_graph_shape(self, step: CudaGraphStep) -> None:
        """`GraphShapeError` unless `step` has a shape captured by `capture_graph_step`: its (mode, bs)
        bucket, its token count (tokens per request) and its draft count. A backend whose graphs were
        captured some other way (none recorded) is not checked here."""
        if not self._graph_shapes:
            return
        key = (step.forward_mode, step.bs)
        if key not in self._graph_shapes:
            sizes = sorted(bs for mode, bs in self._graph_shapes if mode is step.forward_mode)
            raise GraphShapeError("bs", f"a batch size captured for {step.forward_mode.name} ({sizes})", step.bs)
        tokens, nd = self._graph_shapes[key]
        got_nd = step.spec_info.num_draft_tokens if step.spec_info is not None else 0
        if got_nd != nd:
            raise GraphShapeError("spec_info.num_draft_tokens", f"{nd} draft tokens per request, as captured", got_nd)
        if step.num_tokens is not None and tokens is not None and step.num_tokens != tokens:
            expected = f"{tokens} tokens ({tokens // step.bs} per request), as captured"
            raise GraphShapeError("num_tokens", expected, step.num_tokens)

    def replay_graph_step(self, step: CudaGraphStep, *, snapshot_faults: bool = True) -> None:
        """Every graph replay's metadata goes through here (the graph runner, the draft wrapper, the kit,
        SGLang's `init_forward_metadata_replay_cuda_graph`): raise what the fault word's host copy holds
        (`DeviceFaultError`, no sync), refuse a shape that was not captured (`GraphShapeError`), refresh
        the graph buffers (`replay_cuda_graph_metadata`), then queue the fault word's host copy (no sync),
        which the next replay or step reads. `snapshot_faults=False` leaves that copy to the caller, who
        queues it after the replay (`CudaGraphRunner`: its graphs capture the copy, `DeviceFaultFlags.copy_to_host`)."""
        self.raise_pending_fault()
        self.check_graph_shape(step)
        self.step_count += 1
        self.replay_cuda_graph_metadata(step)
        if snapshot_faults:
            self.device_faults.snapshot(self.step_count)

    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        encoder_lens: Optional[torch.Tensor],
        forward_mode: ForwardMode,
        spec_info: Optional[SpecInfo],
    ) -> None:
        """SGLang's capture entry point: the arguments as a `CudaGraphStep`, passed to
        `capture_graph_step` (`capture_cuda_graph_metadata`, the shape remembered)."""
        self.capture_graph_step(
            CudaGraphStep(
                forward_mode=forward_mode,
                bs=bs,
                num_tokens=num_tokens,
                req_pool_indices=req_pool_indices,
                seq_lens=seq_lens,
                encoder_lens=encoder_lens,
                spec_info=spec_info,
            )
        )

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: int,
        encoder_lens: Optional[torch.Tensor],
        forward_mode: ForwardMode,
        spec_info: Optional[SpecInfo],
        seq_lens_cpu: Optional[torch.Tensor],
    ) -> None:
        """SGLang's replay entry point: the arguments as a `CudaGraphStep`, passed to
        `replay_graph_step` (fault word read, shape checked, `replay_cuda_graph_metadata`)."""
        self.replay_graph_step(
            CudaGraphStep(
                forward_mode=forward_mode,
                bs=bs,
                req_pool_indices=req_pool_indices,
                seq_lens=seq_lens,
                seq_lens_cpu=seq_lens_cpu,
                seq_lens_sum=seq_lens_sum,
                encoder_lens=encoder_lens,
                spec_info=spec_info,
            )
        )

    def capture_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        """Point the metadata at the graph buffers for the graph batch `step` (padded to `step.bs`
        rows, see `attn_core.contract.graph_step`) before capturing; ends with `bind_graph_metadata(metadata, step)`."""
        raise UnsupportedFeatureError(self.name, "CUDA graphs")

    def replay_cuda_graph_metadata(self, step: CudaGraphStep) -> None:
        """Refresh, in place, the graph buffers captured for (`step.bs`, `step.forward_mode`) with the
        batch of this replay (padded the same way); ends with `bind_graph_metadata(metadata, step)`. No
        reallocation: the captured kernels read these buffers."""
        raise UnsupportedFeatureError(self.name, "CUDA graphs")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """seq_len written into padding rows of a graph batch."""
        return 1

    def support_triton(self) -> bool:
        """Whether this backend's kernels may be traced by Triton-based compilers."""
        return False

    def needs_page_aligned_draft_kv(self) -> bool:
        """Hook for `attn_core.wrappers.MultiStepDraftBackend` (only asked when page_size > 1 and
        topk > 1): whether this backend reads a request's keys page by page (a page table built from
        `req_to_token`), so that in the wrapper's draft request table the row of each draft branch must
        keep token i at page offset i % page_size. True, the default, is right for every backend: the
        wrapper then copies each request's last partial page of cached K/V into the first page of every
        branch. A backend that gathers keys slot by slot (CSR kv_indices, no page arithmetic) may return
        False and save that copy; its branch rows then point at the request's own last page."""
        return True

    def describe_path(self, layer: AttentionLayer, forward_batch: ForwardBatch) -> Optional[str]:
        """Which path and kernel the last `forward` of `layer` on this step took, in words, for the debug
        switch (`attn_core.contract.debug_paths`, `ATTN_DEBUG_PATHS=1`); asked only while it is on, after the call.
        The default reads the `path` string of the step's metadata or of its plans
        (`debug_paths.metadata_path`); a backend whose path depends on the layer overrides it."""
        return debug_paths.metadata_path(self.forward_metadata)

    # ---- the per-layer call -------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        *,
        out: Optional[torch.Tensor] = None,
        **extras: Any,
    ) -> Output:
        """Check the metadata is this batch's (`StaleMetadataError`), validate the arguments, then
        dispatch on the mode: no-token modes return an empty output, DECODE goes to `forward_decode`,
        every other mode to `forward_extend`.

        `out`: the engine's output buffer, `[T, Hq*Dv]` or `[T, Hq, Dv]` in q's dtype on the backend's
        device (checked before any KV write, `InvalidArgumentError` naming `out`); the result is written
        into it and `out` (viewed as `[T, Hq*Dv]`) is returned in place of a new tensor."""
        bound = self._metadata_for
        if bound is not forward_batch and not (isinstance(bound, GraphBatchKey) and bound.matches(forward_batch)):
            raise StaleMetadataError(_bound_description(bound), _batch_difference(bound, forward_batch))
        mode = forward_batch.forward_mode
        if out is not None:
            out = _out_view(out, forward_batch.num_tokens, layer, q.dtype, self.device)
        if mode.is_no_tokens():
            o = q.new_empty((0, layer.num_q_heads * layer.v_head_dim)) if out is None else out
            if extras.get("return_lse"):
                return o, torch.empty((0, layer.num_q_heads), dtype=torch.float32, device=q.device)
            return o
        q, k, v = self._validate(q, k, v, layer, forward_batch, save_kv_cache, extras)
        if mode.is_decode():
            result = self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **extras)
        else:
            result = self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **extras)
        if out is None:
            return result
        o = result[0] if isinstance(result, tuple) else result
        if o.data_ptr() != out.data_ptr():
            out.copy_(o.reshape(out.shape))
        return (out, result[1]) if isinstance(result, tuple) else out

    @abc.abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **extras: Any,
    ) -> Output:
        """DECODE: one query per request. q `[bs, Hq, D]`, k/v `[bs, Hkv, D]` / `[bs, Hkv, Dv]` (or None),
        validated; returns `[bs, Hq*Dv]` (and LSE `[bs, Hq]` float32 with return_lse)."""

    @abc.abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **extras: Any,
    ) -> Output:
        """EXTEND, MIXED, TARGET_VERIFY, DRAFT_EXTEND (and SPLIT_PREFILL where declared): q `[T, Hq, D]`,
        k/v `[T, Hkv, D]` / `[T, Hkv, Dv]` (or None), validated; returns `[T, Hq*Dv]` (and LSE)."""

    # ---- the ragged op (Feature.RAGGED; attn_core.contract.ragged) ---------------------------------------
    def init_ragged_metadata(self, ragged: RaggedBatch) -> None:
        """Once per ragged step (one vision-tower forward, say), before its layers: refuse the op unless
        `Feature.RAGGED` is declared (`UnsupportedFeatureError`; an MLA context too), validate `ragged`
        (`attn_core.contract.ragged.check_ragged_batch`, at the context's validation level: `InvalidBatchError`),
        build its metadata (`build_ragged_metadata`) and make it current for this batch object. On any
        error the previous ragged metadata is dropped. Independent of the paged path's metadata."""
        self.ragged_metadata = None
        self._ragged_for = None
        self.require(Feature.RAGGED, "the ragged op (ragged_attention)")
        if self.ctx.is_mla:
            raise UnsupportedFeatureError(self.name, "the ragged op on an MLA context")
        check_ragged_batch(ragged, self.device, full=self.ctx.validation == FULL)
        self.ragged_metadata = self.build_ragged_metadata(ragged)
        self._ragged_for = ragged

    @property
    def current_ragged_batch(self) -> Optional[RaggedBatch]:
        """The `RaggedBatch` the current ragged metadata was built for (None: none), so that callers
        sharing a backend across layers (`attn_core.VisionAttention`) build it once per batch."""
        return self._ragged_for

    def build_ragged_metadata(self, ragged: RaggedBatch) -> object:
        """What every `forward_ragged` call over `ragged` (validated) needs, built once: index arrays, a
        vendor plan. The default, for backends that need nothing: None."""
        return None

    def ragged_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ragged: RaggedBatch,
        *,
        scaling: Optional[float] = None,
        return_lse: bool = False,
    ) -> Output:
        """Attention of packed sequences, each over its own rows only (`attn_core.contract.ragged`): q `[T, Hq, D]`
        or `[T, Hq·D]`, k `[T, Hkv, D]`, v `[T, Hkv, Dv]` (heads and dims as in the context, its dtype and
        device), T = ragged.num_tokens; scores scaled by `scaling` (default D^-0.5); non-causal unless
        `ragged.causal`. Returns `[T, Hq·Dv]` in q's dtype (and the natural-log LSE `[T, Hq]` float32
        with `return_lse`). `init_ragged_metadata(ragged)` first (else `StaleMetadataError`); bad
        arguments raise `InvalidArgumentError` naming them, before any kernel.

        Example: `ragged = attn_core.contract.ragged.ragged_batch([3, 5], "cuda")`,
        `backend.init_ragged_metadata(ragged)`, then per layer `backend.ragged_attention(q, k, v, ragged)` with
        q/k/v of 8 rows."""
        if self._ragged_for is not ragged:
            bound = "init_ragged_metadata(ragged) called for this RaggedBatch before ragged_attention"
            found = "another RaggedBatch" if self._ragged_for is not None else "no ragged metadata"
            raise StaleMetadataError(bound, found, argument="ragged")
        ctx, dev, T = self.ctx, self.device, ragged.num_tokens
        q = ragged_heads("q", q, T, ctx.num_q_heads, ctx.head_dim, ctx.dtype, dev)
        k = ragged_heads("k", k, T, ctx.num_kv_heads, ctx.head_dim, ctx.dtype, dev)
        v = ragged_heads("v", v, T, ctx.num_kv_heads, ctx.v_head_dim or ctx.head_dim, ctx.dtype, dev)
        if return_lse:
            self.require(Feature.LSE_OUTPUT, "return_lse")
        scale = ctx.head_dim**-0.5 if scaling is None else scaling
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise InvalidArgumentError("scaling", "None or a float > 0", scaling)
        return self.forward_ragged(q, k, v, ragged, scaling=float(scale), return_lse=bool(return_lse))

    def forward_ragged(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ragged: RaggedBatch,
        *,
        scaling: float,
        return_lse: bool,
    ) -> Output:
        """The ragged op, for backends declaring `Feature.RAGGED` (called by `ragged_attention`, never
        directly): q `[T, Hq, D]`, k `[T, Hkv, D]`, v `[T, Hkv, Dv]` validated, `self.ragged_metadata`
        built for `ragged`; returns `[T, Hq·Dv]` in q's dtype (and the LSE `[T, Hq]` float32 with
        `return_lse`), without host synchronization. The default refuses."""
        raise UnsupportedFeatureError(self.name, "the ragged op (ragged_attention)")

    # ---- the pools (shared by every backend) --------------------------------------------------
    def req_to_token(self, forward_batch: Optional[ForwardBatch] = None) -> torch.Tensor:
        """The request→slot table: the batch's pool, else the context's (graph capture/replay pass no batch)."""
        pool = (forward_batch.req_to_token_pool if forward_batch is not None else None) or self.ctx.req_to_token_pool
        if pool is None:
            raise InvalidArgumentError("req_to_token_pool", "a pool on the batch or the context", None)
        return pool.req_to_token

    def kv_pool(self, forward_batch: Optional[ForwardBatch] = None) -> KVPool:
        """The step's KV pool: the batch's, else the context's (graph capture/replay pass no batch)."""
        pool = (forward_batch.token_to_kv_pool if forward_batch is not None else None) or self.ctx.token_to_kv_pool
        if pool is None:
            raise InvalidArgumentError("token_to_kv_pool", "a KV pool on the batch or the context", None)
        return pool

    def save_kv(
        self,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        *,
        clean_inputs: bool = False,
    ) -> KVPool:
        """Write the step's new K/V (when given) to their slots, through the pool's `set_kv_buffer` (the
        one checked write, `attn_core.ops.kv_write`): `write_slots(forward_batch, layer)`, i.e. the step's
        checked `out_cache_loc` (or `encoder_out_cache_loc` for a cross-attention layer), so no K/V lands
        outside the batch's legal slots; fp8 pools quantize with the layer's k_scale / v_scale; a token
        whose value is not finite is stored as K = NaN, V = 0. `clean_inputs`: those rows of k and v are
        cleaned in place too, for a backend whose kernel reads the new tokens' K/V from k and v (an MHA
        pool's `set_kv_buffer(..., clean_inputs=True)`). Returns the pool."""
        pool = self.kv_pool(forward_batch)
        if k is not None:
            slots = self._write_slots  # the common case first: the bound step's self-attention slots
            if slots is None or forward_batch is not self._metadata_for or layer.is_cross_attention:
                slots = self.write_slots(forward_batch, layer)
            if clean_inputs:  # the keyword only when asked: an engine's own pool may not take it
                pool.set_kv_buffer(layer, slots, k, v, layer.k_scale, layer.v_scale, clean_inputs=True)
            else:
                pool.set_kv_buffer(layer, slots, k, v, layer.k_scale, layer.v_scale)
        return pool

    # ---- validation (host-side metadata only, no device sync) ----------------------------------
    def require(self, feature: Feature, what: Optional[str] = None) -> None:
        if feature not in self.capabilities.features:
            raise UnsupportedFeatureError(self.name, what or feature.value)

    def _check_layer(self, layer: AttentionLayer) -> None:
        """The layer's features against the capabilities, its head counts and dims against the context.
        Per call, not cached: a layer's settings are plain attributes an engine may change."""
        ctx = self.ctx
        if layer.logit_cap > 0:
            self.require(Feature.LOGIT_CAP, f"logit_cap={layer.logit_cap} (layer {layer.layer_id})")
        if layer.sliding_window_size is not None:
            self.require(
                Feature.SLIDING_WINDOW, f"sliding_window_size={layer.sliding_window_size} (layer {layer.layer_id})"
            )
        if layer.attention_chunk_size is not None:
            self.require(
                Feature.CHUNKED_LOCAL_ATTENTION,
                f"attention_chunk_size={layer.attention_chunk_size} (layer {layer.layer_id})",
            )
        if layer.is_cross_attention:
            self.require(Feature.CROSS_ATTENTION, f"cross attention (layer {layer.layer_id})")
        if layer.attn_type is AttentionType.ENCODER_ONLY:
            self.require(Feature.NON_CAUSAL, f"non-causal (encoder-only) attention (layer {layer.layer_id})")
        if layer.num_kv_heads != ctx.num_kv_heads or layer.num_q_heads != ctx.num_q_heads:
            raise InvalidArgumentError(
                "layer heads",
                f"q/kv heads {ctx.num_q_heads}/{ctx.num_kv_heads} as in the context",
                (layer.num_q_heads, layer.num_kv_heads),
            )
        if layer.head_dim != ctx.head_dim or layer.v_head_dim != ctx.v_head_dim:
            raise InvalidArgumentError(
                "layer head_dim/v_head_dim",
                f"{ctx.head_dim}/{ctx.v_head_dim} as in the context",
                (layer.head_dim, layer.v_head_dim),
            )

    def _check_window_pool(self, layer: AttentionLayer, batch: ForwardBatch) -> None:
        """A layer kept in a sliding-window KV pool needs a backend that translates its key slots, and a
        window no larger than the pool's (older keys are released)."""
        pool = window_pool_of(batch.token_to_kv_pool or self.ctx.token_to_kv_pool)
        if pool is None or not pool.is_window_layer(layer.layer_id):
            return
        self.require(Feature.SLIDING_WINDOW_POOL, f"a sliding-window KV pool (layer {layer.layer_id})")
        if layer.sliding_window_size is None or layer.sliding_window_size > pool.window:
            raise InvalidArgumentError(
                f"layer {layer.layer_id} sliding_window_size",
                f"a window <= the window pool's {pool.window} (the layer's K/V live in the window pool)",
                layer.sliding_window_size,
            )

    def _validate(self, q, k, v, layer, batch: ForwardBatch, save_kv_cache: bool, extras):
        """Check the per-layer arguments (host metadata only, no device sync) and return q, k, v as
        `[rows, heads, dim]` views. Checks run in a fixed order, so an input with several faults always
        gets the same error. Per layer call: the common case (no extras; self-attention with q, k and v
        on the device, in the context's dtype and shape; MLA: v may be None) is decided by one cheap
        expression, and the argument-by-argument diagnosis runs only outside it."""
        mode = batch.forward_mode
        caps = self.capabilities
        if mode not in caps.forward_modes:
            raise UnsupportedFeatureError(self.name, f"forward mode {mode.name}")
        if extras:
            unknown = extras.keys() - CORE_EXTRAS - self.extra_forward_args
            if unknown:
                raise InvalidArgumentError(
                    "extras",
                    f"keyword arguments among {sorted(CORE_EXTRAS | self.extra_forward_args)}",
                    sorted(unknown),
                )
        self._check_layer(layer)
        self._check_window_pool(layer, batch)
        if layer.k_scale is not None or layer.v_scale is not None:  # core's scale check, for every backend alike
            kv_scales(layer, self.kv_pool(batch))
        if extras:
            if extras.get("return_lse"):
                self.require(Feature.LSE_OUTPUT, "return_lse")
            sinks = extras.get("sinks")
            if sinks is not None:
                self.require(Feature.SINKS, "attention sinks")
                tensor = isinstance(sinks, torch.Tensor)
                if not tensor or not sinks.dtype.is_floating_point or sinks.device != self.device:
                    found = (sinks.dtype, sinks.device) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
                    raise InvalidArgumentError("sinks", f"a floating-point tensor on {self.device}", found)
                if tuple(sinks.shape) != (layer.num_q_heads,):
                    raise InvalidArgumentError("sinks", f"shape ({layer.num_q_heads},)", tuple(sinks.shape))
        if mode.is_target_verify() and batch.spec_info is not None and batch.spec_info.custom_mask is not None:
            self.require(Feature.CUSTOM_MASK, "custom masks (TARGET_VERIFY)")

        T = batch.num_tokens
        hq, d, hkv = layer.num_q_heads, layer.head_dim, layer.num_kv_heads
        device, dtype, mla = self.device, self.ctx.dtype, self.ctx.is_mla
        if (
            k is not None
            and not layer.is_cross_attention
            and q.device == device
            and k.device == device
            and q.dtype == dtype
            and k.dtype == dtype
            and (v.device == device and v.dtype == dtype if v is not None else mla)
        ):
            qh, kh = _as_heads(q, T, hq, d), _as_heads(k, T, hkv, d)
            vh = v if mla else _as_heads(v, T, hkv, layer.v_head_dim)  # MLA: v (or None) as given
            if qh is not None and kh is not None and (vh is not None or mla):
                return qh, kh, vh
        q = _heads_view("q", q, T, hq, d)
        if q.device != device:
            raise InvalidArgumentError("q", f"a tensor on {device}", q.device)
        check_forward_dtypes(q, k, v, self.ctx)
        if layer.is_cross_attention:
            rows = 0 if batch.encoder_out_cache_loc is None else batch.encoder_out_cache_loc.shape[0]
        else:
            rows = T
        for name, x in (("k", k), ("v", v)):
            if x is not None and x.device != device:
                raise InvalidArgumentError(name, f"a tensor on {device}", x.device)
        if k is not None:
            k = _heads_view("k", k, rows, hkv, d)
            if v is not None and not mla:
                v = _heads_view("v", v, rows, hkv, layer.v_head_dim)
            elif v is None and not mla:
                raise InvalidArgumentError("v", "a tensor when k is given", None)
        elif save_kv_cache and not layer.is_cross_attention:
            raise InvalidArgumentError("k", "the new tokens' keys when save_kv_cache=True", None)
        return q, k, v


def _batch_facts(batch) -> dict[str, object]:
    """What `StaleMetadataError` compares: mode, requests, tokens and the sum of seq_lens (host values)."""
    return {
        "mode": batch.forward_mode.name,
        "requests": batch.batch_size,
        "tokens": getattr(batch, "num_tokens", "?"),
        "seq_lens_sum": getattr(batch, "seq_lens_sum", "?"),
    }


def _batch_difference(bound: Union[ForwardBatch, GraphBatchKey, None], batch: ForwardBatch) -> str:
    """The batch `forward` got, and what differs from the one the metadata is for: "another batch:
    tokens 4 (metadata: 7), seq_lens_sum 812 (metadata: 815)", or, when every compared value is equal,
    that it is another object with the same shape (the check is by identity)."""
    got = _batch_facts(batch)
    if bound is None:
        return "a batch ({})".format(", ".join(f"{k} {v}" for k, v in got.items()))
    if isinstance(bound, GraphBatchKey):
        want = {"mode": bound.forward_mode.name, "requests": bound.batch_size}
    else:
        want = _batch_facts(bound)
    differs = [f"{k} {got[k]} (metadata: {want[k]})" for k in want if got[k] != want[k]]
    if differs:
        return "another batch: " + ", ".join(differs)
    same = ", ".join(f"{k} {got[k]}" for k in want)
    return (
        f"another ForwardBatch object with the same {same}; the check is by identity: "
        "call init_forward_metadata with the very batch object passed to forward"
    )


def _bound_description(bound: Union[ForwardBatch, GraphBatchKey, None]) -> str:
    if bound is None:
        return "init_forward_metadata(batch) called for this batch before forward (no current metadata)"
    if isinstance(bound, GraphBatchKey):
        return (
            f"the CUDA-graph batch the metadata was captured/replayed for ({bound.forward_mode.name}, "
            f"{bound.batch_size} requests)"
        )
    return (
        f"the batch init_forward_metadata was last called with ({bound.forward_mode.name}, {bound.batch_size} requests)"
    )


def _out_view(out, rows: int, layer: AttentionLayer, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The engine's output buffer `out` as a `[rows, Hq*Dv]` view of its memory (no copy), or
    `InvalidArgumentError` naming `out`: a tensor of that shape or `[rows, Hq, Dv]`, of `dtype`, on
    `device`, whose rows can be viewed flat. Example: a contiguous `[5, 4, 16]` buffer with Hq 4, Dv 16
    gives a `[5, 64]` view of it."""
    width = layer.num_q_heads * layer.v_head_dim
    if not isinstance(out, torch.Tensor):
        raise InvalidArgumentError("out", f"a tensor of shape ({rows}, {width})", type(out).__name__)
    if tuple(out.shape) not in ((rows, width), (rows, layer.num_q_heads, layer.v_head_dim)):
        raise InvalidArgumentError(
            "out", f"shape ({rows}, {width}) or ({rows}, {layer.num_q_heads}, {layer.v_head_dim})", tuple(out.shape)
        )
    if out.dtype != dtype or out.device != device:
        raise InvalidArgumentError("out", f"dtype {dtype} on {device} (q's)", (out.dtype, out.device))
    try:
        return out.view(rows, width)
    except RuntimeError:
        raise InvalidArgumentError(
            "out", "a buffer whose rows are viewable as one flat row each (no copy)", tuple(out.stride())
        ) from None


def _as_heads(x: torch.Tensor, rows: int, heads: int, dim: int) -> Optional[torch.Tensor]:
    """`x` as `[rows, heads, dim]`: itself when it has that shape, a reshape of `[rows, heads * dim]`,
    else None. E.g. a `[5, 64]` tensor with heads=4, dim=16 gives a `[5, 4, 16]` view."""
    shape = x.shape
    if shape == (rows, heads, dim):
        return x
    if shape == (rows, heads * dim):
        return x.reshape(rows, heads, dim)
    return None


def _heads_view(name: str, x: torch.Tensor, rows: int, heads: int, dim: int) -> torch.Tensor:
    """`_as_heads`, or `InvalidArgumentError` naming `name` and both accepted shapes."""
    h = _as_heads(x, rows, heads, dim)
    if h is None:
        raise InvalidArgumentError(name, f"shape ({rows}, {heads}, {dim}) or ({rows}, {heads * dim})", tuple(x.shape))
    return h


# `ATTN_DEBUG_PATHS=1`: report every layer call's path from the start (attn_core.contract.debug_paths)
debug_paths.attach(AttentionBackend)
