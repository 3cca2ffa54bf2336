"""Deterministic mode: one request placed in three different batches gives bitwise-equal outputs."""

from __future__ import annotations

import pytest
import torch
from triton_determinism_checks import DECODE_BATCHES, EXTEND_BATCHES, target_rows
from triton_helpers import factory, requires_interpreter

from attn_triton.config import SplitPolicy

pytestmark = requires_interpreter

# default mode: the batch size picks max_splits (16 // (bs * 2) programs), so the target's split layout
# changes with the batch; deterministic mode: at most 4 splits of >= 8 keys, whatever the batch
POLICY = SplitPolicy(min_split_len=8, waves=4.0, cap=8, deterministic_max_splits=4, deterministic_min_split_len=8)


MLA = dict(arch="mla", kv_lora_rank=32, qk_rope_head_dim=8, num_q_heads=16)


@pytest.mark.parametrize(
    "mode,batches,arch",
    [("DECODE", DECODE_BATCHES, {}), ("EXTEND", EXTEND_BATCHES, {}), ("DECODE", DECODE_BATCHES, MLA)],
    ids=["DECODE", "EXTEND", "MLA-DECODE"],
)
def test_one_request_three_batches_bitwise_equal(mode, batches, arch):
    f = factory(split_policy=POLICY)
    outs = [target_rows(f, mode, reqs, t, deterministic=True, page_size=16, **arch) for reqs, t in batches]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_default_mode_decode_split_layout_follows_the_batch():
    """Shows the determinism test above is not vacuous: without the flag the bits change."""
    f = factory(split_policy=POLICY)
    outs = [target_rows(f, "DECODE", reqs, t, deterministic=False, page_size=16) for reqs, t in DECODE_BATCHES]
    assert not all(torch.equal(outs[0], o) for o in outs[1:])
    assert all(torch.allclose(outs[0], o, rtol=1e-5, atol=1e-6) for o in outs[1:])
