"""Non-causal attention in the paged path (`attn_core.contract.bidirectional`, `AttentionLayer.attn_type`): the span
rule and its validation against hand-worked batches, the visibility helpers against plain loops, the
layer's typed refusals, capability matching, and the kit's checks catching backends that get the
visibility wrong (an encoder-only layer run causally, spans ignored) while passing torch_native.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attn_core import AttentionLayer, AttentionType
from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.batching.cascade import splits_into_cascade
from attn_core.contract.bidirectional import bidirectional_span_mask, check_bidirectional_spans, span_visible
from attn_core.contract.capabilities import Capabilities, Feature, Requirements
from attn_core.contract.errors import InvalidArgumentError, InvalidBatchError, UnsupportedFeatureError
from attn_core.testing.harness import AttnCase, make_env
from attn_core.testing.kit import make_plan
from attn_core.testing.noncausal_checks import request_spans
from attn_core.testing.outcome import execute


def _batch_with_spans(requests, spans, mode="EXTEND"):
    env = make_env(AttnCase(mode, requests, spans=spans))
    return env.batch


@pytest.mark.parametrize(
    "span, ok",
    [
        ((2, 10), True),
        ((0, 6), True),
        ((12, 20), True),
        ((0, 0), True),
        ((6, 6), True),
        ((5, 11), False),
        ((9, 11), False),
    ],
)
def test_span_rule_of_one_request(span, ok):
    """Request with 6 cached and 4 new tokens (queries at 6..9, keys 0..9): a span holding a query must end
    by key 9; one holding none may reach past it."""
    if ok:
        check_bidirectional_spans(_batch_with_spans([(6, 4)], [span]), torch.device("cpu"), full=True)
    else:
        with pytest.raises(InvalidBatchError, match="bidirectional_spans"):
            check_bidirectional_spans(_batch_with_spans([(6, 4)], [span]), torch.device("cpu"))


def test_span_validation_refuses_malformed_spans():
    b = _batch_with_spans([(6, 4), (0, 3)], [(2, 10), (0, 3)])
    dev = torch.device("cpu")
    for change, match in (
        (dict(bidirectional_spans_cpu=None), "together"),
        (dict(bidirectional_spans=b.bidirectional_spans.to(torch.int64)), "int32"),
        (dict(bidirectional_spans_cpu=torch.tensor([[3, 2], [0, 3]])), "0 <= a <= b"),
        (dict(bidirectional_spans_cpu=torch.tensor([[-1, 2], [0, 3]])), "0 <= a <= b"),
        (dict(bidirectional_spans_cpu=torch.tensor([[2, 10]])), "shape"),
    ):
        with pytest.raises(InvalidBatchError, match=match):
            check_bidirectional_spans(dataclasses.replace(b, **change), dev)
    wrong = dataclasses.replace(b, bidirectional_spans=torch.tensor([[2, 9], [0, 3]], dtype=torch.int32))
    check_bidirectional_spans(wrong, dev)  # basic: host copies only
    with pytest.raises(InvalidBatchError, match="host copy"):
        check_bidirectional_spans(wrong, dev, full=True)


def test_spans_are_refused_under_a_verify_custom_mask():
    env = make_env(AttnCase("TARGET_VERIFY", [(5, 3), (2, 3)], spans=[(0, 8), (0, 0)]))
    with pytest.raises(InvalidBatchError, match="custom mask"):
        check_bidirectional_spans(env.batch, torch.device("cpu"))


def test_span_visible_worked_example():
    got = span_visible(torch.tensor([[3], [6]]), torch.tensor([[0, 4, 5]]), torch.tensor(2), torch.tensor(5))
    assert got.tolist() == [[True, True, False], [True, True, True]]


def test_span_mask_equals_a_plain_loop():
    seq, q_lens, spans = [9, 4, 6, 1], [4, 4, 0, 1], [(2, 9), (1, 3), (0, 6), (0, 1)]
    total = sum(s * q for s, q in zip(seq, q_lens))
    got = bidirectional_span_mask(
        torch.tensor(spans, dtype=torch.int32), torch.tensor(seq), torch.tensor(q_lens), total
    )
    want = []
    for L, n, (a, b) in zip(seq, q_lens, spans):
        for i in range(n):
            p = L - n + i
            want += [j <= p or (a <= p < b and a <= j < b) for j in range(L)]
    assert got.tolist() == want


def test_layer_attn_type():
    assert AttentionLayer(0, 4, 2, 32).attn_type is AttentionType.DECODER
    assert AttentionLayer(0, 4, 2, 32, attn_type="encoder_only").attn_type is AttentionType.ENCODER_ONLY
    with pytest.raises(InvalidArgumentError, match="attn_type"):
        AttentionLayer(0, 4, 2, 32, attn_type="bidirectional")
    for kw in (dict(sliding_window_size=4), dict(attention_chunk_size=8), dict(is_cross_attention=True)):
        with pytest.raises(InvalidArgumentError, match="attn_type"):
            AttentionLayer(0, 4, 2, 32, attn_type="encoder_only", **kw)
        with pytest.raises(InvalidArgumentError, match="attn_type"):
            AttentionLayer(0, 4, 2, 32, attn_type=AttentionType.DECODER_BIDIRECTIONAL, **kw)
    assert splits_into_cascade(AttentionLayer(0, 4, 2, 32))
    assert not splits_into_cascade(AttentionLayer(0, 4, 2, 32, attn_type="encoder_only"))
    assert not splits_into_cascade(AttentionLayer(0, 4, 2, 32, attn_type="decoder_bidirectional"))


def test_request_spans_worked_example():
    assert request_spans([(5, 4), (2, 6), (8, 1), (3, 2), (0, 3)]) == ((2, 9), (3, 7), (0, 4), (0, 0), (5, 12))


def test_spans_change_the_answer():
    """The span cases are not causal ones in disguise: on the same inputs, a bidirectional layer's output
    differs from a decoder layer's."""
    from attn_core.testing.harness import layer_inputs, make_layer

    outs = []
    for attn_type in ("decoder", "decoder_bidirectional"):
        case = AttnCase("EXTEND", [(4, 6), (0, 7)], attn_type=attn_type, spans=[(0, 10), (1, 6)])
        env = make_env(case)
        backend = TorchNativeBackend(env.ctx)
        env.batch.attn_backend = backend
        backend.init_forward_metadata(env.batch)
        inputs = layer_inputs(env, 0, torch.Generator().manual_seed(3))
        outs.append(make_layer(case, 0)(inputs["q"], inputs["k"], inputs["v"], env.batch))
    assert not torch.allclose(outs[0], outs[1])


