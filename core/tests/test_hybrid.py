"""HybridAttnBackend: each mode goes to the right child (asserted on recorded calls) and outputs equal
the float64 reference; derived capabilities; typed errors for incompatible children."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.backends.torch_native.spec import CAPABILITIES
from attn_core.contract.capabilities import CudaGraphLevel, Feature
from attn_core.contract.context import BackendContext
from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.memory import MHATokenToKVPool
from attn_core.testing.harness import AttnCase, assert_case, make_env, make_layer
from attn_core.wrappers.hybrid import HybridAttnBackend


class Recording(TorchNativeBackend):
    """torch_native that logs (tag, method, mode) of every metadata / forward / graph call."""

    def __init__(self, ctx, tag, log, **options):
        super().__init__(ctx, **options)
        self.tag, self.log = tag, log

    def init_forward_metadata(self, forward_batch):
        self.log.append((self.tag, "metadata", forward_batch.forward_mode))
        super().init_forward_metadata(forward_batch)

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        self.log.append((self.tag, "forward", forward_batch.forward_mode))
        return super().forward(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **extras)

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        self.log.append((self.tag, "graph_state", None))
        super().init_cuda_graph_state(max_bs, max_num_tokens)

    def capture_cuda_graph_metadata(self, step):
        self.log.append((self.tag, "capture", step.forward_mode))
        super().capture_cuda_graph_metadata(step)

    def replay_cuda_graph_metadata(self, step):
        self.log.append((self.tag, "replay", step.forward_mode))
        super().replay_cuda_graph_metadata(step)


def _with_caps(caps, fill=None):
    """A torch_native subclass declaring other capabilities (and optionally another fill value)."""
    attrs = {"capabilities": caps}
    if fill is not None:
        attrs["get_cuda_graph_seq_len_fill_value"] = lambda self: fill
    return type("Variant", (Recording,), attrs)


def _hybrid(ctx, log, prefill_cls=Recording, decode_cls=Recording, **routing):
    # the two children differ in settings too (score chunking), as two real backends would
    prefill = prefill_cls(ctx, "prefill", log, max_score_bytes=1 << 10)
    decode = decode_cls(ctx, "decode", log)
    return HybridAttnBackend(prefill, decode, **routing)


CASES = [
    AttnCase(ForwardMode.DECODE, ((7, 1), (0, 1), (20, 1)), page_size=16, sinks=True, return_lse=True),
    AttnCase(ForwardMode.EXTEND, ((5, 6), (0, 3)), sliding_window=4, logit_cap=3.0),
    AttnCase(ForwardMode.MIXED, ((9, 1), (2, 5)), page_size=4),
    AttnCase(ForwardMode.TARGET_VERIFY, ((6, 3), (11, 3)), return_lse=True),
    AttnCase(ForwardMode.DRAFT_EXTEND, ((4, 2), (8, 3)), dtype="float16"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.mode.name)
@pytest.mark.parametrize("spec_route", ["prefill", "decode"])
def test_each_mode_goes_to_its_child_and_matches_reference(case, spec_route):
    log: list = []
    assert_case(lambda ctx: _hybrid(ctx, log, target_verify=spec_route, draft_extend=spec_route), case)
    mode = case.mode
    if mode is ForwardMode.DECODE:
        want = "decode"
    elif mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND):
        want = spec_route
    else:
        want = "prefill"
    assert log == [(want, "metadata", mode)] + [(want, "forward", mode)] * case.num_layers


def test_idle_goes_to_decode_and_returns_empty():
    log: list = []
    env = make_env(AttnCase(ForwardMode.IDLE, ()))
    h = _hybrid(env.ctx, log)
    env.batch.attn_backend = h
    h.init_forward_metadata(env.batch)
    out = make_layer(env.case, 0)(torch.empty(0, 4, 32), torch.empty(0, 2, 32), torch.empty(0, 2, 32), env.batch)
    assert out.shape == (0, 4 * 32)
    assert log == [("decode", "metadata", ForwardMode.IDLE), ("decode", "forward", ForwardMode.IDLE)]


def test_validation_uses_the_routed_childs_capabilities():
    """A decode child without sinks refuses sinks in DECODE; the prefill child accepts them in EXTEND."""
    no_sinks = _with_caps(replace(CAPABILITIES, features=CAPABILITIES.features - {Feature.SINKS}))
    log: list = []
    decode_case = AttnCase(ForwardMode.DECODE, ((3, 1),), sinks=True)
    with pytest.raises(UnsupportedFeatureError, match="sinks"):
        assert_case(lambda ctx: _hybrid(ctx, log, decode_cls=no_sinks), decode_case)
    assert_case(lambda ctx: _hybrid(ctx, log, decode_cls=no_sinks), AttnCase(ForwardMode.EXTEND, ((3, 2),), sinks=True))
    env = make_env(decode_case)
    assert Feature.SINKS not in _hybrid(env.ctx, log, decode_cls=no_sinks).capabilities.features


def _ctx(**kw) -> BackendContext:
    base = dict(device="cpu", dtype=torch.float32, num_q_heads=4, num_kv_heads=2, head_dim=32)
    return BackendContext(**{**base, **kw})


def test_derived_capabilities():
    log: list = []
    ctx = _ctx()
    no_graphs = _with_caps(
        replace(
            CAPABILITIES,
            cuda_graph=CudaGraphLevel.NEVER,
            features=CAPABILITIES.features - {Feature.CUSTOM_MASK},
            forward_modes=CAPABILITIES.forward_modes - {ForwardMode.DRAFT_EXTEND},
            page_sizes=frozenset({1, 16}),
        )
    )
    h = _hybrid(ctx, log, prefill_cls=no_graphs)
    caps = h.capabilities
    # TARGET_VERIFY runs on the prefill child, which cannot run in graphs: only decode graphs
    assert caps.cuda_graph is CudaGraphLevel.UNIFORM_SINGLE_TOKEN_DECODE
    assert Feature.CUSTOM_MASK not in caps.features and Feature.SINKS in caps.features
    assert ForwardMode.DRAFT_EXTEND not in caps.forward_modes and ForwardMode.DECODE in caps.forward_modes
    assert caps.page_sizes == frozenset({1, 16})
    assert "capabilities" in vars(h)  # an instance attribute, derived per object

    h2 = _hybrid(ctx, log, prefill_cls=no_graphs, target_verify="decode", draft_extend="decode")
    assert h2.capabilities.cuda_graph is CudaGraphLevel.UNIFORM_BATCH
    assert Feature.CUSTOM_MASK in h2.capabilities.features
    assert ForwardMode.DRAFT_EXTEND in h2.capabilities.forward_modes


def test_graph_calls_go_to_the_graph_child():
    log: list = []
    case = AttnCase(ForwardMode.DECODE, ((7, 1), (3, 1)))
    env = make_env(case)
    h = _hybrid(env.ctx, log, target_verify="decode")
    h.init_cuda_graph_state(4, 4)
    assert log == [("decode", "graph_state", None)]
    b = env.batch
    h.init_forward_metadata_capture_cuda_graph(2, 2, b.req_pool_indices, b.seq_lens, None, ForwardMode.DECODE, None)
    h.init_forward_metadata_replay_cuda_graph(
        2, b.req_pool_indices, b.seq_lens, b.seq_lens_sum, None, ForwardMode.DECODE, None, b.seq_lens_cpu
    )
    assert log[1:] == [("decode", "capture", ForwardMode.DECODE), ("decode", "replay", ForwardMode.DECODE)]
    with pytest.raises(UnsupportedFeatureError, match="EXTEND"):
        h.init_forward_metadata_capture_cuda_graph(2, 4, b.req_pool_indices, b.seq_lens, None, ForwardMode.EXTEND, None)
    log.clear()
    _hybrid(env.ctx, log, target_verify="prefill").init_cuda_graph_state(4, 4)  # verify graphs run on prefill
    assert sorted(t for t, *_ in log) == ["decode", "prefill"]
    assert h.get_cuda_graph_seq_len_fill_value() == h.decode.get_cuda_graph_seq_len_fill_value()


def test_incompatible_children_are_refused():
    log: list = []
    with pytest.raises(InvalidArgumentError, match="page_size"):
        HybridAttnBackend(Recording(_ctx(page_size=16), "p", log), Recording(_ctx(), "d", log))
    with pytest.raises(InvalidArgumentError, match="kv_dtype"):
        HybridAttnBackend(Recording(_ctx(kv_dtype=torch.float16), "p", log), Recording(_ctx(), "d", log))
    with pytest.raises(InvalidArgumentError, match="num_kv_heads"):
        HybridAttnBackend(Recording(_ctx(num_kv_heads=4), "p", log), Recording(_ctx(), "d", log))
    pools = [MHATokenToKVPool(32, 1, torch.float32, 2, 32, 1) for _ in range(2)]
    with pytest.raises(InvalidArgumentError, match="token_to_kv_pool"):
        HybridAttnBackend(
            Recording(_ctx(token_to_kv_pool=pools[0]), "p", log), Recording(_ctx(token_to_kv_pool=pools[1]), "d", log)
        )
    with pytest.raises(InvalidArgumentError, match="target_verify"):
        HybridAttnBackend(Recording(_ctx(), "p", log), Recording(_ctx(), "d", log), target_verify="verify")


def test_fill_values_must_agree_only_when_both_run_in_graphs():
    log: list = []
    other_fill = _with_caps(CAPABILITIES, fill=7)
    ctx = _ctx()
    with pytest.raises(InvalidArgumentError, match="fill value"):
        _hybrid(ctx, log, prefill_cls=other_fill, target_verify="prefill")
    # prefill never runs inside a graph when verify goes to decode: its fill value does not matter
    h = _hybrid(ctx, log, prefill_cls=other_fill, target_verify="decode")
    assert h.get_cuda_graph_seq_len_fill_value() == 1
