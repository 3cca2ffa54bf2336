"""The kit's hostile batches at the default validation ("basic") on the accelerator's path, run on CPU
tensors (`attn_core.testing.device_path.accelerator_checks`: host checks only, then the Triton step check on
the device tensors, faults raised one step late): what a GPU runs. Found on an H100: the eager plan built its
tile table with `repeat_interleave(device counts, output_size=host total)`, so device extend lengths other
than their host copies (`hostile-basic-extend_device_differs`) tripped a device-side assert (an untyped
error that kills the CUDA context) instead of the step check's DeviceFaultError."""

from __future__ import annotations

import pytest

from attn_core.testing import ConformanceSuite
from attn_core.testing.device_path import accelerator_checks


@pytest.fixture(autouse=True)
def _accelerator_path():
    with accelerator_checks("triton"):
        yield


class TestDoubleSparsityHostileBasicDevicePath(ConformanceSuite):
    backend = "double_sparsity"
    options = {"sparse_decode_threshold": 1 << 30}
    quick = True
    only = ("hostile-basic-extend", "hostile-basic-seq", "hostile-basic-negative", "hostile-basic-host")


class TestDualChunkHostileBasicDevicePath(ConformanceSuite):
    backend = "dual_chunk"
    options = {"chunk_size": 1 << 30}
    quick = True
    only = ("hostile-basic-extend", "hostile-basic-seq", "hostile-basic-negative", "hostile-basic-host")


#: EXTEND requests whose first has a whole number of tiles (block_t 8 for 4 q heads / 2 KV heads under the
#: interpreter): one more device token gives its device lengths one more tile than the host copies
TILE_EDGE_REQUESTS = [(3, 16), (40, 5), (0, 9)]


@pytest.mark.parametrize("name", ["double_sparsity", "dual_chunk"])
@pytest.mark.parametrize("hostile_name", ["extend_device_differs", "extend_start_loc_differs"])
def test_device_lengths_a_tile_longer_fault_one_step_late(name, hostile_name):
    from attn_core.contract.forward_mode import ForwardMode
    from attn_core.testing.harness import AttnCase
    from attn_core.testing.hostile import hostile_cases, hostile_check
    from attn_core.testing.target import resolve_target

    options = {"sparse_decode_threshold": 1 << 30} if name == "double_sparsity" else {"chunk_size": 1 << 30}
    case = AttnCase(
        "EXTEND", TILE_EDGE_REQUESTS, num_q_heads=4, num_kv_heads=2, head_dim=32, dtype="float32", device="cpu"
    )
    hostile = next(h for h in hostile_cases([ForwardMode.EXTEND]) if h.name == hostile_name)
    detail = hostile_check(resolve_target(name, options=options), case, hostile, "basic")()
    assert detail.startswith("DeviceFaultError (next step)"), detail
