"""attn-core's one batch validation and the metadata template: what each level catches, the stale-metadata
check through wrappers and steps, the device-fault poll, the q/KV dtype rule. (The hostile-batch section
of the kit runs the same rules on every backend: attn_core.testing.hostile.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.contract.errors import (
    DeviceIndexError,
    IncompatibleBackendError,
    InvalidArgumentError,
    InvalidBatchError,
    StaleMetadataError,
)
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.validation import check_forward_batch
from attn_core.testing.harness import AttnCase, layer_inputs, make_env, make_layer
from attn_core.wrappers.hybrid import HybridAttnBackend
from attn_core.wrappers.tbo import TboAttnBackend

DECODE = AttnCase(ForwardMode.DECODE, ((7, 1), (0, 1), (12, 1)), page_size=4, num_layers=2)
EXTEND = AttnCase(ForwardMode.EXTEND, ((5, 3), (0, 4), (9, 1)), page_size=4, num_layers=2)


def _step(backend, env, batch, seed=0):
    """init_forward_metadata, then every layer; returns the outputs."""
    gen = torch.Generator().manual_seed(seed)
    backend.init_forward_metadata(batch)
    outs = []
    for lid in range(env.case.num_layers):
        i = layer_inputs(env, lid, gen, batch)
        outs.append(backend.forward(i["q"], i["k"], i["v"], make_layer(env.case, lid), batch))
    return outs


def _check(env, level):
    check_forward_batch(env.batch, env.req_to_token_pool.req_to_token, env.kv_pool, env.ctx, level=level)


def test_the_kit_context_uses_full_validation_and_bad_levels_are_refused():
    env = make_env(DECODE)
    assert env.ctx.validation == "full"
    with pytest.raises(InvalidArgumentError, match="validation"):
        dataclasses.replace(env.ctx, validation="paranoid")


@pytest.mark.parametrize(
    "spoil,field",
    [
        (lambda b: setattr(b, "seq_lens_sum", b.seq_lens_sum - 1), "seq_lens_sum"),
        (lambda b: b.seq_lens_cpu.__setitem__(0, 10**6), "seq_lens"),  # past the table (sum check comes later)
        (lambda b: setattr(b, "seq_lens", b.seq_lens.to(torch.int64)), "seq_lens"),
        (lambda b: setattr(b, "seq_lens_cpu", b.seq_lens_cpu.to(torch.float32)), "seq_lens_cpu"),
        (lambda b: setattr(b, "out_cache_loc", b.out_cache_loc[:2]), "out_cache_loc"),
        (lambda b: setattr(b, "req_pool_indices", b.req_pool_indices.to(torch.int16)), "req_pool_indices"),
    ],
)
def test_basic_level_catches_host_side_problems(spoil, field):
    env = make_env(DECODE)
    spoil(env.batch)
    with pytest.raises(InvalidBatchError, match=f"^forward_batch.{field}"):
        _check(env, "basic")


@pytest.mark.parametrize(
    "spoil,field",
    [
        (lambda e: e.batch.req_pool_indices.__setitem__(0, -1), "req_pool_indices"),
        (lambda e: setattr(e.batch, "seq_lens", e.batch.seq_lens.clone().fill_(2)), "seq_lens"),
        (lambda e: e.batch.out_cache_loc.__setitem__(0, -1), "out_cache_loc"),
        (lambda e: e.batch.out_cache_loc.__setitem__(0, int(e.batch.out_cache_loc[2])), "out_cache_loc"),
    ],
)
def test_device_problems_need_the_full_level(spoil, field):
    """Basic reads no device tensor (no sync): it cannot see these; full does."""
    env = make_env(DECODE)
    spoil(env)
    _check(env, "basic")
    with pytest.raises(InvalidBatchError, match=f"^forward_batch.{field}"):
        _check(env, "full")


def test_full_level_checks_extend_offsets_and_the_table():
    env = make_env(EXTEND)
    env.batch.extend_start_loc[1] += 1
    with pytest.raises(InvalidBatchError, match="extend_start_loc"):
        _check(env, "full")
    env = make_env(EXTEND)
    row = int(env.batch.req_pool_indices[2])
    env.req_to_token_pool.req_to_token[row, 9] = int(
        env.req_to_token_pool.req_to_token[row, 0]
    )  # new token's slot moved
    with pytest.raises(InvalidBatchError, match="out_cache_loc"):
        _check(env, "full")


def test_int_widths_accepted_on_indices():
    env = make_env(EXTEND)
    b = env.batch
    b.req_pool_indices = b.req_pool_indices.to(torch.int32)
    b.out_cache_loc = b.out_cache_loc.to(torch.int32)
    b.seq_lens_cpu = b.seq_lens_cpu.to(torch.int64)
    _check(env, "full")
    want = _step(TorchNativeBackend(env.ctx), env, b, seed=3)
    env2 = make_env(EXTEND)
    got = _step(TorchNativeBackend(env2.ctx), env2, env2.batch, seed=3)
    for x, y in zip(want, got):
        assert torch.equal(x, y)


def test_stale_metadata_is_refused_and_a_failed_init_drops_the_old_metadata():
    env = make_env(DECODE)
    backend = TorchNativeBackend(env.ctx)
    _step(backend, env, env.batch)
    layer, i = make_layer(DECODE, 0), layer_inputs(env, 0, torch.Generator().manual_seed(0))
    with pytest.raises(
        StaleMetadataError, match="forward_batch: expected the batch init_forward_metadata was last called with"
    ):
        backend.forward(i["q"], i["k"], i["v"], layer, dataclasses.replace(env.batch))
    bad = dataclasses.replace(env.batch, seq_lens_sum=-1)
    with pytest.raises(InvalidBatchError):
        backend.init_forward_metadata(bad)
    with pytest.raises(StaleMetadataError, match="no current metadata"):
        backend.forward(i["q"], i["k"], i["v"], layer, env.batch)


@pytest.mark.parametrize("wrap", ["hybrid", "tbo"])
def test_wrappers_refuse_stale_metadata_through_their_children(wrap):
    env = make_env(DECODE)
    if wrap == "hybrid":
        backend = HybridAttnBackend(TorchNativeBackend(env.ctx), TorchNativeBackend(env.ctx))
    else:
        backend = TboAttnBackend(
            TorchNativeBackend(env.ctx), [TorchNativeBackend(env.ctx), TorchNativeBackend(env.ctx)]
        )
    _step(backend, env, env.batch)
    layer, i = make_layer(DECODE, 0), layer_inputs(env, 0, torch.Generator().manual_seed(0))
    with pytest.raises(StaleMetadataError):
        backend.forward(i["q"], i["k"], i["v"], layer, dataclasses.replace(env.batch))


class _Faulty(TorchNativeBackend):
    """torch_native whose (pretend) kernels flagged an out-of-range index."""

    def poll_device_fault(self):
        return "request row 9 outside the table (8 rows)"


def test_device_faults_are_raised_at_full_validation_and_on_the_cpu_always():
    env = make_env(DECODE)
    with pytest.raises(DeviceIndexError, match="request row 9"):
        _Faulty(env.ctx).init_forward_metadata(env.batch)
    # on the CPU "basic" runs every "full" check (there is no sync to avoid)
    with pytest.raises(DeviceIndexError, match="request row 9"):
        _Faulty(dataclasses.replace(env.ctx, validation="basic")).init_forward_metadata(env.batch)
    assert TorchNativeBackend(env.ctx).poll_device_fault() is None


def test_mixed_kv_dtype_needs_the_feature():
    env = make_env(dataclasses.replace(DECODE, dtype="float32", kv_dtype="bfloat16"))
    TorchNativeBackend(env.ctx)  # declares Feature.MIXED_KV_DTYPE
    caps = dataclasses.replace(
        TorchNativeBackend.capabilities, features=TorchNativeBackend.capabilities.features - {"mixed_kv_dtype"}
    )
    strict = type("Strict", (TorchNativeBackend,), {"capabilities": caps, "name": "strict"})
    with pytest.raises(IncompatibleBackendError, match="mixed dtypes"):
        strict(env.ctx)


def test_q_in_another_dtype_than_the_context_is_refused_before_any_write():
    env = make_env(DECODE)
    backend = TorchNativeBackend(env.ctx)
    backend.init_forward_metadata(env.batch)
    i = layer_inputs(env, 0, torch.Generator().manual_seed(0))
    before = env.kv_pool.get_key_buffer(0).clone()
    with pytest.raises(InvalidArgumentError, match="^q: expected dtype torch.float32"):
        backend.forward(i["q"].to(torch.float16), i["k"], i["v"], make_layer(DECODE, 0), env.batch)
    assert torch.equal(torch.nan_to_num(before, nan=1.0), torch.nan_to_num(env.kv_pool.get_key_buffer(0), nan=1.0))


def _relocation(cls):
    from attn_core.testing.graphs import graph_relocation_check
    from attn_core.testing.target import resolve_target

    case = AttnCase(
        ForwardMode.DECODE, ((9, 1), (3, 1), (14, 1), (6, 1)), page_size=4, num_layers=2, cuda_graph_level=2
    )
    return graph_relocation_check(resolve_target(cls, None, None), case)


def test_graph_relocation_check_passes_torch_native_on_cpu():
    """The logic of the kit's CUDA-graph relocation section (on CPU the replays run eagerly on the static
    buffers): rows swapped, pages moved, seq_lens shortened between replays."""
    assert "no buffer moved" in _relocation(TorchNativeBackend)()


class _CaptureTimeReplay(TorchNativeBackend):
    """Replay keeps the capture-time metadata (the 2026 silent-corruption class)."""

    def replay_cuda_graph_metadata(self, step):
        self.bind_graph_metadata(self._graph_metadata[(step.bs, step.forward_mode)], step)


class _ReallocatingReplay(TorchNativeBackend):
    """Replay builds fresh metadata tensors instead of refreshing the captured ones in place."""

    def replay_cuda_graph_metadata(self, step):
        meta = self._graph_build(step, self._graph_metadata[(step.bs, step.forward_mode)].num_tokens)
        self.bind_graph_metadata(meta, step)


def test_graph_relocation_check_catches_stale_and_moved_graph_metadata():
    from attn_core.testing.outcome import KitFailure

    with pytest.raises(KitFailure, match="vs eager"):
        _relocation(_CaptureTimeReplay)()
    with pytest.raises(KitFailure, match="graph metadata buffers moved"):
        _relocation(_ReallocatingReplay)()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_host_length_stats_equal_a_plain_loop(dtype):
    """Both sides of HOST_STATS_LIST_MAX (the list path and the numpy path), against a loop over the values;
    int32 lengths whose sum passes 2**31 do not wrap."""
    from attn_core.contract.validation import HOST_STATS_LIST_MAX, host_length_stats

    gen = torch.Generator().manual_seed(3)
    for bs in (1, 2, 40, HOST_STATS_LIST_MAX - 1, HOST_STATS_LIST_MAX, HOST_STATS_LIST_MAX + 1, 1500):
        for high in (5, 2**31 - 1):
            t = torch.randint(0, high, (bs,), generator=gen, dtype=dtype)
            lo = hi = int(t[0])
            total = 0
            for i in range(bs):
                v = int(t[i])
                lo, hi, total = min(lo, v), max(hi, v), total + v
            got = host_length_stats(t)
            assert got == (lo, hi, total) and all(type(x) is int for x in got), (bs, high)