class _CausalEncoder(TorchNativeBackend):
    """Broken on purpose: encoder-only layers run causally."""

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        return super().forward_extend(q, k, v, _as_decoder(layer), forward_batch, save_kv_cache, **extras)


class _SpansIgnored(TorchNativeBackend):
    """Broken on purpose: bidirectional layers ignore the batch's spans."""

    def build_forward_metadata(self, forward_batch):
        meta = super().build_forward_metadata(forward_batch)
        meta.spans = None
        return meta


def _as_decoder(layer):
    return AttentionLayer(layer.layer_id, layer.num_q_heads, layer.num_kv_heads, layer.head_dim, scaling=layer.scaling)


@pytest.mark.parametrize("broken, prefix", [(_CausalEncoder, "non_causal-"), (_SpansIgnored, "bidirectional_span-")])
def test_kit_catches_wrong_visibility(broken, prefix):
    plan = make_plan(broken, device="cpu", quick=True)
    outcomes = [
        execute(c)
        for c in plan.checks
        if c.id.startswith(prefix) and "DECODE" not in c.id and "decoder_layers" not in c.id
    ]
    assert outcomes and all(o.status == "failed" for o in outcomes), [(o.check_id, o.status) for o in outcomes]
    good = make_plan(TorchNativeBackend, device="cpu", quick=True)
    assert all(execute(c).status == "passed" for c in good.checks if c.id.startswith(prefix))


def test_undeclared_features_are_refused_before_any_write():
    """A backend without NON_CAUSAL / BIDIRECTIONAL_SPAN: the kit's refusal checks pass (typed error, pool
    untouched)."""

    class Plain(TorchNativeBackend):
        capabilities = dataclasses.replace(
            TorchNativeBackend.capabilities,
            features=TorchNativeBackend.capabilities.features - {Feature.NON_CAUSAL, Feature.BIDIRECTIONAL_SPAN},
        )

    plan = make_plan(Plain, device="cpu", quick=True)
    refusals = [c for c in plan.checks if c.id in ("refuse-non_causal", "refuse-bidirectional_span")]
    assert len(refusals) == 2
    for c in refusals:
        outcome = execute(c)
        assert outcome.status == "passed" and "UnsupportedFeatureError" in outcome.message, outcome.message
    assert not any(c.id.startswith(("non_causal-", "bidirectional_span-")) for c in plan.checks)
    env = make_env(AttnCase("EXTEND", [(3, 4)], spans=[(0, 7)]))
    with pytest.raises(UnsupportedFeatureError, match="bidirectional spans"):
        Plain(env.ctx).init_forward_metadata(env.batch)


def test_capabilities_match_ragged_only_contexts_on_ragged_head_dims():
    caps = Capabilities(
        devices=frozenset({"cpu"}),
        q_dtypes=frozenset({"float32"}),
        kv_dtypes=frozenset({"float32"}),
        head_dims=frozenset({64, 128}),
        features=frozenset({Feature.RAGGED}),
        ragged_head_dims=frozenset({64, 80, 128}),
    )
    ragged_only = dict(
        device_type="cpu",
        q_dtype="float32",
        kv_dtype="float32",
        features=frozenset({Feature.RAGGED}),
        forward_modes=frozenset(),
    )
    assert caps.mismatches(Requirements(head_dim=80, **ragged_only)) == []
    assert caps.mismatches(Requirements(head_dim=72, **ragged_only)) == ["ragged head_dim 72 not in [64, 80, 128]"]
    paged = dict(ragged_only, forward_modes=Requirements().forward_modes)
    assert caps.mismatches(Requirements(head_dim=80, **paged)) == ["mha head_dim 80 not in [64, 128]"]
    assert caps.mismatches(Requirements(head_dim=64, **paged)) == []
    paged_only = dataclasses.replace(caps, page_sizes=frozenset({16}), kv_layouts=frozenset({"HND"}))
    assert paged_only.mismatches(Requirements(head_dim=80, **ragged_only)) == []  # no pages, no layout
    assert len(paged_only.mismatches(Requirements(head_dim=64, **paged))) == 2
    no_ragged = dataclasses.replace(caps, features=frozenset())
    assert "features ['ragged'] not supported" in no_ragged.mismatches(Requirements(head_dim=64, **ragged_only))
