"""The example backend: torch_native's kernels, declaring (and so promising) less."""

from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_example.spec import CAPABILITIES


class ExampleBackend(TorchNativeBackend):
    name = "example"
    capabilities = CAPABILITIES
