"""attn-triton: paged-KV decode and extend attention kernels in Triton for attn-core.

Import-light: importing the package imports neither torch nor triton (the registry reads `spec.SPEC`
during discovery); kernels load with `attn_triton.backend`.
"""

__version__ = "0.1.0"
