"""Safe by default (issue 36): the CPU validates fully at any level; the accelerator path (the step check,
the checked write, the fault word raised one step late) emulated on the CPU; the checked K/V write; the
fault word; request guards; graph-runner inputs; scales and sinks."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import attn_core
from attn_core import (
    AttentionLayer,
    BackendContext,
    CudaGraphRunner,
    CudaGraphStep,
    DeviceFaultError,
    GraphShapeError,
    InvalidArgumentError,
    MHATokenToKVPool,
    PagedTokenAllocator,
    ReqToTokenPool,
    RequestPool,
    StaleRequestError,
    build_step,
    create_backend,
)
from attn_core.memory import MLATokenToKVPool, SlidingWindowAllocator, SlidingWindowKVPool
from attn_core.ops.device_faults import FAULT_WORDS, NUM_FAULT_KINDS, DeviceFault, DeviceFaultFlags, DeviceFaultKind
from attn_core.ops.kv_write import CheckedSlots, guard_slots, write_kv
from attn_core.testing.device_path import accelerator_checks
from attn_core.testing.harness import AttnCase, layer_inputs, make_env, make_layer
from attn_core.testing.kit import make_plan, run_plan


@pytest.fixture
def device_path():
    """The default mode as an accelerator runs it, on CPU tensors: no full validation at "basic", the step
    check (its torch path) and the fault word instead (`attn_core.testing.device_path`)."""
    with accelerator_checks("torch"):
        yield


# ---- the CPU validates fully at any level ------------------------------------------------------------
def test_cpu_basic_refuses_device_faults_before_any_write():
    env = make_env(AttnCase("DECODE", ((9, 1), (4, 1), (2, 1))))
    ctx = dataclasses.replace(env.ctx, validation="basic")
    backend = create_backend("torch_native", ctx)
    env.batch.out_cache_loc[1] = -1  # would wrap to the pool's last slot
    before = env.kv_pool.get_key_buffer(0).clone()
    with pytest.raises(attn_core.InvalidBatchError, match="out_cache_loc"):
        backend.init_forward_metadata(env.batch)
    assert torch.equal(before.nan_to_num(3.0), env.kv_pool.get_key_buffer(0).nan_to_num(3.0))


# ---- the accelerator path, emulated ------------------------------------------------------------------
def _outcomes(backend: str, select, **kw):
    plan = make_plan(backend, device="cpu", quick=True, **kw)
    return {o.check_id: o for o in run_plan(plan, select)}


def test_default_mode_device_path_hostile_section_torch_native(device_path):
    """Every hostile case at "basic" through the device path: a typed error at once, or DeviceFaultError at
    the next step with nothing written outside the batch's slots; then a good step."""
    outcomes = _outcomes("torch_native", ["hostile-basic-", "hostile-graph_run", "hostile-draft", "hostile-stale"])
    failed = {cid: o.message for cid, o in outcomes.items() if o.status != "passed"}
    assert not failed, failed
    late = [cid for cid, o in outcomes.items() if "(next step)" in (o.message or "")]
    # the device-side faults went the no-sync way: one step late, named
    for name in (
        "row_negative",
        "row_duplicate",
        "slot_minus_one",
        "slot_foreign",
        "slot_duplicate",
        "key_never_written",
    ):
        assert f"hostile-basic-{name}" in late, (name, outcomes[f"hostile-basic-{name}"].message)
    assert "DeviceFaultError" in outcomes["hostile-graph_run_slot_minus_one"].message
    assert "DeviceFaultError" in outcomes["hostile-basic-slot_foreign"].message
    assert "first offending request: 1" in outcomes["hostile-basic-slot_foreign"].message


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton step check on CPU tensors needs TRITON_INTERPRET=1"
)
def test_default_mode_device_path_with_the_triton_step_check():
    """The same on the step check's Triton kernel (the CUDA path), under the interpreter."""
    select = [
        f"hostile-basic-{n}"
        for n in (
            "row_negative",
            "row_duplicate",
            "slot_foreign",
            "seq_lens_device_differs",
            "extend_device_differs",
            "extend_start_loc_differs",
            "verify_mask_indptr_differs",
        )
    ]
    select.append("hostile-graph_run_slot_minus_one")
    with accelerator_checks("triton"):
        outcomes = _outcomes("torch_native", select)
    assert len(outcomes) == len(select)
    failed = {cid: o.message for cid, o in outcomes.items() if o.status != "passed"}
    assert not failed, failed


