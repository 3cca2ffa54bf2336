"""Registry entry of the example backend. Import-light: attn_core data types only, no torch."""

from attn_core.contract.capabilities import Capabilities, Feature
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.spec import BackendSpec
from attn_core.discovery.probes import module_missing

CAPABILITIES = Capabilities(
    devices=frozenset({"cpu"}),
    q_dtypes=frozenset({"float32", "bfloat16"}),
    kv_dtypes=frozenset({"float32", "bfloat16"}),
    page_sizes=frozenset({1, 16}),
    forward_modes=frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED}),
    features=frozenset({Feature.SLIDING_WINDOW}),
)

SPEC = BackendSpec(
    name="example",
    summary="Example plugin: the reference kernels behind a narrower contract",
    capabilities=CAPABILITIES,
    distribution="attn-example",
    backend_class="attn_example.backend:ExampleBackend",
    probe_fn=lambda: module_missing("torch", "pip install torch"),
)
