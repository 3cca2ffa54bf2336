"""The example engine (examples/hf_llama.py) against `transformers`' own greedy `generate`, on every
backend usable here: arrivals over time, chunked prefill under a token budget (MIXED steps), prefix
sharing, finished requests freed and their pages reused; the KV pool is poisoned with NaN before the
run and no request row or KV slot may be left allocated after it."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

import attn_core as ac
from attn_core.testing.device_path import STEP_CHECKS, accelerator_checks

pytest.importorskip(
    "transformers", reason="transformers is a test-only install (scripts/setup.sh; GPU runs: wheels in .whl/)"
)
ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("hf_llama", ROOT / "examples" / "hf_llama.py")
hf_llama = sys.modules.setdefault("hf_llama", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(hf_llama)


def _usable(name: str, device: str) -> bool:
    entry = next(e for e in ac.list_backends() if e.name == name)
    return (entry.ok and entry.probe() is None) or (
        name == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    )


def hf_greedy(model, jobs) -> list[list[int]]:
    """`transformers`' own greedy decoding of each job's prompt (eager attention, its own KV cache)."""
    outs = []
    for j in jobs:
        ids = torch.tensor([j.prompt], device=model.device)
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=j.max_new,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
        outs.append(gen[0, len(j.prompt) :].tolist())
    return outs


def poison(engine) -> None:
    for layer in range(engine.kv.layer_num):
        engine.kv.get_key_buffer(layer).fill_(float("nan"))
        engine.kv.get_value_buffer(layer).fill_(float("nan"))


def assert_no_leak(engine) -> None:
    pool = engine.requests
    assert pool.num_requests == 0
    assert pool.req_to_token_pool.available_size() == pool.req_to_token_pool.size, "a request row leaked"
    assert pool.allocator.available_size() == pool.allocator.size, "KV slots leaked"


def run_engine(model, jobs, **engine_kw):
    engine = hf_llama.Engine(model, **engine_kw)
    poison(engine)
    engine.serve(jobs)
    assert_no_leak(engine)
    return engine, [j.out for j in jobs]


@pytest.fixture(scope="module")
def model():
    return hf_llama.tiny_llama(seed=0, layers=2)


@pytest.fixture(scope="module")
def reference(model):
    return hf_greedy(model, hf_llama.demo_jobs(seed=1, n=8, max_new=5))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", ["torch_native", "cpu_amx"])
def test_engine_matches_generate(model, reference, backend, page_size):
    if not _usable(backend, "cpu"):
        pytest.skip(f"{backend} cannot run here")
    jobs = hf_llama.demo_jobs(seed=1, n=8, max_new=5)
    num_slots = 160
    assert sum(len(j.prompt) + j.max_new for j in jobs) > num_slots  # finished requests' pages must be reused
    engine, outs = run_engine(
        model, jobs, backend=backend, page_size=page_size, num_slots=num_slots, max_running=3, token_budget=24
    )
    assert outs == reference
    assert engine.shared_tokens > 0, "no request forked over a shared prefix"


@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_matches_generate_triton_interpreter(page_size):
    if not _usable("triton", "cpu"):
        pytest.skip("triton needs a GPU or TRITON_INTERPRET=1")
    model = hf_llama.tiny_llama(seed=2, layers=1)
    jobs = hf_llama.demo_jobs(seed=3, n=3, max_new=3)
    reference = hf_greedy(model, jobs)
    _, outs = run_engine(
        model, jobs, backend="triton", page_size=page_size, num_slots=128, max_running=2, token_budget=16
    )
    assert outs == reference


def test_hf_attention_interface_matches_generate(reference):
    """HF's own forward (attn_implementation "attn" registered through AttentionInterface) on attn."""
    jobs = hf_llama.demo_jobs(seed=1, n=8, max_new=5)
    model = hf_llama.tiny_llama(seed=0, layers=2)
    _, outs = run_engine(
        model,
        jobs,
        backend="torch_native",
        page_size=16,
        num_slots=160,
        max_running=3,
        token_budget=24,
        hf_forward=True,
    )
    assert outs == reference


def test_graph_runner_decode_matches_generate(model, reference):
    """Decode steps through CudaGraphRunner (eager replay of the static buffers on the CPU)."""
    jobs = hf_llama.demo_jobs(seed=1, n=8, max_new=5)
    engine, outs = run_engine(
        model,
        jobs,
        backend="torch_native",
        page_size=16,
        num_slots=160,
        max_running=3,
        token_budget=24,
        graph_sizes=(1, 2, 4),
    )
    assert outs == reference


