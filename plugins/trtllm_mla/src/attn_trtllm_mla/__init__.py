"""attn-trtllm-mla: TensorRT-LLM's MLA decode kernels (FlashInfer's `trtllm_batch_decode_with_kv_cache_mla`)
behind attn-core's backend contract, as a subclass of attn-flashinfer's `flashinfer_mla`.

Import-light: importing the package imports neither torch nor flashinfer; the backend class lives in
`attn_trtllm_mla.backend` and is loaded through the registry.
"""
