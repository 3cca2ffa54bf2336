"""CUDA-graph metadata path on the CPU (interpreter): capture with dummy inputs, replay with the real
batch, compare with eager metadata. The GPU file captures real CUDA graphs with the same checks."""

from __future__ import annotations

import pytest
import torch
from triton_graph_checks import check_graph_matches_eager
from triton_helpers import requires_interpreter, small_split_factory

from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.testing.harness import AttnCase, make_env

pytestmark = requires_interpreter

GRAPH_CASES = [
    AttnCase("DECODE", [(7, 1), (40, 1), (0, 1)], return_lse=True),
    AttnCase("DECODE", [(30, 1), (3, 1)], page_size=16, sliding_window=5, sinks=True, dtype="float16"),
    AttnCase("DECODE", [(20, 1), (9, 1)], arch="mla", kv_lora_rank=32, qk_rope_head_dim=8, num_q_heads=4),
    # MLA verify on the folded MLA kernel (tree masks, and drafts attending causally)
    AttnCase(
        "TARGET_VERIFY",
        [(15, 4), (3, 4)],
        arch="mla",
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        num_q_heads=4,
        return_lse=True,
    ),
    AttnCase(
        "TARGET_VERIFY",
        [(9, 2), (30, 2)],
        arch="mla",
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        num_q_heads=4,
        custom_mask=False,
    ),
    AttnCase("TARGET_VERIFY", [(7, 4), (25, 4)], return_lse=True),
    AttnCase("TARGET_VERIFY", [(12, 3), (2, 3)], custom_mask=False, page_size=16),
    AttnCase("DECODE", [(30, 1), (3, 1)], page_size=16, dtype="float16", kv_dtype="float8_e4m3fn"),
    AttnCase("TARGET_VERIFY", [(7, 4), (25, 4)], kv_dtype="float8_e4m3fn"),
]


@pytest.mark.parametrize("case", GRAPH_CASES, ids=[c.describe() for c in GRAPH_CASES])
@pytest.mark.parametrize("pad", [0, 2])
def test_graph_replay_equals_eager(case, pad):
    check_graph_matches_eager(small_split_factory(), case, pad=pad)


def test_graph_errors_are_typed():
    env = make_env(AttnCase("EXTEND", [(3, 4)]))
    backend = small_split_factory()(env.ctx)
    b = env.batch
    with pytest.raises(InvalidArgumentError, match="init_cuda_graph_state"):
        backend.init_forward_metadata_capture_cuda_graph(
            1, 1, b.req_pool_indices, b.seq_lens, None, ForwardMode.DECODE, None
        )
    backend.init_cuda_graph_state(2, 8)
    with pytest.raises(UnsupportedFeatureError, match="EXTEND"):
        backend.init_forward_metadata_capture_cuda_graph(
            1, 4, b.req_pool_indices, b.seq_lens, None, ForwardMode.EXTEND, None
        )
    with pytest.raises(InvalidArgumentError, match="bs"):
        backend.init_forward_metadata_replay_cuda_graph(
            1, b.req_pool_indices, b.seq_lens, 7, None, ForwardMode.DECODE, None, None
        )
    with pytest.raises(InvalidArgumentError):
        backend.init_forward_metadata_capture_cuda_graph(
            3, 3, b.req_pool_indices, b.seq_lens, None, ForwardMode.DECODE, None
        )
    assert backend.get_cuda_graph_seq_len_fill_value() == 1
    seq = torch.ones(1, dtype=torch.int32)
    backend.init_forward_metadata_capture_cuda_graph(1, 1, b.req_pool_indices, seq, None, ForwardMode.DECODE, None)
