"""`CudaGraphStep` (checks, trimming, derived fields) and `graph_padding` (the one padding rule)."""

from __future__ import annotations

import pytest
import torch

from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.contract.backend import AttentionBackend
from attn_core.contract.batch import SpecInfo
from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import CudaGraphStep, GraphPadding, graph_padding, graph_tokens_per_request
from attn_core.testing.harness import AttnCase, make_env

ROWS = torch.arange(6)
LENS = torch.tensor([5, 9, 1, 1, 1, 1], dtype=torch.int32)


def test_tokens_per_request_by_mode():
    assert graph_tokens_per_request(ForwardMode.DECODE) == 1
    assert graph_tokens_per_request(ForwardMode.DECODE, 5) == 1
    assert graph_tokens_per_request(ForwardMode.TARGET_VERIFY, 4) == 4
    assert graph_tokens_per_request(ForwardMode.TARGET_VERIFY, 0) is None
    assert graph_tokens_per_request(ForwardMode.EXTEND, 4) is None


@pytest.mark.parametrize("fill", [1, 3])
@pytest.mark.parametrize("mode,nd", [(ForwardMode.DECODE, 0), (ForwardMode.TARGET_VERIFY, 4)])
def test_padding_rows_never_have_a_negative_prefix(mode, nd, fill):
    for bs in range(0, 9):
        p = graph_padding(mode, bs, [8, 2, 4], fill, nd)
        t = 1 if mode.is_decode() else nd
        assert p.padded_bs == min(s for s in (2, 4, 8) if s >= max(bs, 1))
        assert p.tokens_per_request == t and p.num_tokens == p.padded_bs * t
        assert p.num_padding == p.padded_bs - bs
        # cached keys before the row's own tokens: fill - 1 >= 0; every padding row sees >= fill keys
        assert p.seq_len - t == fill - 1 and p.seq_len >= fill


def test_padding_worked_example():
    assert graph_padding(ForwardMode.TARGET_VERIFY, 3, [2, 4], 1, 3) == GraphPadding(
        bs=3, padded_bs=4, tokens_per_request=3, prefix_len=0
    )


def test_padding_errors_name_the_argument():
    with pytest.raises(InvalidArgumentError, match="^bs"):
        graph_padding(ForwardMode.DECODE, 5, [1, 4], 1)
    with pytest.raises(InvalidArgumentError, match="^bs"):
        graph_padding(ForwardMode.DECODE, -1, [1, 4], 1)
    with pytest.raises(InvalidArgumentError, match="^fill"):
        graph_padding(ForwardMode.DECODE, 1, [1], 0)
    with pytest.raises(InvalidArgumentError, match="^forward_mode"):
        graph_padding(ForwardMode.TARGET_VERIFY, 1, [1], 1, 0)
    with pytest.raises(InvalidArgumentError, match="^forward_mode"):
        graph_padding(ForwardMode.EXTEND, 1, [1], 1, 4)


def test_step_trims_to_bs_and_derives_counts():
    spec = SpecInfo(num_draft_tokens=3)
    step = CudaGraphStep(
        forward_mode="target_verify", bs=2, req_pool_indices=ROWS, seq_lens=LENS, seq_lens_cpu=LENS, spec_info=spec
    )
    assert step.forward_mode is ForwardMode.TARGET_VERIFY
    assert step.req_pool_indices.tolist() == [0, 1] and step.seq_lens.tolist() == [5, 9]
    assert step.seq_lens.data_ptr() == LENS.data_ptr()  # a view: graph buffers keep their address
    assert step.num_tokens == 6 and step.tokens_per_request == 3 and step.seq_lens_sum == 14
    d = CudaGraphStep(forward_mode=ForwardMode.DECODE, bs=3, req_pool_indices=ROWS, seq_lens=LENS)
    assert d.num_tokens == 3 and d.seq_lens_sum is None and d.host_seq_lens().tolist() == [5, 9, 1]
    # no draft count: a replay of TARGET_VERIFY leaves the count to what was captured
    assert (
        CudaGraphStep(forward_mode=ForwardMode.TARGET_VERIFY, bs=2, req_pool_indices=ROWS, seq_lens=LENS).num_tokens
        is None
    )


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        (dict(bs=0), "bs"),
        (dict(bs=2.0), "bs"),
        (dict(bs=True), "bs"),
        (dict(forward_mode="warp"), "forward_mode"),
        (dict(bs=7), "req_pool_indices"),
        (dict(seq_lens=LENS.view(2, 3)), "seq_lens"),
        (dict(seq_lens=None), "seq_lens"),
        (dict(num_tokens=4), "num_tokens"),  # DECODE: one token per request
        (dict(forward_mode=ForwardMode.TARGET_VERIFY, num_tokens=7), "num_tokens"),  # not a multiple of bs
        (
            dict(forward_mode=ForwardMode.TARGET_VERIFY, spec_info=SpecInfo(num_draft_tokens=2), num_tokens=9),
            "num_tokens",
        ),
        (dict(seq_lens_cpu=LENS, seq_lens_sum=3), "seq_lens_sum"),
        (dict(encoder_lens=torch.ones(2, dtype=torch.int32)), "encoder_lens"),
    ],
)
def test_step_errors_name_the_argument(kwargs, argument):
    args = dict(forward_mode=ForwardMode.DECODE, bs=3, req_pool_indices=ROWS, seq_lens=LENS) | kwargs
    with pytest.raises(InvalidArgumentError, match=f"^{argument}"):
        CudaGraphStep(**args)


