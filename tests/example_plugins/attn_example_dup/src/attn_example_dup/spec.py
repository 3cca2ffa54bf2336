"""A second distribution registering a backend named "example"."""

from attn_core.backends.torch_native.spec import CAPABILITIES
from attn_core.contract.spec import BackendSpec

SPEC = BackendSpec(
    name="example",
    summary="Duplicate of attn-example's name",
    capabilities=CAPABILITIES,
    distribution="attn-example-dup",
    backend_class="attn_core.backends.torch_native.backend:TorchNativeBackend",
)
