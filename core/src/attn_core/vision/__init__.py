"""Vision towers: `VisionAttention` (a ViT attention block over a backend's ragged op) and the dummy-head helpers
for checkpoints padded for tensor parallelism."""
