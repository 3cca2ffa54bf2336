"""Test support for attn-ascend: `emulated_ops` (the torch_npu operators in plain torch) and
`emulated_torch_npu` (a `torch_npu` module built from them, to install in `sys.modules` in tests)."""
