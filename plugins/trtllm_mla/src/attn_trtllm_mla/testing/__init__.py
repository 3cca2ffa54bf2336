"""Test support for attn-trtllm-mla's Blackwell backends: `blackwell_stand_ins` (float64 stand-ins of the
TRT-LLM MHA and CUTLASS MLA kernels, from their documented semantics) and the CPU classes that call them."""
