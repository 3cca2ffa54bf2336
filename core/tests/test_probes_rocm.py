"""`attn_core.discovery.probes.needs_rocm`: the reason given without an AMD GPU, without torch being imported."""

import subprocess
import sys

from attn_core.discovery.probes import NEEDS_ROCM, needs_rocm


def test_no_device_node_means_no_amd_gpu(tmp_path):
    assert needs_rocm(str(tmp_path / "kfd")) == f"{NEEDS_ROCM} (no AMD GPU device on this machine)"


def test_the_reason_costs_no_torch_import(tmp_path):
    code = (
        "import sys\n"
        "from attn_core.discovery.probes import needs_rocm\n"
        f"print(needs_rocm({str(tmp_path / 'kfd')!r}))\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    assert out == [f"{NEEDS_ROCM} (no AMD GPU device on this machine)", "False"]


def test_a_cpu_torch_is_not_a_rocm_build(tmp_path):
    node = tmp_path / "kfd"
    node.write_text("")  # a device node that exists, as on an AMD machine
    reason = needs_rocm(str(node))
    assert reason.startswith(NEEDS_ROCM) and "is not a ROCm build" in reason
