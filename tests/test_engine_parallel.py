"""The example engine across ranks (gloo, spawned CPU processes): greedy tokens under tensor
parallelism (TP=2: a model whose one KV head is replicated over the ranks and one whose KV heads are
split; each rank's KV pool holds only its heads) and under decode context parallelism (DCP=2 and 3:
each rank stores its interleaved share of every request's KV; eager, and with its decode steps through
`CudaGraphRunner` as graph-shaped DCP steps: real CUDA graphs on GPUs, the runner's eager replay on a
CPU) equal TP=1 and `transformers`' generate."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from attn_core.testing.distributed import run_ranks

pytest.importorskip("transformers", reason="transformers is a test-only install")
ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()
MODELS = [(2, 1), (4, 2)]  # (q heads, KV heads): replicated KV head, split KV heads


def load_engine_module():
    spec = importlib.util.spec_from_file_location("hf_llama", ROOT / "examples" / "hf_llama.py")
    module = sys.modules.setdefault("hf_llama", importlib.util.module_from_spec(spec))
    if not hasattr(module, "Engine"):
        spec.loader.exec_module(module)
    return module


def run(
    hf_llama,
    heads,
    tp_group=None,
    device="cpu",
    backend="torch_native",
    attn_dtype=torch.float32,
    dcp_group=None,
    graph_sizes=(),
):
    """The engine's outputs over a short scenario (arrivals, decodes; with `serve`: chunked prefill and
    prefix forks; with DCP `serve_dcp`: whole-prompt prefills; `graph_sizes`: decode steps of up to 3
    requests through the graph runner)."""
    model = hf_llama.tiny_llama(seed=0, layers=2, heads=heads, device=device)
    engine = hf_llama.Engine(
        model,
        backend,
        page_size=4,
        num_slots=256,
        max_running=3,
        token_budget=16,
        tp_group=tp_group,
        attn_dtype=attn_dtype,
        dcp_group=dcp_group,
        graph_sizes=graph_sizes,
    )
    for layer in range(engine.kv.layer_num):
        engine.kv.get_key_buffer(layer).fill_(float("nan"))
        engine.kv.get_value_buffer(layer).fill_(float("nan"))
    serve = engine.serve if dcp_group is None else engine.serve_dcp
    jobs = serve(hf_llama.demo_jobs(seed=1, n=4, max_new=4))
    assert (
        engine.requests.num_requests == 0
        and engine.requests.allocator.available_size() == engine.requests.allocator.size
    )
    return engine, [j.out for j in jobs]


def tp_worker(rank: int, world: int, device: str = "cpu", backend: str = "torch_native", dtype_name: str = "float32"):
    import torch.distributed as dist

    hf_llama = load_engine_module()
    outs = []
    for heads in MODELS:
        engine, out = run(
            hf_llama,
            heads,
            dist.group.WORLD,
            f"cuda:{rank}" if device == "cuda" else device,
            backend,
            getattr(torch, dtype_name),
        )
        s = hf_llama.head_slice(heads[0], heads[1], rank, world)
        assert engine.kv.head_num == s.num_kv == max(1, heads[1] // world)
        assert engine.layers[0].num_q_heads == heads[0] // world
        outs.append(out)
    return outs + dcp_worker(rank, world, device, backend, dtype_name)


def dcp_worker(rank: int, world: int, device: str = "cpu", backend: str = "torch_native", dtype_name: str = "float32"):
    import torch.distributed as dist

    hf_llama = load_engine_module()
    dev = f"cuda:{rank}" if device == "cuda" else device
    outs = []
    for sizes in ((), (2, 4)):  # eager, then graph-shaped decode steps through the runner (3 requests: the graph of 4)
        engine, out = run(
            hf_llama,
            MODELS[0],
            device=dev,
            backend=backend,
            attn_dtype=getattr(torch, dtype_name),
            dcp_group=dist.group.WORLD,
            graph_sizes=sizes,
        )
        assert engine.dcp.layout.world == world and engine.dcp.layout.interleave == 4
        assert (engine.graphs is not None) == bool(sizes)
        outs.append(out)
    return outs


def tp_dcp_worker(rank: int, world: int):
    """TP=2 x DCP=2 on 4 ranks: rank = 2 * d + t holds head slice t (TP group {2d, 2d+1}) and KV shard
    d (DCP group {t, t+2}); MODELS[1], whose two KV heads split over the TP group."""
    import torch.distributed as dist

    hf_llama = load_engine_module()
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dcp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp, dcp = tp_groups[rank // 2], dcp_groups[rank % 2]
    engine, out = run(hf_llama, MODELS[1], tp_group=tp, dcp_group=dcp)
    assert engine.kv.head_num == 1 and engine.dcp.layout.world == 2 and engine.dcp.rank == rank // 2
    return out


def reference(hf_llama, heads, device="cpu"):
    model = hf_llama.tiny_llama(seed=0, layers=2, heads=heads, device=device)
    outs = []
    for j in hf_llama.demo_jobs(seed=1, n=4, max_new=4):
        ids = torch.tensor([j.prompt], device=device)
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


def test_head_slice():
    hf_llama = load_engine_module()
    hs = hf_llama.head_slice
    assert hs(8, 2, 1, 2) == hf_llama.HeadSlice(4, 4, 1, 1)
    assert hs(2, 1, 1, 2) == hf_llama.HeadSlice(1, 1, 0, 1)
    assert [hs(8, 2, r, 4).kv_start for r in range(4)] == [0, 0, 1, 1]
    for hq, hkv, world in [(8, 2, 2), (8, 2, 4), (8, 8, 4), (4, 1, 4)]:
        group = hq // hkv
        for r in range(world):
            s = hs(hq, hkv, r, world)
            # every q head of the rank reads a KV head the rank holds
            assert all(s.kv_start <= h // group < s.kv_start + s.num_kv for h in range(s.q_start, s.q_start + s.num_q))
    with pytest.raises(ValueError):
        hs(6, 2, 0, 4)


def test_tp2_and_dcp2_match_tp1_and_generate():
    hf_llama = load_engine_module()
    per_rank = run_ranks(
        HERE, "tp_worker", 2, timeout_s=180
    )  # TP=2 for each model, then DCP=2 (MODELS[0]) eager and graphed
    for m, heads in enumerate(MODELS):
        want = reference(hf_llama, heads)
        assert run(hf_llama, heads)[1] == want, heads
        assert per_rank[0][m] == per_rank[1][m] == want, heads
    want = reference(hf_llama, MODELS[0])
    assert per_rank[0][-2:] == per_rank[1][-2:] == [want, want], "DCP=2 (eager, graphs)"


def test_dcp3_matches_generate():
    hf_llama = load_engine_module()
    per_rank = run_ranks(HERE, "dcp_worker", 3, timeout_s=180)
    want = reference(hf_llama, MODELS[0])
    assert all(out == [want, want] for out in per_rank)  # eager, graphs


def test_tp2_x_dcp2_matches_generate():
    hf_llama = load_engine_module()
    per_rank = run_ranks(HERE, "tp_dcp_worker", 4, timeout_s=240)
    want = reference(hf_llama, MODELS[1])
    assert all(out == want for out in per_rank)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype_name", [("triton", "float32"), ("flashinfer", "float16")])
def test_tp2_dcp2_nccl_matches_generate(backend, dtype_name):
    """TP=2 and DCP=2 on 2 GPUs over NCCL; DCP=2 eager and with its decode steps in CUDA graphs (the
    collectives captured)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    hf_llama = load_engine_module()
    per_rank = run_ranks(HERE, "tp_worker", 2, args=("cuda", backend, dtype_name), timeout_s=300, dist_backend="nccl")
    for m, heads in enumerate(MODELS):
        assert per_rank[0][m] == per_rank[1][m] == reference(hf_llama, heads, "cuda"), heads
    want = reference(hf_llama, MODELS[0], "cuda")
    assert per_rank[0][-2:] == per_rank[1][-2:] == [want, want], "DCP=2 (eager, CUDA graphs)"
