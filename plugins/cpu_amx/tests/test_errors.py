"""Bad input gets a typed error before any kernel runs, and the KV pool is left untouched."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attn_core.contract.context import BackendContext
from attn_core.contract.errors import (
    AttnError,
    BackendUnavailableError,
    InvalidArgumentError,
    InvalidBatchError,
    KVCacheError,
    UnsupportedFeatureError,
)
from attn_core.testing.harness import AttnCase, layer_inputs, make_env, make_layer
from attn_cpu_amx import isa
from attn_cpu_amx.backend import CpuAmxBackend
from attn_cpu_amx.build import load_kernels

CASE = AttnCase("EXTEND", [(9, 4), (0, 3)], num_q_heads=4, num_kv_heads=2, head_dim=32, dtype="bfloat16", num_layers=1)


def ready(case: AttnCase = CASE, **options):
    env = make_env(case)
    backend = CpuAmxBackend(env.ctx, **options)
    env.batch.attn_backend = backend
    return env, backend, make_layer(case, 0), layer_inputs(env, 0, torch.Generator().manual_seed(0))


def pool_state(env):
    return [t.clone() for t in (env.kv_pool.get_key_buffer(0), env.kv_pool.get_value_buffer(0))]


def assert_pool_unchanged(env, before):
    for a, b in zip(before, pool_state(env)):
        assert torch.equal(torch.nan_to_num(a.double(), nan=7.0), torch.nan_to_num(b.double(), nan=7.0))


@pytest.mark.parametrize(
    "mutate,argument",
    [
        (lambda i: {**i, "q": i["q"].to(torch.float16)}, "q"),
        (lambda i: {**i, "q": i["q"][:, :3]}, "q"),
        (lambda i: {**i, "k": i["k"][:-1]}, "k"),
        (lambda i: {**i, "v": None}, "v"),
    ],
    ids=["q-fp16", "q-heads", "k-rows", "v-missing"],
)
def test_bad_tensors(mutate, argument):
    env, backend, layer, inputs = ready()
    backend.init_forward_metadata(env.batch)
    before = pool_state(env)
    bad = mutate(inputs)
    with pytest.raises(InvalidArgumentError) as err:
        layer(bad["q"], bad["k"], bad["v"], env.batch)
    assert err.value.argument == argument
    assert_pool_unchanged(env, before)


def test_forward_needs_the_metadata_of_its_batch():
    env, backend, layer, inputs = ready()
    with pytest.raises(InvalidArgumentError):
        layer(inputs["q"], inputs["k"], inputs["v"], env.batch)
    backend.init_forward_metadata(env.batch)
    before = pool_state(env)
    with pytest.raises(InvalidArgumentError):  # 6 rows where the metadata said 7
        backend.forward_extend(inputs["q"][:6], inputs["k"][:6], inputs["v"][:6], layer, env.batch)
    assert_pool_unchanged(env, before)


def test_slot_out_of_range_is_a_kv_cache_error():
    """Core's validation refuses it (on the CPU at any level: "basic" runs every "full" check); behind
    it, the C++ slot check of the backend's own metadata build still does."""
    env, backend, layer, inputs = ready()
    row = int(env.batch.req_pool_indices[0])
    env.req_to_token_pool.req_to_token[row, 2] = env.kv_pool.num_slots + 5
    with pytest.raises(InvalidBatchError, match="req_to_token_pool"):
        backend.init_forward_metadata(env.batch)
    basic = CpuAmxBackend(dataclasses.replace(env.ctx, validation="basic"))
    with pytest.raises(InvalidBatchError, match="req_to_token_pool"):
        basic.init_forward_metadata(env.batch)
    with pytest.raises(KVCacheError, match="slot"):
        basic.build_forward_metadata(env.batch)


def test_unsupported_layer_features_refused():
    env, backend, layer, inputs = ready()
    backend.init_forward_metadata(env.batch)
    layer.is_cross_attention = True
    with pytest.raises(UnsupportedFeatureError):
        layer(inputs["q"], inputs["k"], inputs["v"], env.batch)


