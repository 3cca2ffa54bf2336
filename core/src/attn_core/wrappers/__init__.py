"""Wrappers that compose any backends (docs/design.md §5): `HybridAttnBackend` (decode on one backend, the rest
on another), `TboAttnBackend` (two-batch overlap) with its batch splitter, and `MultiStepDraftBackend`
(one speculative-draft wrapper for every backend)."""

from attn_core.batching.tbo_split import TboSplit, compute_tbo_split, split_batch, split_forward_batch
from attn_core.wrappers.hybrid import HybridAttnBackend
from attn_core.wrappers.multi_step_draft import MultiStepDraftBackend, allocate_draft_slots
from attn_core.wrappers.tbo import TboAttnBackend

__all__ = [
    "HybridAttnBackend",
    "MultiStepDraftBackend",
    "TboAttnBackend",
    "TboSplit",
    "allocate_draft_slots",
    "compute_tbo_split",
    "split_batch",
    "split_forward_batch",
]