def test_refused_writes_go_to_the_dummy_slot_and_the_fault_is_raised_at_the_next_step(device_path):
    env = make_env(AttnCase("DECODE", ((9, 1), (4, 1), (2, 1))))
    ctx = dataclasses.replace(env.ctx, validation="basic")
    backend = create_backend("torch_native", ctx)
    good = [int(x) for x in env.batch.out_cache_loc]
    foreign = int(env.req_to_token_pool.req_to_token[int(env.batch.req_pool_indices[0]), 0])
    env.batch.out_cache_loc[2] = foreign
    env.batch.attn_backend = backend
    before = env.kv_pool.get_key_buffer(0).clone()
    backend.init_forward_metadata(env.batch)  # no error yet: the fault is on the "device"
    i = layer_inputs(env, 0, torch.Generator().manual_seed(1))
    make_layer(env.case, 0)(i["q"], i["k"], i["v"], env.batch)
    after = env.kv_pool.get_key_buffer(0)
    assert torch.equal(after[foreign].nan_to_num(3.0), before[foreign].nan_to_num(3.0)), (
        "another request's key was overwritten"
    )
    assert torch.equal(after[good[0]], i["k"][0]) and torch.equal(after[good[1]], i["k"][1])
    with pytest.raises(DeviceFaultError) as err:
        backend.init_forward_metadata(env.batch)
    e = err.value
    assert e.argument == "forward_batch.out_cache_loc" and e.request == 2 and e.step == 1
    assert "WRITE_OWNER" in e.kinds and isinstance(e, attn_core.DeviceIndexError)
    backend.init_forward_metadata(env.batch)  # reported once: the word was cleared


def test_raise_device_faults_reads_the_word_now():
    env = make_env(AttnCase("DECODE", ((3, 1),)))
    backend = create_backend("torch_native", env.ctx)
    backend.raise_device_faults()  # nothing
    backend.device_faults.buffer[int(DeviceFaultKind.REQUEST_ROW)] = 1
    with pytest.raises(DeviceFaultError, match="req_pool_indices"):
        backend.raise_device_faults()
    backend.raise_device_faults()


# ---- the fault word ----------------------------------------------------------------------------------
def test_fault_word_names_kind_field_and_first_request():
    words = [0] * FAULT_WORDS
    words[DeviceFaultKind.SLOT] = 1
    words[DeviceFaultKind.WRITE_OWNER] = 1
    words[NUM_FAULT_KINDS + DeviceFaultKind.WRITE_OWNER] = (1 << 30) - 3
    fault = DeviceFault.from_words(words, step=7)
    assert fault.kinds == (DeviceFaultKind.SLOT, DeviceFaultKind.WRITE_OWNER)
    assert fault.argument == "forward_batch.req_to_token_pool" and fault.request == 3
    err = fault.error()
    assert err.step == 7 and err.request == 3 and "step 7" in str(err)
    assert DeviceFault.from_words([0] * FAULT_WORDS) is None


def test_fault_flags_on_the_cpu_read_directly_and_clear():
    flags = DeviceFaultFlags(torch.device("cpu"))
    assert flags.read_snapshot() is None
    flags.buffer[int(DeviceFaultKind.LENGTH)] = 1
    flags.snapshot(4)
    fault = flags.read_snapshot()
    assert fault.kinds == (DeviceFaultKind.LENGTH,) and fault.step == 4
    assert flags.read_snapshot() is None and not flags.buffer.any()


def test_fault_flags_host_copy_path_copy_mark_and_read():
    """The accelerator path (a host copy of the word, made at the first copy) on CPU tensors: `copy_to_host`
    moves the word, `mark_snapshot` makes it readable and names the step, `read_snapshot` reports it once; a
    copy not marked is not read, a mark without a new copy reads the last copy (what a replayed graph that
    captured the copy leaves), a later fault after a clear is read in turn."""
    flags = DeviceFaultFlags(torch.device("cpu"))
    flags.device = torch.device("meta")  # not on the host: the snapshot path (plain host memory for the copy)
    assert not flags.on_host and flags.read_snapshot() is None
    flags.buffer[int(DeviceFaultKind.SLOT)] = 1
    flags.copy_to_host()
    assert flags.read_snapshot() is None  # copied but not marked
    flags.mark_snapshot(9)
    fault = flags.read_snapshot()
    assert fault.kinds == (DeviceFaultKind.SLOT,) and fault.step == 9
    assert flags.read_snapshot() is None and not flags.buffer.any() and not flags._host.any()
    flags.mark_snapshot(10)  # a replay whose copy found the word clean
    assert flags.read_snapshot() is None
    flags.buffer[int(DeviceFaultKind.LENGTH)] = 1
    flags.copy_to_host()
    flags.mark_snapshot(11)
    fault = flags.read_snapshot()
    assert fault.kinds == (DeviceFaultKind.LENGTH,) and fault.step == 11


