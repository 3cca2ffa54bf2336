"""attn-cpu-amx: the `cpu_amx` attention backend (alias `intel_amx`) for attn.

Kernels are C++ built on first use (see `attn_cpu_amx.build`); the path (AMX, AVX-512, portable) is
chosen from the CPU's flags (see `attn_cpu_amx.isa`). Importing this package imports no torch.
"""

__version__ = "0.1.0"
