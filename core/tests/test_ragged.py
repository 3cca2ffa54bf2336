"""The ragged op (`attn_core.contract.ragged`, `AttentionBackend.ragged_attention`): the batch builders and their
validation against hand-worked values, torch_native against the float64 reference over several batches,
the typed refusals, the composed backends (which do not serve it), and the kit's ragged checks catching
broken backends (one attending across sequences, one applying the causal flag wrongly).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attn_core import BackendContext, HybridAttnBackend, ragged_batch, ragged_batch_from_cu_seqlens
from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.contract.capabilities import Feature
from attn_core.contract.errors import (
    InvalidArgumentError,
    InvalidBatchError,
    StaleMetadataError,
    UnsupportedFeatureError,
)
from attn_core.contract.ragged import RaggedBatch, check_ragged_batch
from attn_core.testing.kit import make_plan
from attn_core.testing.outcome import execute
from attn_core.testing.ragged_checks import RaggedCase, packed_inputs, random_lengths, reference_ragged
from attn_core.testing.reference import relative_error


def test_ragged_batch_worked_example():
    b = ragged_batch([3, 0, 2], "cpu")
    assert b.cu_seqlens.tolist() == [0, 3, 3, 5] and b.cu_seqlens.dtype == torch.int32
    assert (b.max_seqlen, b.num_tokens, b.num_seqs, b.causal) == (3, 5, 3, False)
    assert b.seq_lens_cpu.tolist() == [3, 0, 2]
    c = ragged_batch_from_cu_seqlens(torch.tensor([0, 4, 9], dtype=torch.int32), causal=True)
    assert (c.max_seqlen, c.num_tokens, c.causal, c.cu_seqlens_cpu.tolist()) == (5, 9, True, [0, 4, 9])
    assert ragged_batch([], "cpu").num_tokens == 0
    with pytest.raises(InvalidArgumentError, match="seq_lens"):
        ragged_batch([3, -1], "cpu")
    with pytest.raises(InvalidArgumentError, match="cu_seqlens"):
        ragged_batch_from_cu_seqlens(torch.tensor([[0, 1]], dtype=torch.int32))


def test_check_ragged_batch():
    dev = torch.device("cpu")
    good = ragged_batch([3, 5], "cpu")
    check_ragged_batch(good, dev, full=True)
    bad = {
        "cu_seqlens_cpu": dataclasses.replace(good, cu_seqlens_cpu=torch.tensor([0, 3, 2])),
        "max_seqlen": dataclasses.replace(good, max_seqlen=4),
        "ragged.cu_seqlens": dataclasses.replace(good, cu_seqlens=good.cu_seqlens.to(torch.int64)),
    }
    for field, batch in bad.items():
        with pytest.raises(InvalidBatchError, match=field):
            check_ragged_batch(batch, dev)
    start = dataclasses.replace(
        good, cu_seqlens=torch.tensor([1, 3, 8], dtype=torch.int32), cu_seqlens_cpu=torch.tensor([1, 3, 8])
    )
    with pytest.raises(InvalidBatchError, match="0, then"):
        check_ragged_batch(start, dev)
    with pytest.raises(InvalidArgumentError, match="RaggedBatch"):
        check_ragged_batch([0, 3, 8], dev)


def _ctx(**kw):
    base = dict(
        device="cpu", dtype=torch.float32, num_q_heads=4, num_kv_heads=2, head_dim=24, forward_modes=frozenset()
    )
    return BackendContext(**{**base, **kw, "features": frozenset({Feature.RAGGED, Feature.LSE_OUTPUT})})


def test_torch_native_over_several_batches_and_layers():
    """Three batches of random lengths on one backend object, two layers each (q/k/v strided views of a
    NaN-padded buffer), causal and not, against the float64 reference; output and LSE."""
    backend = TorchNativeBackend(_ctx(), max_score_bytes=4096)  # small chunks: the query-chunk loop runs
    gen = torch.Generator().manual_seed(0)
    import random

    rng = random.Random(0)
    for step in range(3):
        lens = random_lengths(rng, 5, 30)
        causal = step == 1
        batch = ragged_batch(lens, "cpu", causal=causal)
        backend.init_ragged_metadata(batch)
        case = RaggedCase(steps=(lens,), num_q_heads=4, num_kv_heads=2, head_dim=24, dtype="float32", device="cpu")
        for _ in range(2):
            q, k, v = packed_inputs(case, sum(lens), gen)
            out, lse = backend.ragged_attention(q, k, v, batch, scaling=0.3, return_lse=True)
            ref_o, ref_lse = reference_ragged(q, k, v, lens, 0.3, causal)
            assert relative_error(out.reshape(ref_o.shape), ref_o) < 1e-5
            assert float((lse.double() - ref_lse).abs().max()) < 1e-5


def test_typed_errors_and_stale_metadata():
    backend = TorchNativeBackend(_ctx())
    a, b = ragged_batch([2, 3], "cpu"), ragged_batch([2, 3], "cpu")
    q, k, v = torch.randn(5, 4, 24), torch.randn(5, 2, 24), torch.randn(5, 2, 24)
    with pytest.raises(StaleMetadataError, match="ragged"):
        backend.ragged_attention(q, k, v, a)
    backend.init_ragged_metadata(a)
    assert backend.current_ragged_batch is a
    backend.ragged_attention(q.reshape(5, 96), k, v, a)  # [T, H * D] accepted
    with pytest.raises(StaleMetadataError):
        backend.ragged_attention(q, k, v, b)
    with pytest.raises(InvalidArgumentError, match="q"):
        backend.ragged_attention(q[:4], k, v, a)
    with pytest.raises(InvalidArgumentError, match="scaling"):
        backend.ragged_attention(q, k, v, a, scaling=-1.0)
    with pytest.raises(InvalidBatchError):
        backend.init_ragged_metadata(dataclasses.replace(a, max_seqlen=1))
    assert backend.current_ragged_batch is None  # dropped on error


def test_composed_backends_do_not_serve_the_op():
    hybrid = HybridAttnBackend(TorchNativeBackend(_ctx()), TorchNativeBackend(_ctx()))
    assert Feature.RAGGED not in hybrid.capabilities.features
    with pytest.raises(UnsupportedFeatureError, match="ragged"):
        hybrid.init_ragged_metadata(ragged_batch([2], "cpu"))


class _AcrossSequences(TorchNativeBackend):
    """Broken on purpose: every row attends to every row of the call."""

    def forward_ragged(self, q, k, v, ragged, *, scaling, return_lse):
        one = RaggedBatch(ragged.cu_seqlens[[0, -1]], ragged.cu_seqlens_cpu[[0, -1]], ragged.num_tokens, ragged.causal)
        return super().forward_ragged(q, k, v, one, scaling=scaling, return_lse=return_lse)


class _CausalFlipped(TorchNativeBackend):
    """Broken on purpose: causal when asked for non-causal and the reverse."""

    def forward_ragged(self, q, k, v, ragged, *, scaling, return_lse):
        flipped = dataclasses.replace(ragged, causal=not ragged.causal)
        return super().forward_ragged(q, k, v, flipped, scaling=scaling, return_lse=return_lse)


@pytest.mark.parametrize("broken", [_AcrossSequences, _CausalFlipped])
def test_kit_catches_broken_ragged_ops(broken):
    plan = make_plan(broken, device="cpu", quick=True)
    numeric = [c for c in plan.checks if c.id.startswith("ragged-") and "bad_input" not in c.id]
    outcomes = [execute(c) for c in numeric]
    failed = [o.check_id for o in outcomes if o.status == "failed"]
    assert len(failed) >= len(numeric) - 1, [
        (o.check_id, o.status) for o in outcomes
    ]  # ragged-long: one row per sequence may agree


def test_kit_refuses_where_undeclared():
    class NoRagged(TorchNativeBackend):
        capabilities = dataclasses.replace(
            TorchNativeBackend.capabilities, features=TorchNativeBackend.capabilities.features - {Feature.RAGGED}
        )

    plan = make_plan(NoRagged, device="cpu", quick=True)
    checks = [c for c in plan.checks if "ragged" in c.id]
    assert [c.id for c in checks] == ["refuse-ragged"]
    outcome = execute(checks[0])
    assert outcome.status == "passed" and "UnsupportedFeatureError" in outcome.message
