"""attn-ascend: the `ascend` attention backend (Huawei Ascend NPUs through torch_npu's operators).

Import-light: the backend (`attn_ascend.backend`) and torch_npu load only when a backend is created.
`attn_ascend.testing.emulated_ops` holds plain-torch emulations of the operators for CPU tests.
"""

__version__ = "0.1.0"
