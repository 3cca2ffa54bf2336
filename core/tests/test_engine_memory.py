"""Engine-owned KV memory (`EngineKVPool`) and engine-shaped batches (`EngineBatches`): the pieces, and the
kit's engine section failing on backends that get them wrong."""

from __future__ import annotations

import pytest
import torch

import attn_core as ac
from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.contract.errors import IncompatibleBackendError, InvalidArgumentError
from attn_core.memory.engine_pool import has_internal_overlap, slot_view
from attn_core.testing.engine_memory import (
    ENGINE_LAYOUTS,
    LONG_ENGINE_CONTEXT,
    LONG_ENGINE_STEPS,
    EngineCase,
    longest_request,
    run_engine_case,
)
from attn_core.testing.outcome import KitFailure


# ---- EngineKVPool ----------------------------------------------------------------------------------
def test_fused_hnd_cache_is_wrapped_in_place():
    caches = [torch.zeros(5, 2, 4, 16) for _ in range(3)]  # [blocks, H, P, 2D], K|V side by side
    pool = ac.EngineKVPool.from_fused(caches, kv_order="HND")
    assert (pool.kv_layout, pool.page_size, pool.num_slots, pool.head_num, pool.head_dim, pool.layer_num) == (
        "HND",
        4,
        20,
        2,
        8,
        3,
    )
    k = pool.get_key_buffer(1)
    assert k.untyped_storage().data_ptr() == caches[1].untyped_storage().data_ptr() and k.stride() == (128, 64, 16, 1)
    slots = torch.tensor([5, 11])
    new_k, new_v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    pool.set_kv_buffer(1, slots, new_k, new_v)
    # slot 5: page 1 offset 1; slot 11: page 2 offset 3; K the first 8 channels, V the last 8
    assert torch.equal(caches[1][1, :, 1, :8], new_k[0]) and torch.equal(caches[1][2, :, 3, 8:], new_v[1])
    assert caches[0].abs().sum() == 0 and caches[2].abs().sum() == 0


def test_token_major_pages_become_an_nhd_slot_view():
    raw = torch.zeros(6, 4, 2, 16)  # [blocks, P, H, 2D] (vLLM LBNHC), handed over as [blocks, H, P, 2D]
    pool = ac.EngineKVPool.from_fused([raw.permute(0, 2, 1, 3)], kv_order="HND")
    assert pool.kv_layout == "NHD"
    k = pool.get_key_buffer(0)
    assert tuple(k.shape) == (24, 2, 8) and k.stride() == (32, 16, 1)
    pool.set_kv_buffer(0, torch.tensor([9]), torch.ones(1, 2, 8), torch.full((1, 2, 8), 2.0))
    assert torch.equal(raw[2, 1, :, :8], torch.ones(2, 8)) and torch.equal(raw[2, 1, :, 8:], torch.full((2, 8), 2.0))


@pytest.mark.parametrize("kv_dim", [0, 1])
def test_stacked_caches(kv_dim):
    shape = (2, 6, 4, 2, 8) if kv_dim == 0 else (6, 2, 4, 2, 8)
    c = torch.zeros(shape)
    pool = ac.EngineKVPool.from_stacked([c], kv_dim=kv_dim, kv_order="NHD")
    assert pool.kv_layout == ("NHD" if kv_dim == 0 else "HND")  # K pages interleaved with V pages: an HND view
    pool.set_kv_buffer(0, torch.tensor([6]), torch.ones(1, 2, 8), torch.full((1, 2, 8), 3.0))
    k_page = c[0, 1] if kv_dim == 0 else c[1, 0]
    v_page = c[1, 1] if kv_dim == 0 else c[1, 1]
    assert torch.equal(k_page[2], torch.ones(2, 8)) and torch.equal(v_page[2], torch.full((2, 8), 3.0))


