"""attn-core's pytest plugin (entry point `pytest11: attn_core`): the conformance kit's options.

Torch-free and tiny: it loads in every pytest session of an environment with attn-core installed.
"""

from __future__ import annotations


def pytest_addoption(parser) -> None:
    group = parser.getgroup("attn-core", "attn-core conformance kit (attn_core.testing.ConformanceSuite)")
    group.addoption(
        "--attn-device", dest="attn_device", default=None, help="device of the conformance suite: cpu, cuda or cuda:N"
    )
    group.addoption(
        "--attn-quick",
        dest="attn_quick",
        action="store_true",
        default=False,
        help="the quick (smaller) conformance profile",
    )
