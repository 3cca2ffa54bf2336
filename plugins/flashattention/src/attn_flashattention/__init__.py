"""attn-flashattention: FlashAttention-4 (flash-attn-4, CuTe DSL) as the attn-core backend `fa4`.

The entry point is `attn_flashattention.spec:SPEC` (import-light); the backend class,
`attn_flashattention.backend.FlashAttention4Backend`, imports FA4 when it is created.
"""