def test_fp8_engine_cache_kept_as_bytes():
    c = torch.zeros(4, 2, 4, 16, dtype=torch.float8_e4m3fn)
    pool = ac.EngineKVPool.from_fused([c], kv_order="HND")
    assert pool.dtype == torch.float8_e4m3fn and pool.get_key_buffer(0).dtype == torch.float8_e4m3fn
    pool.set_kv_buffer(0, torch.tensor([4]), torch.full((1, 2, 8), 1.0), torch.full((1, 2, 8), 2.0), k_scale=0.5)
    assert float(c[1, 0, 0, 0].float()) == 2.0 and float(c[1, 0, 0, 8].float()) == 2.0


@pytest.mark.parametrize(
    "make,argument",
    [
        (lambda: ac.EngineKVPool.from_fused([torch.zeros(1, 2, 4, 16)]), "k_caches[0].shape"),  # one page only
        (
            lambda: ac.EngineKVPool.from_fused(
                [torch.zeros(4, 2, 4, 16), torch.zeros(4, 2, 4, 16, dtype=torch.float16)]
            ),
            "k_caches[1].dtype",
        ),
        (lambda: ac.EngineKVPool.from_fused([torch.zeros(4, 2, 4, 16), torch.zeros(4, 3, 4, 16)]), "k_caches[1].shape"),
        (lambda: ac.EngineKVPool.from_fused([torch.zeros(4, 2, 4, 15)]), "caches[0]"),
        (lambda: ac.EngineKVPool([torch.zeros(4, 2, 4, 8)], [torch.zeros(4, 2, 4, 8)], kv_order="XYZ"), "kv_order"),
        (lambda: ac.EngineKVPool([torch.zeros(4, 2, 4, 8)], []), "k_caches/v_caches"),
        (lambda: ac.EngineKVPool.from_stacked([torch.zeros(3, 6, 4, 2, 8)], kv_dim=0), "caches[0]"),
        (lambda: ac.EngineKVPool.from_fused([torch.zeros(4, 2, 16, 4).transpose(2, 3)]), "k_caches[0].stride()"),
    ],
)
def test_bad_engine_tensors_are_named(make, argument):
    with pytest.raises(InvalidArgumentError) as err:
        make()
    assert err.value.argument == argument


def test_overlap_and_slot_view_helpers():
    assert not has_internal_overlap(torch.empty(4, 2, 8))
    assert has_internal_overlap(torch.empty(40).as_strided((4, 2, 8), (8, 4, 1)))
    assert slot_view(torch.empty(6, 2, 4, 8)) is None
    flat = slot_view(torch.empty(6, 4, 2, 8).permute(0, 2, 1, 3))
    assert tuple(flat.shape) == (24, 2, 8) and flat.stride() == (16, 8, 1)


def test_a_backend_without_engine_layouts_refuses_the_pool():
    class NoEngine(TorchNativeBackend):
        capabilities = ac.Capabilities(
            devices=frozenset({"cpu"}),
            q_dtypes=frozenset({"float32"}),
            kv_dtypes=frozenset({"float32"}),
            kv_layouts=frozenset({"NHD", "HND"}),
        )

    pool = ac.EngineKVPool.from_fused([torch.zeros(4, 2, 4, 16)])
    ctx = ac.BackendContext(
        device="cpu", dtype=torch.float32, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, token_to_kv_pool=pool
    )
    with pytest.raises(IncompatibleBackendError, match="engine-owned KV pool in layout HND"):
        NoEngine(ctx)


# ---- EngineBatches ---------------------------------------------------------------------------------
def _batches(pages=12, page=4):
    pool = ac.EngineKVPool.from_fused([torch.zeros(pages, 2, page, 16)])
    return ac.EngineBatches(pool, max_requests=4, max_context_len=30)


