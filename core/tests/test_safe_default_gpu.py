"""Safe by default on a GPU (issue 36), marked `gpu` (skipped without CUDA; `bash scripts/gpu_checks.sh
hostile` runs them, and again under `compute-sanitizer --tool memcheck`):

- the step check's Triton kernel equals its torch reference on CUDA tensors (random spoiled batches);
- the kit's hostile section at the default validation on cuda for torch_native, triton and flashinfer
  (where installed): every case a typed error at once or `DeviceFaultError` at the next step, no K/V
  outside the batch's slots, table and allocator unchanged, then a good step matching the reference;
- a bad slot on triton: no error at the step, `DeviceFaultError` at the next (one step late, naming the
  field and request), the pool's other slots intact, and the context usable (a good step is right);
- the default-mode step (step check, checked writes, fault word copy) and a graph runner step issue no
  host-device sync (`torch.cuda.set_sync_debug_mode("error")`).

`ATTN_HOSTILE_SELECT` (comma-separated substrings of check ids) narrows the kit's cases, e.g. for a run
under compute-sanitizer, which is slow.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

import attn_core as ac
from attn_core.ops.device_faults import FAULT_WORDS
from attn_core.ops.step_checks import check_step_torch
from attn_core.testing.harness import AttnCase, layer_inputs, make_env, make_layer
from attn_core.testing.kit import make_plan, run_plan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ENGINE_PATH = ["hostile-stale", "hostile-graph_", "hostile-draft"]


def _select() -> list[str]:
    chosen = os.environ.get("ATTN_HOSTILE_SELECT", "")
    return [s for s in chosen.split(",") if s] or ["hostile-basic-", *ENGINE_PATH]


def _usable(name: str) -> None:
    entry = next((e for e in ac.list_backends() if e.name == name), None)
    if entry is None:
        pytest.skip(f"{name} is not installed")
    if entry.spec is None:
        pytest.skip(f"{name}: {entry.error}")
    reason = entry.spec.probe()
    if reason:
        pytest.skip(f"{name}: {reason}")


@pytest.mark.parametrize("backend", ["torch_native", "triton", "flashinfer"])
def test_hostile_section_default_mode_on_cuda(backend):
    _usable(backend)
    plan = make_plan(backend, device="cuda", quick=True)
    outcomes = run_plan(plan, _select())
    assert outcomes, "no hostile case selected"
    failed = {o.check_id: o.message for o in outcomes if o.status == "failed"}
    assert not failed, failed
    torch.cuda.synchronize()  # an illegal access would surface here (and kill every later test)


def _spoiled_cuda_batches(n: int):
    """`n` random DECODE / EXTEND / MIXED batches on CUDA, some spoiled (as in test_step_checks.py)."""
    rng = random.Random(11)
    for trial in range(n):
        mode = rng.choice(["DECODE", "EXTEND", "MIXED"])
        bs = rng.randint(1, 40)
        if mode == "DECODE":
            reqs = tuple((rng.randint(1, 300), 1) for _ in range(bs))
        else:
            reqs = tuple((rng.randint(0, 200), rng.randint(1 if i == 0 else 0, 40)) for i in range(bs))
            if mode == "MIXED":
                reqs = ((rng.randint(1, 90), 1),) + reqs[1:]
        env = make_env(AttnCase(mode, reqs, page_size=rng.choice([1, 16]), device="cuda", seed=trial))
        yield rng, env


def test_step_check_triton_equals_torch_on_cuda():
    from attn_core.ops.step_checks import step_tensors
    from attn_core.ops.step_checks_triton import check_step_triton

    for rng, env in _spoiled_cuda_batches(60):
        b, r2t = env.batch, env.req_to_token_pool.req_to_token
        bs, T = b.batch_size, b.num_tokens
        what = rng.choice(["none", "row", "dup", "seq", "loc", "locdup", "table"])
        r = rng.randrange(bs)
        if what == "row":
            b.req_pool_indices[r] = rng.choice([-1, r2t.shape[0], 1 << 20])
        elif what == "dup" and bs > 1:
            b.req_pool_indices[r] = b.req_pool_indices[(r + 1) % bs]
        elif what == "seq":
            b.seq_lens[r] += rng.choice([-1, 1, 5000])
        elif what == "loc" and T:
            b.out_cache_loc[rng.randrange(T)] = rng.choice([-1, 0, env.kv_pool.num_slots, 1 << 40])
        elif what == "locdup" and T > 1:
            i, j = rng.sample(range(T), 2)
            b.out_cache_loc[i] = b.out_cache_loc[j]
        elif what == "table":
            r2t[int(b.req_pool_indices[r]) % r2t.shape[0], 0] = -5
        s = step_tensors(b, r2t, env.kv_pool.num_slots)
        f_ref, f_k = (torch.zeros(FAULT_WORDS, dtype=torch.int32, device="cuda") for _ in range(2))
        safe_ref, safe_k = (torch.full((T,), -7, dtype=torch.int64, device="cuda") for _ in range(2))
        check_step_torch(s, safe_ref, f_ref)
        check_step_triton(s, safe_k, f_k)
        assert f_k.tolist() == f_ref.tolist(), (what, b.forward_mode.name)
        assert torch.equal(safe_k, safe_ref), (what, b.forward_mode.name)
        if what == "none":
            assert not f_ref.any()


def _triton_step_env(bs: int = 4):
    _usable("triton")
    case = AttnCase(
        "DECODE",
        tuple((n, 1) for n in (300, 17, 64, 129)[:bs]),
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        dtype="float16",
        device="cuda",
        num_layers=2,
    )
    env = make_env(case)
    env.ctx = dataclasses.replace(env.ctx, validation="basic")
    backend = ac.create_backend("triton", env.ctx)
    env.batch.attn_backend = backend
    return env, backend


def test_a_bad_slot_is_raised_one_step_late_and_the_context_stays_usable():
    env, backend = _triton_step_env()
    b = env.batch
    clean_loc = b.out_cache_loc.clone()
    victim = int(env.req_to_token_pool.req_to_token[int(b.req_pool_indices[0]), 5])  # another token's key
    b.out_cache_loc[2] = victim
    before = [env.kv_pool.get_key_buffer(lid).clone() for lid in range(2)]
    backend.init_forward_metadata(b)  # no error now: no sync was spent
    gen = torch.Generator().manual_seed(0)
    for lid in range(2):
        i = layer_inputs(env, lid, gen)
        make_layer(env.case, lid)(i["q"], i["k"], i["v"], b)
    torch.cuda.synchronize()
    for lid in range(2):
        after = env.kv_pool.get_key_buffer(lid)
        assert torch.equal(after[victim].nan_to_num(3.0), before[lid][victim].nan_to_num(3.0)), (
            "another token's K was overwritten"
        )
    b.out_cache_loc.copy_(clean_loc)
    with pytest.raises(ac.DeviceFaultError) as err:
        backend.init_forward_metadata(b)
    assert err.value.argument == "forward_batch.out_cache_loc" and err.value.request == 2 and err.value.step == 1
    # the context is usable: a good step gives the reference's answer
    from attn_core.testing.hostile import _good_step

    assert _good_step(backend, env, b) <= 2e-2


def test_default_mode_step_and_graph_run_do_not_sync():
    env, backend = _triton_step_env()
    b = env.batch
    layers = [make_layer(env.case, lid) for lid in range(2)]
    gen = torch.Generator().manual_seed(1)
    inputs = [layer_inputs(env, lid, gen) for lid in range(2)]
    backend.init_forward_metadata(b)  # warm-up: compile, allocate
    for layer, i in zip(layers, inputs):
        layer(i["q"], i["k"], i["v"], b)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            backend.init_forward_metadata(b)
            for layer, i in zip(layers, inputs):
                layer(i["q"], i["k"], i["v"], b)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    backend.raise_device_faults()  # nothing was refused

    graph_backend = ac.create_backend(
        "triton", dataclasses.replace(env.ctx, cuda_graph=ac.CudaGraphLevel.UNIFORM_SINGLE_TOKEN_DECODE)
    )
    dt = torch.float16
    shapes = {"q": ((8, 64), dt), "k": ((2, 64), dt), "v": ((2, 64), dt)}

    def run_layers(batch, x):
        out = None
        for layer in layers:
            out = layer(x["q"], x["k"], x["v"], batch)
        return out

    runner = ac.CudaGraphRunner(graph_backend, [4], run_layers, shapes)
    x = {"q": inputs[0]["q"], "k": inputs[0]["k"], "v": inputs[0]["v"]}
    runner.run(b, x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            runner.run(b, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    graph_backend.raise_device_faults()
