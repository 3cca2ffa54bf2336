"""Test support for attn-aiter: `emulated_ops` (AITER's attention operators in plain torch, from their
documentation) and `emulated_aiter` (an `aiter` package built from them, to install in `sys.modules`)."""