# ---- the checked write -------------------------------------------------------------------------------
def test_write_kv_on_the_cpu_refuses_slots_outside_the_cache_before_writing():
    cache = torch.zeros(8, 2, 4)
    k = torch.ones(3, 2, 4)
    with pytest.raises(InvalidArgumentError, match="loc"):
        write_kv(cache, None, torch.tensor([3, -1, 2]), k)
    with pytest.raises(InvalidArgumentError, match="loc"):
        write_kv(cache, None, torch.tensor([3, 8, 2]), k)
    assert not cache.any()
    write_kv(cache, None, torch.tensor([3, 0, 2]), k)  # slot 0: the dummy, where padding writes go
    assert cache[[0, 2, 3]].eq(1).all() and not cache[[1, 4, 5, 6, 7]].any()


def test_guard_slots_never_wraps_and_records():
    fault = torch.zeros(FAULT_WORDS, dtype=torch.int32)
    out = guard_slots(torch.tensor([5, -1, 9, 0, 2**40]), 9, fault)
    assert out.tolist() == [5, 0, 0, 0, 0] and fault[DeviceFaultKind.WRITE_SLOT] == 1
    fault.zero_()
    guard_slots(torch.tensor([1, 8]), 9, fault)
    assert not fault.any()


def test_write_kv_layouts_fp8_and_checked_slots():
    nhd = torch.zeros(12, 2, 4)
    hnd = torch.zeros(3, 2, 4, 4)
    k = torch.randn(3, 2, 4)
    slots = torch.tensor([5, 6, 11])
    write_kv(nhd, None, slots, k)
    write_kv(hnd, None, slots, k, layout="HND", page_size=4)
    assert torch.equal(nhd[slots], k)
    assert torch.equal(hnd[slots // 4, :, slots % 4], k)
    fp8 = torch.zeros(12, 2, 4, dtype=torch.uint8).view(torch.float8_e4m3fn)
    write_kv(fp8, None, CheckedSlots(slots, 12), k, k_scale=0.5)
    want = (k / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(fp8[slots].view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(InvalidArgumentError, match="checked for a cache of 12"):
        write_kv(nhd, None, CheckedSlots(slots, 13), k)


def test_pools_write_through_the_checked_write():
    pool = MHATokenToKVPool(16, 4, torch.float32, 2, 8, 1)
    k = torch.ones(2, 2, 8)
    with pytest.raises(InvalidArgumentError, match="loc"):
        pool.set_kv_buffer(0, torch.tensor([5, pool.num_slots]), k, k)
    assert not pool.get_key_buffer(0).any()
    mla = MLATokenToKVPool(16, 4, torch.float32, 8, 4, 1)
    with pytest.raises(InvalidArgumentError, match="loc"):
        mla.set_kv_buffer(0, torch.tensor([-1, 5]), torch.ones(2, 1, 12))
    alloc = SlidingWindowAllocator(16, 16, 4, 4)
    wp = SlidingWindowKVPool(alloc, torch.float32, 2, 8, 2, [1])
    with pytest.raises(InvalidArgumentError, match="loc"):
        wp.set_kv_buffer(1, torch.tensor([-1, 5]), k, k)  # never translated through full_to_window[-1]


# ---- request guards ----------------------------------------------------------------------------------
def _engine(page_size: int = 4):
    kv = MHATokenToKVPool(64, page_size, torch.float32, 2, 8, 1)
    rows = ReqToTokenPool(4, 32)
    requests = RequestPool(rows, PagedTokenAllocator(64, page_size), kv)
    ctx = BackendContext(
        device="cpu",
        dtype=torch.float32,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=8,
        page_size=page_size,
        req_to_token_pool=rows,
        token_to_kv_pool=kv,
        max_context_len=32,
    )
    return requests, create_backend("torch_native", ctx)


@pytest.mark.parametrize("change", ["free", "truncate", "fork", "another_step"])
def test_a_batch_is_refused_once_one_of_its_requests_changed(change):
    requests, backend = _engine()
    a, b = requests.add(), requests.add()
    first = build_step(requests, [(a, 5), (b, 6)], attn_backend=backend)
    backend.init_forward_metadata(first)
    batch = build_step(requests, [(a, 1), (b, 1)], attn_backend=backend)
    if change == "free":
        requests.free(b)
    elif change == "truncate":
        requests.truncate(b, 4)
    elif change == "fork":
        requests.fork(b, 4)
    else:
        build_step(requests, [(b, 1)], attn_backend=backend)
    with pytest.raises(StaleRequestError, match=r"forward_batch.requests\[1\]"):
        backend.init_forward_metadata(batch)


def test_token_counts_are_integers():
    requests, backend = _engine()
    a = requests.add()
    for bad in (2.5, True, "3", -1):
        with pytest.raises(InvalidArgumentError, match="new_tokens"):
            build_step(requests, [(a, bad)], attn_backend=backend)
    assert a.kv_len == 0
    build_step(requests, [(a, torch.tensor(3))], attn_backend=backend)
    with pytest.raises(InvalidArgumentError, match="kv_len"):
        requests.truncate(a, 1.5)
    with pytest.raises(InvalidArgumentError, match="num_tokens"):
        requests.fork(a, 2.0)


# ---- graph runner inputs -----------------------------------------------------------------------------
def _runner_env():
    env = make_env(AttnCase("DECODE", ((5, 1), (3, 1)), cuda_graph_level=1))
    backend = create_backend("torch_native", env.ctx)
    layer = make_layer(env.case, 0)

    def run_layers(batch, inputs):
        return layer(inputs["q"], inputs["k"], inputs["v"], batch)

    return env, backend, run_layers


@pytest.mark.parametrize(
    "shapes",
    [
        [("x", (4,))],
        {"x": ((4,), "float32")},
        {"x": ((0,), torch.float32)},
        {"x": ((2.5,), torch.float32)},
        {3: ((4,), torch.float32)},
        {"x": (4, torch.float32)},
        {"x": ((4,), torch.float32, 1)},
    ],
)
def test_runner_input_shapes_are_checked(shapes):
    env, backend, run_layers = _runner_env()
    with pytest.raises(InvalidArgumentError, match="input_shapes"):
        CudaGraphRunner(backend, [2], run_layers, shapes)


def test_runner_refuses_inputs_of_another_shape_and_validates_the_batch():
    env, backend, run_layers = _runner_env()
    c, dt = env.case, torch.float32
    shapes = {
        "q": ((c.num_q_heads, c.head_dim), dt),
        "k": ((c.num_kv_heads, c.head_dim), dt),
        "v": ((c.num_kv_heads, c.head_dim), dt),
    }
    runner = CudaGraphRunner(backend, [2], run_layers, shapes)
    i = layer_inputs(env, 0, torch.Generator().manual_seed(0))
    with pytest.raises(GraphShapeError, match=r"inputs\['q'\]"):
        runner.run(env.batch, {"q": i["q"][:1], "k": i["k"], "v": i["v"]})
    with pytest.raises(GraphShapeError, match=r"inputs\['k'\]"):
        runner.run(env.batch, {"q": i["q"], "k": i["k"].double(), "v": i["v"]})
    env.batch.out_cache_loc[0] = -1
    before = env.kv_pool.get_key_buffer(0).clone()
    with pytest.raises(attn_core.InvalidBatchError, match="out_cache_loc"):
        runner.run(env.batch, {"q": i["q"], "k": i["k"], "v": i["v"]})
    assert torch.equal(before.nan_to_num(3.0), env.kv_pool.get_key_buffer(0).nan_to_num(3.0))


# ---- scales and sinks --------------------------------------------------------------------------------
@pytest.mark.parametrize("name, value", [("k_scale", -0.5), ("v_scale", 0.0), ("k_scale", float("inf"))])
def test_scales_are_checked_without_a_write(name, value):
    env = make_env(AttnCase("DECODE", ((5, 1), (3, 1))))
    backend = create_backend("torch_native", env.ctx)
    backend.init_forward_metadata(env.batch)
    layer = AttentionLayer(0, 4, 2, 32, **{name: value})
    i = layer_inputs(env, 0, torch.Generator().manual_seed(0))
    with pytest.raises(InvalidArgumentError, match=f"layer.{name}"):
        backend.forward(i["q"], i["k"], i["v"], layer, env.batch, save_kv_cache=False)


def test_sinks_on_another_device_are_refused_before_the_write():
    env = make_env(AttnCase("DECODE", ((5, 1), (3, 1))))
    backend = create_backend("torch_native", env.ctx)
    backend.init_forward_metadata(env.batch)
    i = layer_inputs(env, 0, torch.Generator().manual_seed(0))
    before = env.kv_pool.get_key_buffer(0).clone()
    with pytest.raises(InvalidArgumentError, match="sinks"):
        backend.forward(i["q"], i["k"], i["v"], make_layer(env.case, 0), env.batch, sinks=torch.zeros(4, device="meta"))
    assert torch.equal(before.nan_to_num(3.0), env.kv_pool.get_key_buffer(0).nan_to_num(3.0))


def test_graph_batch_slots_are_checked_once_per_graph_step(monkeypatch):
    """A graph batch's slots are checked at the step's first K/V write and reused by the later layers
    (in a captured graph: one guard per replay, not one per layer); every new graph step, and a slot
    tensor the step has not seen, is checked again. The graph runner's own slot buffer, which it fills
    with checked slots only, needs no check (`trust_graph_slots`)."""
    import attn_core.contract.backend as contract_backend

    calls = []
    real = contract_backend.check_host_slots

    def counting(loc, n, name="loc"):
        calls.append(loc)
        return real(loc, n, name)

    monkeypatch.setattr(contract_backend, "check_host_slots", counting)
    env = make_env(AttnCase("DECODE", ((5, 1), (3, 1)), cuda_graph_level=1, num_layers=4))
    backend = create_backend("torch_native", env.ctx)
    layers = [make_layer(env.case, i) for i in range(4)]

    def run_layers(batch, inputs):
        return [layer(inputs["q"], inputs["k"], inputs["v"], batch) for layer in layers][-1]

    c, dt = env.case, torch.float32
    shapes = {"q": ((c.num_q_heads, c.head_dim), dt), "k": ((c.num_kv_heads, c.head_dim), dt)}
    shapes["v"] = shapes["k"]
    runner = CudaGraphRunner(backend, [2], run_layers, shapes)
    i = layer_inputs(env, 0, torch.Generator().manual_seed(0))
    calls.clear()
    for _ in range(3):
        want = runner.run(env.batch, {"q": i["q"], "k": i["k"], "v": i["v"]})
    assert not calls  # the runner's buffer holds checked slots only

    # the binding of the last replay stays: a graph batch with slots of its own is checked once for all layers
    own = dataclasses.replace(env.batch, out_cache_loc=env.batch.out_cache_loc.clone(), attn_backend=backend)
    got = [layer(i["q"], i["k"], i["v"], own) for layer in layers][-1]
    assert len(calls) == 1 and calls[0] is own.out_cache_loc
    torch.testing.assert_close(got, want)
    # a slot tensor it has not seen is checked at its first write, before anything is written
    bad = dataclasses.replace(env.batch, out_cache_loc=torch.tensor([3, 10**6]), attn_backend=backend)
    before = env.kv_pool.get_key_buffer(0).clone()
    with pytest.raises(InvalidArgumentError, match="out_cache_loc"):
        layers[0](i["q"], i["k"], i["v"], bad)
    assert torch.equal(before.nan_to_num(3.0), env.kv_pool.get_key_buffer(0).nan_to_num(3.0))
    # a new graph step checks its slots again
    backend.replay_graph_step(CudaGraphStep.from_batch(own))
    layers[0](i["q"], i["k"], i["v"], own)
    assert len(calls) == 3
    # so does a new pass over the layers (layer ids no longer increasing: another warm-up or capture) ...
    layers[1](i["q"], i["k"], i["v"], own)
    layers[0](i["q"], i["k"], i["v"], own)
    assert len(calls) == 4
    # ... and a slot tensor written in place since its check: the next layer refuses before writing
    own.out_cache_loc[0] = -1
    before = env.kv_pool.get_key_buffer(1).clone()
    with pytest.raises(InvalidArgumentError, match="out_cache_loc"):
        layers[1](i["q"], i["k"], i["v"], own)
    assert torch.equal(before.nan_to_num(3.0), env.kv_pool.get_key_buffer(1).nan_to_num(3.0))


def test_trust_graph_slots_takes_an_int64_buffer_of_the_backends_device():
    env, backend, _ = _runner_env()
    with pytest.raises(InvalidArgumentError, match="buffer"):
        backend.trust_graph_slots(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(InvalidArgumentError, match="buffer"):
        backend.trust_graph_slots(torch.zeros(2, 2, dtype=torch.int64))