def test_engine_batch_worked_example():
    eb = _batches()
    qsl, seq = torch.tensor([0, 1, 4], dtype=torch.int32), torch.tensor([6, 3], dtype=torch.int32)
    b = eb.build(
        query_start_loc=qsl,
        seq_lens=seq,
        block_table=torch.tensor([[7, 2], [5, 0]], dtype=torch.int32),
        slot_mapping=torch.tensor([9, 20, 21, 22, -1, -1]),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq,
    )
    assert b.forward_mode is ac.ForwardMode.MIXED and b.num_tokens == 4
    table = eb.req_to_token_pool.req_to_token
    assert table[0, :8].tolist() == [28, 29, 30, 31, 8, 9, 10, 11] and table[1, :4].tolist() == [20, 21, 22, 23]
    assert (
        b.extend_seq_lens.tolist() == [1, 3]
        and b.extend_prefix_lens.tolist() == [5, 0]
        and b.out_cache_loc.tolist() == [9, 20, 21, 22]
    )
    assert b.extend_start_loc.data_ptr() == qsl.data_ptr() and b.seq_lens is seq  # the engine's tensors, not copies


@pytest.mark.parametrize(
    "q,seq,mode",
    [
        ([0, 1, 2], [5, 9], "DECODE"),
        ([0, 3, 5], [3, 2], "EXTEND"),
        ([0, 1, 3], [4, 2], "MIXED"),
        ([0, 2, 3], [7, 1], "EXTEND"),
    ],
)
def test_engine_batch_mode_is_derived(q, seq, mode):
    eb = _batches()
    qsl, s = torch.tensor(q, dtype=torch.int32), torch.tensor(seq, dtype=torch.int32)
    T = q[-1]
    b = eb.build(
        query_start_loc=qsl,
        seq_lens=s,
        block_table=torch.tensor([[3, 4, 5], [6, 7, 8]], dtype=torch.int32),
        slot_mapping=torch.arange(12, 12 + T),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=s,
    )
    assert b.forward_mode.name == mode


@pytest.mark.parametrize(
    "spoil,argument",
    [
        (dict(query_start_loc=torch.tensor([0, 2], dtype=torch.int64)), "query_start_loc.dtype"),
        (
            dict(seq_lens_cpu=torch.tensor([1], dtype=torch.int32)),
            "query_start_loc_cpu/seq_lens_cpu",
        ),  # query longer than seq
        (
            dict(
                block_table=torch.tensor([[3]], dtype=torch.int32),
                seq_lens=torch.tensor([6], dtype=torch.int32),
                seq_lens_cpu=torch.tensor([6], dtype=torch.int32),
            ),
            "block_table.shape",
        ),
        (dict(block_table=torch.tensor([[30, 1]], dtype=torch.int32)), "block_table"),
        (dict(slot_mapping=torch.tensor([13, 48])), "slot_mapping"),
        (dict(slot_mapping=torch.tensor([13])), "slot_mapping.shape"),
        (dict(block_table=torch.tensor([3, 1], dtype=torch.int32)), "block_table.shape"),
    ],
)
def test_engine_batch_bad_inputs_are_named(spoil, argument):
    eb = _batches()
    qsl, seq = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    args = dict(
        query_start_loc=qsl,
        seq_lens=seq,
        block_table=torch.tensor([[3, 1]], dtype=torch.int32),
        slot_mapping=torch.tensor([12, 13]),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq,
    )
    args.update(spoil)
    with pytest.raises(InvalidArgumentError) as err:
        eb.build(**args)
    assert err.value.argument == argument


def test_too_many_requests_and_keys_past_the_table():
    eb = _batches()
    qsl = torch.arange(6, dtype=torch.int32)
    seq = torch.ones(5, dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match="max_requests"):
        eb.build(
            query_start_loc=qsl,
            seq_lens=seq,
            block_table=torch.ones(5, 1, dtype=torch.int32),
            slot_mapping=torch.arange(4, 9),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq,
        )
    qsl, seq = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([40], dtype=torch.int32)
    with pytest.raises(InvalidArgumentError) as err:
        eb.build(
            query_start_loc=qsl,
            seq_lens=seq,
            block_table=torch.ones(1, 10, dtype=torch.int32),
            slot_mapping=torch.tensor([5]),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq,
        )
    assert err.value.argument == "seq_lens_cpu"


