"""A spec targeting backend API 2.0, which attn-core 0.1 (API 1.x) must refuse."""

from attn_core.backends.torch_native.spec import CAPABILITIES
from attn_core.contract.spec import BackendSpec

SPEC = BackendSpec(
    name="example_api2",
    summary="Written for backend API 2.0",
    capabilities=CAPABILITIES,
    distribution="attn-example-api2",
    backend_class="attn_core.backends.torch_native.backend:TorchNativeBackend",
    api_version="2.0",
)
