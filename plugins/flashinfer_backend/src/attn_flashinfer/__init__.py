"""attn-flashinfer: FlashInfer's paged-KV attention wrappers behind attn-core's backend contract.

Import-light: importing the package imports neither torch nor flashinfer; the backend class lives in
`attn_flashinfer.backend` and is loaded through the registry (`attn_core.discovery.registry.create_backend`).
"""
