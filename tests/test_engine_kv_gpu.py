"""Engine-owned KV memory on CUDA (GPU only; skipped without CUDA): attn-triton and attn-flashinfer over
vLLM's cache layouts (`attn_core.testing.engine_memory.ENGINE_LAYOUTS`) with engine-shaped steps built by
hand (block tables of scattered pages, slot mappings, cumulative query lengths), bf16, realistic heads, the
whole cache compared bit for bit with what the writes should leave and every output against the float64
reference. `bash scripts/gpu_checks.sh engine-kv` runs this file and benchmarks/engine_kv_layout.py."""

from __future__ import annotations

import pytest
import torch

import attn_core as ac
from attn_core.discovery.registry import default_registry
from attn_core.testing.engine_memory import (
    ENGINE_LAYOUTS,
    LONG_ENGINE_CONTEXT,
    LONG_ENGINE_STEPS,
    EngineCase,
    run_engine_case,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _usable(name: str) -> None:
    entry = default_registry().resolve(name)
    reason = entry.probe()
    if reason:
        pytest.skip(f"{name}: {reason}")


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("layout", sorted(ENGINE_LAYOUTS))
@pytest.mark.parametrize("write_by", ["save_kv", "forward"])
def test_engine_layouts_on_cuda(backend, layout, write_by):
    _usable(backend)
    case = EngineCase(
        layout,
        num_q_heads=16,
        num_kv_heads=4,
        head_dim=128,
        page_size=16,
        dtype="bfloat16",
        device="cuda",
        write_by=write_by,
        steps=LONG_ENGINE_STEPS,
        max_context_len=LONG_ENGINE_CONTEXT,
    )
    print(run_engine_case(lambda ctx: ac.create_backend(backend, ctx), case))


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("layout", ["vllm_lbhnc", "vllm_lbnhc", "flashinfer"])
def test_engine_layouts_with_a_sliding_window_on_cuda(backend, layout):
    _usable(backend)
    case = EngineCase(
        layout,
        num_q_heads=16,
        num_kv_heads=4,
        head_dim=128,
        dtype="bfloat16",
        device="cuda",
        sliding_window=64,
        steps=LONG_ENGINE_STEPS,
        max_context_len=LONG_ENGINE_CONTEXT,
    )
    print(run_engine_case(lambda ctx: ac.create_backend(backend, ctx), case))


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_engine_kv_kit_section_on_cuda(backend):
    """The kit's engine section (every declared layout, forward writes, window, hostile engines) on cuda."""
    _usable(backend)
    from attn_core.testing.engine_memory import engine_hostile_checks
    from attn_core.testing.target import resolve_target

    target = resolve_target(backend)
    case = EngineCase("vllm_lbhnc", num_q_heads=16, num_kv_heads=4, head_dim=128, dtype="bfloat16", device="cuda")
    for name, check in engine_hostile_checks(target, case).items():
        print(name, check())


def test_engine_batches_build_without_a_host_sync():
    """`EngineBatches.build` on CUDA tensors (indices unchecked, as an engine runs it) makes no host-device
    sync: torch's sync debug mode turns any into an error."""
    pool = ac.EngineKVPool.from_fused([torch.zeros(64, 4, 16, 256, dtype=torch.bfloat16, device="cuda")])
    steps = ac.EngineBatches(pool, max_requests=8, max_context_len=512)
    qsl_cpu, seq_cpu = torch.tensor([0, 1, 9], dtype=torch.int32), torch.tensor([40, 8], dtype=torch.int32)
    tensors = dict(
        query_start_loc=qsl_cpu.cuda(),
        seq_lens=seq_cpu.cuda(),
        block_table=torch.tensor([[5, 9, 3], [7, 0, 0]], dtype=torch.int32, device="cuda"),
        slot_mapping=torch.tensor([3 * 16 + 7, *range(7 * 16, 7 * 16 + 8)], device="cuda"),
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = steps.build(**tensors, query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_cpu, check_indices=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert batch.forward_mode is ac.ForwardMode.MIXED and batch.num_tokens == 9
    assert (
        steps.req_to_token_pool.req_to_token[0, :40].tolist() == [b * 16 + i for b in (5, 9, 3) for i in range(16)][:40]
    )
