"""The engine API: request handles and their pool, building a step from (request, new tokens), engine-shaped
batches over engine-owned memory, and the CUDA-graph runner and its bookkeeping."""
