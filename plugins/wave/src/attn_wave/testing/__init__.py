"""Test support for attn-wave: `emulated_kernels` (Wave's attention templates in plain torch, from their
documentation) and `emulated_wave_lang` (a `wave_lang` module tree built from them, for `sys.modules`)."""
