"""attn-aiter: the `aiter` attention backend (AMD GPUs through AMD's AITER kernels).

Import-light: the backend (`attn_aiter.backend`) and AITER load only when a backend is created.
`attn_aiter.testing.emulated_ops` holds plain-torch emulations of the operators for CPU tests. Never
ran on an AMD GPU (README.md).
"""

__version__ = "0.1.0"