@pytest.mark.parametrize(
    "changes,error",
    [
        ({"dtype": torch.float16}, AttnError),
        ({"head_dim": 72}, AttnError),
        ({"device": "cuda"}, AttnError),
        (
            {"attention_arch": "mla", "kv_lora_rank": 32, "qk_rope_head_dim": 0, "head_dim": 32, "num_kv_heads": 1},
            AttnError,
        ),
    ],
    ids=["fp16", "head_dim-72", "cuda", "mla"],
)
def test_contexts_refused_at_construction(changes, error):
    base = dict(device="cpu", dtype=torch.bfloat16, num_q_heads=4, num_kv_heads=2, head_dim=32)
    with pytest.raises(error):
        CpuAmxBackend(BackendContext(**{**base, **changes}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_kv_cache_refused_at_construction_naming_the_kv_dtype(dtype):
    """cpu_amx's kernels read bf16 / fp32 caches only: an fp8 cache is refused by the base class from
    the capabilities (typed, naming the KV dtype) before any pool is touched."""
    from attn_core.contract.errors import IncompatibleBackendError

    base = dict(device="cpu", dtype=dtype, kv_dtype=torch.float8_e4m3fn, num_q_heads=4, num_kv_heads=2, head_dim=32)
    with pytest.raises(IncompatibleBackendError, match="KV dtype float8_e4m3fn not in"):
        CpuAmxBackend(BackendContext(**base))


@pytest.mark.parametrize(
    "options,error",
    [
        ({"isa": "sse9"}, BackendUnavailableError),
        ({"max_splits": 0}, InvalidArgumentError),
        ({"min_split_keys": -1}, InvalidArgumentError),
        ({"not_an_option": 1}, InvalidArgumentError),
    ],
)
def test_bad_options(options, error):
    env = make_env(CASE)
    with pytest.raises(error):
        CpuAmxBackend(env.ctx, **options)


def test_forcing_a_path_this_cpu_cannot_run(monkeypatch):
    """Forcing AMX on a CPU without it is an error naming the missing flags, never a silent fallback."""
    monkeypatch.setattr(isa, "runnable_paths", lambda *a, **k: ("avx512", "portable"))
    env = make_env(CASE)
    with pytest.raises(BackendUnavailableError, match="amx"):
        CpuAmxBackend(env.ctx, isa="amx")
    monkeypatch.setenv(isa.ENV_VAR, "amx")
    with pytest.raises(BackendUnavailableError):
        CpuAmxBackend(env.ctx)


def test_kernel_entry_checks_its_arguments():
    """The C++ entry point refuses inconsistent tensors itself (a last line behind the Python checks)."""
    ops = load_kernels()
    q = torch.zeros(3, 4, 32)
    kv = torch.zeros(10, 2, 32)
    out = torch.zeros(3, 4, 32)
    r2t = torch.zeros(1, 8, dtype=torch.int32)
    i64 = torch.zeros(1, dtype=torch.int64)
    lens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens/q_lens"):  # q_len 3 > seq_len 2
        ops.attention(
            q,
            kv,
            kv,
            out,
            None,
            r2t,
            i64,
            torch.tensor([2], dtype=torch.int32),
            lens,
            torch.zeros(1, dtype=torch.int32),
            None,
            None,
            None,
            1.0,
            1.0,
            0.0,
            0,
            0,
            1,
            256,
        )
    with pytest.raises(ValueError, match="q_starts"):
        ops.attention(
            q,
            kv,
            kv,
            out,
            None,
            r2t,
            i64,
            lens,
            lens,
            torch.tensor([1], dtype=torch.int32),
            None,
            None,
            None,
            1.0,
            1.0,
            0.0,
            0,
            0,
            1,
            256,
        )
    with pytest.raises(ValueError, match="out"):
        ops.attention(
            q,
            kv,
            kv,
            out.to(torch.bfloat16),
            None,
            r2t,
            i64,
            lens,
            lens,
            torch.zeros(1, dtype=torch.int32),
            None,
            None,
            None,
            1.0,
            1.0,
            0.0,
            0,
            0,
            1,
            256,
        )


@pytest.mark.parametrize(
    "field,index,value,argument",
    [("req_rows", 0, 10**6, "req_rows"), ("req_rows", 1, -1, "req_rows"), ("seq_lens", 0, -3, "seq_lens/q_lens")],
    ids=["row-10e6", "row-minus-1", "negative-length"],
)
def test_kernel_checks_are_typed(field, index, value, argument):
    """The C++ kernel's own checks (what a caller bypassing init_forward_metadata's would reach) raise
    an AttnError naming the argument, before the kernel follows the index."""
    env, backend, layer, inputs = ready()
    backend.init_forward_metadata(env.batch)
    getattr(backend.forward_metadata, field)[index] = value
    before = pool_state(env)
    with pytest.raises(InvalidArgumentError) as err:
        backend.forward_extend(inputs["q"], inputs["k"], inputs["v"], layer, env.batch, save_kv_cache=False)
    assert err.value.argument == argument
    assert_pool_unchanged(env, before)


def test_kernel_check_messages_parse():
    from attn_cpu_amx.backend import kernel_check_error

    e = kernel_check_error("q: expected contiguous heads")
    assert (e.argument, e.expected) == ("q", "contiguous heads")
    e = kernel_check_error(
        "req_rows: expected a contiguous CPU Long tensor of 3 elements, found 2\nException raised from ..."
    )
    assert (e.argument, e.found) == ("req_rows", "2")
    assert kernel_check_error("expected CPU tensors").argument == "cpu_amx kernel arguments"


@pytest.mark.parametrize("name, value", [("v_scale", 0.0), ("k_scale", -0.5), ("k_scale", float("nan"))])
@pytest.mark.parametrize("save", [False, True])
def test_scales_are_read_through_the_core_check(name, value, save):
    """A v_scale of 0 is not 1 and a negative k_scale is not used as given: `kv_scales` refuses both,
    naming the scale, before any write (issue 36: the backend read `layer.k_scale or 1.0`)."""
    env, backend, layer, inputs = ready()
    backend.init_forward_metadata(env.batch)
    setattr(layer, name, value)
    before = pool_state(env)
    with pytest.raises(InvalidArgumentError, match=name):
        layer(inputs["q"], inputs["k"], inputs["v"], env.batch, save_kv_cache=save)
    assert_pool_unchanged(env, before)