# ---- forward(out=) -----------------------------------------------------------------------------------
def test_forward_out_must_fit_before_any_write():
    case = EngineCase("vllm_lbhnc", steps=((("a", 5),),))
    from attn_core.testing.engine_memory import EngineWorld

    w = EngineWorld(case, lambda ctx: ac.create_backend("torch_native", ctx))
    w.admit(case.steps[0])
    t = w.step_tensors(case.steps[0])
    b = w.batches.build(**t, attn_backend=w.backend)
    w.backend.init_forward_metadata(b)
    before = w.raw.clone()
    q, k, v = torch.randn(5, 4, 32), torch.randn(5, 2, 32), torch.randn(5, 2, 32)
    for bad in (torch.empty(5, 4, 31), torch.empty(5, 128, dtype=torch.float16), torch.empty(5, 8, 32)[:, ::2]):
        with pytest.raises(InvalidArgumentError) as err:
            w.backend.forward(q, k, v, w.layers[0], b, out=bad)
        assert err.value.argument == "out"
    assert torch.equal(torch.nan_to_num(w.raw, nan=7.0), torch.nan_to_num(before, nan=7.0))


# ---- the kit's engine section fails on broken backends -----------------------------------------------
class CopyingBackend(TorchNativeBackend):
    """Writes new K/V into a copy of the cache (an engine's memory never sees them)."""

    name = "copying"

    def save_kv(self, k, v, layer, forward_batch):
        pool = self.kv_pool(forward_batch)
        saved = [b.clone() for b in (pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id])]
        out = super().save_kv(k, v, layer, forward_batch)
        self._copies = saved
        pool.k_buffer[layer.layer_id].copy_(saved[0])  # the engine's memory back as it was
        pool.v_buffer[layer.layer_id].copy_(saved[1])
        return out


class DenseStrideBackend(TorchNativeBackend):
    """Reads an HND cache as if it were dense (ignores the engine's strides)."""

    name = "dense_strides"

    def _forward(self, q, k, v, layer, batch, save_kv_cache, sinks=None, return_lse=False):
        pool = self.kv_pool(batch)
        lid = layer.layer_id
        real_k, real_v = pool.k_buffer[lid], pool.v_buffer[lid]
        pool.k_buffer[lid] = real_k.as_strided(real_k.shape, torch.empty(real_k.shape).stride())
        pool.v_buffer[lid] = real_v.as_strided(real_v.shape, torch.empty(real_v.shape).stride())
        try:
            return super()._forward(q, k, v, layer, batch, save_kv_cache, sinks, return_lse)
        finally:
            pool.k_buffer[lid], pool.v_buffer[lid] = real_k, real_v


@pytest.mark.parametrize("cls,message", [(CopyingBackend, "differs from before"), (DenseStrideBackend, "rel err")])
def test_kit_engine_section_catches_broken_backends(cls, message):
    with pytest.raises(KitFailure, match=message):
        run_engine_case(cls, EngineCase("vllm_lbhnc"))


@pytest.mark.parametrize("layout", sorted(ENGINE_LAYOUTS))
def test_every_engine_layout_on_torch_native_with_bf16(layout):
    run_engine_case(lambda ctx: ac.create_backend("torch_native", ctx), EngineCase(layout, dtype="bfloat16", seed=3))