def test_step_is_frozen():
    step = CudaGraphStep(forward_mode=ForwardMode.DECODE, bs=1, req_pool_indices=ROWS, seq_lens=LENS)
    with pytest.raises(AttributeError):
        step.bs = 2


def test_sglang_entry_points_build_the_step():
    """The positional SGLang-named methods hand the hooks one step with the same values."""
    seen = []

    class Recording(TorchNativeBackend):
        def capture_cuda_graph_metadata(self, step):
            seen.append(("capture", step))
            super().capture_cuda_graph_metadata(step)

        def replay_cuda_graph_metadata(self, step):
            seen.append(("replay", step))
            super().replay_cuda_graph_metadata(step)

    env = make_env(AttnCase(ForwardMode.DECODE, ((5, 1), (9, 1))))
    backend = Recording(env.ctx)
    backend.init_cuda_graph_state(4, 4)
    pad_rows, pad_lens = torch.zeros(4, dtype=torch.int64), torch.ones(4, dtype=torch.int32)
    backend.init_forward_metadata_capture_cuda_graph(4, 4, pad_rows, pad_lens, None, ForwardMode.DECODE, None)
    b = env.batch
    rows, lens = torch.cat([b.req_pool_indices, pad_rows[:2]]), torch.cat([b.seq_lens, pad_lens[:2]])
    backend.init_forward_metadata_replay_cuda_graph(
        4, rows, lens, int(lens.sum()), None, ForwardMode.DECODE, None, lens
    )
    (k0, cap), (k1, rep) = seen
    assert (k0, cap.bs, cap.num_tokens, cap.seq_lens_cpu, cap.seq_lens_sum) == ("capture", 4, 4, None, None)
    assert (k1, rep.bs, rep.num_tokens, rep.seq_lens_sum) == ("replay", 4, 4, int(lens.sum()))
    assert rep.seq_lens_cpu.tolist() == lens.tolist()
    with pytest.raises(InvalidArgumentError, match="^num_tokens"):
        backend.init_forward_metadata_capture_cuda_graph(4, 8, pad_rows, pad_lens, None, ForwardMode.DECODE, None)


def test_base_class_hooks_refuse_graphs():
    class NoGraphs(AttentionBackend):
        name = "no_graphs"
        capabilities = TorchNativeBackend.capabilities

        def build_forward_metadata(self, forward_batch):
            return None

        def forward_decode(self, *a, **k):
            pass

        def forward_extend(self, *a, **k):
            pass

    backend = NoGraphs(make_env(AttnCase(ForwardMode.DECODE, ((5, 1),))).ctx)
    with pytest.raises(UnsupportedFeatureError, match="CUDA graphs"):
        backend.init_forward_metadata_capture_cuda_graph(1, 1, ROWS, LENS, None, ForwardMode.DECODE, None)
    with pytest.raises(UnsupportedFeatureError, match="CUDA graphs"):
        backend.init_forward_metadata_replay_cuda_graph(1, ROWS, LENS, 5, None, ForwardMode.DECODE, None, None)
