"""attn-wave: the `wave` attention backend (AMD GPUs through Wave's attention templates, wave-lang).

Import-light: the backend (`attn_wave.backend`) and wave_lang load only when a backend is created.
`attn_wave.testing` holds the plain-torch emulation of the templates for CPU tests. Never ran on an AMD
GPU (README.md).
"""

__version__ = "0.1.0"
