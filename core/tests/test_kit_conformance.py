"""torch_native through the pytest face of the kit, exactly as a plugin's tests/test_conformance.py uses it."""

from attn_core.testing import ConformanceSuite


class TestTorchNativeConformance(ConformanceSuite):
    backend = "torch_native"
    quick = True
