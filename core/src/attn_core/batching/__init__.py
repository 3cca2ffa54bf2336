"""Batch arithmetic: pure functions of a step's lengths, rows and positions (positions, query-length helpers, two-
batch-overlap splits, chunk plans, chunked prefill, cascade and chunked-local batches)."""
