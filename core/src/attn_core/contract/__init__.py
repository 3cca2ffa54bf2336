"""The backend contract: what a backend implements and an engine calls, and the types both see (errors, forward
modes, capabilities, phases, the spec, the context, the layer, the batch, the backend base class, batch
validation, the CUDA-graph step, the ragged op, bidirectional spans, the debug-path switch)."""
