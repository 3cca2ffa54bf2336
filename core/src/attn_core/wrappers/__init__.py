"""Wrappers that compose any backends (DESIGN §5): `HybridAttnBackend` (decode on one backend, the rest
on another), `TboAttnBackend` (two-batch overlap) with its batch splitter, and `MultiStepDraftBackend`
(one speculative-draft wrapper for every backend)."""