@pytest.mark.parametrize("page_size", [1, 16])
def test_speculative_matches_generate(model, page_size):
    """Draft = the first layer of the model (MultiStepDraftBackend), TARGET_VERIFY by the full model:
    the greedy output equals plain greedy decoding."""
    jobs = hf_llama.demo_jobs(seed=4, n=3, max_new=9)
    reference = hf_greedy(model, jobs)
    engine = hf_llama.Engine(model, "torch_native", page_size, num_slots=256, max_running=3, spec_steps=3)
    poison(engine)
    engine.serve_speculative(jobs, draft_layers=1)
    assert_no_leak(engine)
    assert [j.out for j in jobs] == reference
    assert engine.accepted_drafts > 0, "no draft token accepted: the multi-token commit path went untested"


def assert_no_fault(engine) -> None:
    """Nothing refused by the device checks of any step (one sync per backend: the fault word read now)."""
    for backend in [engine.backend] + (engine.draft.backends if engine.draft is not None else []):
        backend.raise_device_faults()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("step_check", STEP_CHECKS)
def test_engine_on_the_accelerator_path(model, step_check, page_size):
    """The GPU test's steps on CPU tensors as an accelerator validates them by default (validation "basic":
    host checks, then the step check on the device tensors, torch or the Triton kernel under the
    interpreter): eager and graph-runner decode and speculative decoding equal `generate`, and no step of
    the engine or of the draft wrapper is refused (a correct engine's batches; on a GPU the Triton step
    check once refused the draft steps' strided slots with a false WRITE_OWNER)."""
    if step_check == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton step check on CPU tensors needs TRITON_INTERPRET=1")
    with accelerator_checks(step_check):
        for graph_sizes in ((), (1, 2, 4)):
            jobs = hf_llama.demo_jobs(seed=1, n=4, max_new=4)
            engine, outs = run_engine(
                model,
                jobs,
                backend="torch_native",
                page_size=page_size,
                num_slots=160,
                max_running=3,
                token_budget=24,
                graph_sizes=graph_sizes,
            )
            assert outs == hf_greedy(model, hf_llama.demo_jobs(seed=1, n=4, max_new=4)), graph_sizes
            assert_no_fault(engine)
        jobs = hf_llama.demo_jobs(seed=4, n=3, max_new=7)
        engine = hf_llama.Engine(model, "torch_native", page_size, num_slots=256, max_running=3, spec_steps=3)
        poison(engine)
        engine.serve_speculative(jobs, draft_layers=1)
        assert_no_leak(engine)
        assert_no_fault(engine)
        assert [j.out for j in jobs] == hf_greedy(model, hf_llama.demo_jobs(seed=4, n=3, max_new=7))


GPU_CASES = [("triton", torch.float32), ("flashinfer", torch.float16)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend,attn_dtype", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_engine_on_gpu(backend, attn_dtype):
    """On a GPU: eager, CUDA-graph decode and speculative decoding, all equal to `generate` (float32
    model; flashinfer's attention runs in float16, the rest in float32)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not _usable(backend, "cuda"):
        pytest.skip(f"{backend} cannot run here")
    model = hf_llama.tiny_llama(seed=0, layers=2, device="cuda")
    jobs = hf_llama.demo_jobs(seed=1, n=8, max_new=8)
    reference = hf_greedy(model, jobs)
    for page_size in (1, 16):
        for graph_sizes in ((), (1, 2, 4)):
            fresh = hf_llama.demo_jobs(seed=1, n=8, max_new=8)
            _, outs = run_engine(
                model,
                fresh,
                backend=backend,
                page_size=page_size,
                num_slots=256,
                max_running=4,
                token_budget=32,
                attn_dtype=attn_dtype,
                graph_sizes=graph_sizes,
            )
            assert outs == reference, (page_size, graph_sizes)
        spec_jobs = hf_llama.demo_jobs(seed=4, n=4, max_new=12)
        engine = hf_llama.Engine(
            model, backend, page_size, num_slots=512, max_running=4, attn_dtype=attn_dtype, spec_steps=3
        )
        poison(engine)
        engine.serve_speculative(spec_jobs, draft_layers=1)
        assert_no_leak(engine)
        assert_no_fault(engine)
        assert [j.out for j in spec_jobs] == hf_greedy(model, hf_llama.demo_jobs(seed=4, n=4, max_new=12)), (
            "speculative",
            page_size,
        )