def test_the_gpu_schedule_fits_its_table_and_runs_on_the_cpu():
    """tests/test_engine_kv_gpu.py's schedule with its table width, small heads, on torch_native; with the
    default width of 128 it is refused up front, naming seq_lens_cpu (the GPU test once ran it so)."""
    assert longest_request(LONG_ENGINE_STEPS, 16) <= LONG_ENGINE_CONTEXT
    case = EngineCase("vllm_lbhnc", steps=LONG_ENGINE_STEPS, max_context_len=LONG_ENGINE_CONTEXT)
    run_engine_case(lambda ctx: ac.create_backend("torch_native", ctx), case)
    short = EngineCase("vllm_lbhnc", steps=LONG_ENGINE_STEPS)
    with pytest.raises(ac.InvalidArgumentError, match="seq_lens_cpu"):
        run_engine_case(lambda ctx: ac.create_backend("torch_native", ctx), short)


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_engine_batches_through_the_graph_metadata_path(backend):
    """CUDA-graph capture / replay metadata (the calls a graph runner makes; on the CPU without capture)
    over engine batches: the graph metadata reads the persistent table `EngineBatches.build` refreshes in
    place, and each replayed DECODE step equals the eager step and the float64 reference."""
    if backend == "triton":
        from attn_core.discovery.probes import triton_interpreter_enabled

        if not triton_interpreter_enabled():
            pytest.skip("attn-triton on CPU tensors needs TRITON_INTERPRET=1")
    from attn_core.contract.graph_step import CudaGraphStep
    from attn_core.testing.reference import reference_attention, relative_error

    torch.manual_seed(0)
    H, HKV, D, P = 4, 2, 32, 4
    pool = ac.EngineKVPool.from_fused([torch.full((16, HKV, P, 2 * D), float("nan"))], kv_order="HND")
    steps = ac.EngineBatches(pool, max_requests=4, max_context_len=32)
    ctx = ac.BackendContext(
        device="cpu",
        dtype=torch.float32,
        num_q_heads=H,
        num_kv_heads=HKV,
        head_dim=D,
        page_size=P,
        max_batch_size=4,
        max_context_len=32,
        req_to_token_pool=steps.req_to_token_pool,
        token_to_kv_pool=pool,
        cuda_graph=ac.CudaGraphLevel.UNIFORM_SINGLE_TOKEN_DECODE,
        forward_modes={"extend", "decode"},
    )
    graph, eager = ac.create_backend(backend, ctx), ac.create_backend(backend, ctx)
    layer = ac.AttentionLayer(0, H, HKV, D)
    tables = torch.tensor([[5, 9, 2], [11, 3, 7]], dtype=torch.int32)  # scattered pages

    def step(q_lens, seq):
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        pos = [torch.arange(s - n, s) for s, n in zip(seq, q_lens)]
        slots = torch.cat([tables[r][p // P] * P + p % P for r, p in enumerate(pos)])
        s = torch.tensor(seq, dtype=torch.int32)
        tensors = dict(query_start_loc=qsl, seq_lens=s, block_table=tables, slot_mapping=slots)
        return steps.build(**tensors, query_start_loc_cpu=qsl, seq_lens_cpu=s), pos

    prefill, _ = step([5, 3], [5, 3])  # prefill the two requests eagerly
    prefill.attn_backend = eager
    eager.init_forward_metadata(prefill)
    k, v = torch.randn(8, HKV, D), torch.randn(8, HKV, D)
    eager.forward(torch.randn(8, H, D), k, v, layer, prefill)
    history = [[k[:5], v[:5]], [k[5:], v[5:]]]
    graph.init_cuda_graph_state(4, 4)
    rows, lens = torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.int32)
    graph.capture_cuda_graph_metadata(
        CudaGraphStep(forward_mode=ac.ForwardMode.DECODE, bs=2, req_pool_indices=rows, seq_lens=lens)
    )
    seq = [5, 3]
    for _ in range(4):
        seq = [s + 1 for s in seq]
        batch, pos = step([1, 1], seq)
        assert batch.forward_mode is ac.ForwardMode.DECODE
        q, k, v = torch.randn(2, H, D), torch.randn(2, HKV, D), torch.randn(2, HKV, D)
        graph.init_forward_metadata_replay_cuda_graph(
            2,
            batch.req_pool_indices,
            batch.seq_lens,
            batch.seq_lens_sum,
            None,
            ac.ForwardMode.DECODE,
            None,
            batch.seq_lens_cpu,
        )
        out_graph = graph.forward(q, k, v, layer, batch).clone()
        eager.init_forward_metadata(batch)
        out_eager = eager.forward(q, k, v, layer, batch, save_kv_cache=False)
        assert torch.equal(out_graph, out_eager)
        for r in range(2):
            history[r] = [torch.cat([history[r][0], k[r : r + 1]]), torch.cat([history[r][1], v[r : r + 1]])]
            ref, _ = reference_attention(q[r : r + 1], *history[r], q_positions=pos[r], scale=layer.scaling)
            assert relative_error(out_graph[r : r + 1].view(1, H, D), ref) <= 1e-5
