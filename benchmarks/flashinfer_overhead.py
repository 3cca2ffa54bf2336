"""What attn-flashinfer adds on top of FlashInfer itself, measured side by side on one GPU.

Two numbers per shape (GQA 32 q / 8 kv heads, head_dim 128, bf16, page size 16):
- per-layer `forward` time (CUDA events over back-to-back calls) against calling FlashInfer's own
  wrappers directly, planned by FlashInfer's public `plan` with the arguments the backend plans with
  (decode: the tensor-core decode wrapper's run; extend with a prefix: ragged run + paged run +
  FlashInfer's merge_state_in_place), on page ids built from the batch's request rows with attn-core's
  public index ops. Our forward runs with save_kv_cache=False, as FlashInfer's run stores nothing; the
  time with the K/V store is reported too.
- host time of one step's `init_forward_metadata` (index building + plans; from the second step on the
  backend re-plans its wrappers lean, see attn_flashinfer/replan.py) against those FlashInfer plan calls
  on the same, prebuilt, inputs, and against the same plan calls preceded by building the step's page ids
  and offsets with attn-core's public index ops (what an engine driving FlashInfer alone does every step;
  the three timed in turn); for decode also the CUDA-graph replay metadata (index launch into the
  graph's buffers + lean re-plan, and, on a backend made with `lean_replan=False`, FlashInfer's own plan).

The backend is made with `attn_core.create_backend` and driven through the public contract only; every
timing goes through `attn_core.bench.timing`.

    python benchmarks/flashinfer_overhead.py --json out.json [--validation full]

`--validation` sets the contexts' batch validation level ("basic", the default, or "full": one more
device sync per step); the decode bs256 row is the issue-11 budget shape.

Needs a CUDA GPU and flashinfer-python (attn-flashinfer installed, or PYTHONPATH with core/src and
plugins/flashinfer_backend/src).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from attn_core import (
    AttentionLayer,
    BackendContext,
    MHATokenToKVPool,
    PagedTokenAllocator,
    ReqToTokenPool,
    create_backend,
)
from attn_core.bench.timing import event_times_us, host_times_us, interleave
from attn_core.ops.kv_indices import kv_indices_from_req_to_token, last_page_len_from_lens, page_indptr_from_lens
from attn_core.testing.batch_builder import build_forward_batch

HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
WORKSPACE_BYTES = 128 << 20  # the peers' FlashInfer workspace (attn-flashinfer's default size)


def setup(mode: str, reqs: list[tuple[int, int]], validation: str = "basic"):
    total = sum(p + e for p, e in reqs)
    size = PAGE * (sum(-(-(p + e) // PAGE) for p, e in reqs) + 2)
    max_len = max(p + e for p, e in reqs) + PAGE
    kv_pool = MHATokenToKVPool(size, PAGE, DTYPE, HKV, D, 1, "cuda")
    kv_pool.get_key_buffer(0).normal_()
    kv_pool.get_value_buffer(0).normal_()
    req_pool = ReqToTokenPool(len(reqs), max_len, "cuda")
    alloc = PagedTokenAllocator(size, PAGE, "cuda")
    batch = build_forward_batch(mode, reqs, req_to_token_pool=req_pool, allocator=alloc, token_to_kv_pool=kv_pool)
    ctx = BackendContext(
        device="cuda",
        dtype=DTYPE,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        page_size=PAGE,
        max_batch_size=len(reqs),
        max_context_len=max_len,
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
        validation=validation,
    )
    backend = create_backend("flashinfer", ctx)
    batch.attn_backend = backend
    layer = AttentionLayer(0, HQ, HKV, D)
    T = batch.num_tokens
    q = torch.randn(T, HQ * D, dtype=DTYPE, device="cuda")
    k = torch.randn(T, HKV, D, dtype=DTYPE, device="cuda")
    v = torch.randn(T, HKV, D, dtype=DTYPE, device="cuda")
    backend.init_forward_metadata(batch)
    layer(q, k, v, batch)  # first step: learns the layer's setting, stores the new K/V
    backend.init_forward_metadata(batch)  # from now on the setting is planned up front
    assert total == int(batch.seq_lens_cpu.sum())
    return ctx, backend, batch, layer, q, k, v


def gpu_time_us(fn, iters: int, reps: int) -> list[float]:
    """Per-call µs of `fn` run `iters` times back to back, `reps` samples."""
    return event_times_us(fn, reps, iters)


def host_time_us(fn, reps: int) -> list[float]:
    """Host wall µs of single calls of `fn`, each started with the GPU idle."""
    out = host_times_us(fn, reps, "cuda")
    torch.cuda.synchronize()
    return out


def interleaved(a, b, rounds: int, measure) -> tuple[float, float]:
    """Medians of `measure(a)` and `measure(b)`, alternated `rounds` times (drift hits both)."""
    samples = interleave({"a": lambda: measure(a), "b": lambda: measure(b)}, rounds)
    return statistics.median(samples["a"]), statistics.median(samples["b"])


def paged_inputs(batch, lens: torch.Tensor, lens_cpu: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """FlashInfer's paged inputs for the first `lens` keys of every request of `batch`, as the backend hands
    them to its plans (so FlashInfer's plan copies nothing back from the device): page offsets, last-page
    lengths and key counts on the host (int32, from the `*_cpu` lengths), the page ids on the device (built
    from the batch's request rows with attn-core's public index ops). Returns (indptr, indices, last, kv_lens)."""
    indptr = page_indptr_from_lens(lens_cpu, PAGE)
    indices = kv_indices_from_req_to_token(
        batch.req_to_token_pool.req_to_token,
        batch.req_pool_indices,
        page_indptr_from_lens(lens, PAGE),
        int(indptr[-1]),
        page_size=PAGE,
    )
    return indptr, indices, last_page_len_from_lens(lens_cpu, PAGE), lens_cpu.to(torch.int32)


def bench(name: str, mode: str, reqs, iters: int, rounds: int, validation: str = "basic") -> dict:
    from flashinfer import (
        BatchDecodeWithPagedKVCacheWrapper,
        BatchPrefillWithPagedKVCacheWrapper,
        BatchPrefillWithRaggedKVCacheWrapper,
    )
    from flashinfer.cascade import merge_state_in_place

    ctx, backend, batch, layer, q, k, v = setup(mode, reqs, validation)
    decode = batch.forward_mode.is_decode()
    k_buf, v_buf = batch.token_to_kv_pool.get_key_buffer(0), batch.token_to_kv_pool.get_value_buffer(0)
    pages = (k_buf.view(-1, PAGE, HKV, D), v_buf.view(-1, PAGE, HKV, D))
    q3 = q.view(-1, HQ, D)
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")

    # FlashInfer's own wrappers, planned as the backend plans (FA2 kernels, tensor-core decode), on the same pages
    common = dict(
        window_left=-1,
        logits_soft_cap=None,
        sm_scale=layer.scaling,
        q_data_type=DTYPE,
        kv_data_type=DTYPE,
        non_blocking=True,
    )
    if decode:
        indptr, indices, last, kv_lens = paged_inputs(batch, batch.seq_lens, batch.seq_lens_cpu)
        w = BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True, backend="fa2")

        def fi_plan():
            w.plan(indptr, indices, last, HQ, HKV, D, PAGE, seq_lens=kv_lens, **common)

        def fi_plan_with_pages():  # as an engine on FlashInfer alone: the step's page ids first
            ip, ids, lp, kl = paged_inputs(batch, batch.seq_lens, batch.seq_lens_cpu)
            w.plan(ip, ids, lp, HQ, HKV, D, PAGE, seq_lens=kl, **common)

        def direct():
            w.run(q3, pages)
    else:
        indptr, indices, last, kv_lens = paged_inputs(batch, batch.extend_prefix_lens, batch.extend_prefix_lens_cpu)
        qo = page_indptr_from_lens(batch.extend_seq_lens_cpu, 1)  # query offsets, host int32
        wr = BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa2")
        wp = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")

        def fi_plan():
            wr.plan(qo, qo, HQ, HKV, D, causal=True, **common)
            wp.plan(qo, indptr, indices, last, HQ, HKV, D, PAGE, causal=False, seq_lens=kv_lens, **common)

        def fi_plan_with_pages():  # as an engine on FlashInfer alone: the step's offsets and page ids first
            q_off = page_indptr_from_lens(batch.extend_seq_lens_cpu, 1)
            ip, ids, lp, kl = paged_inputs(batch, batch.extend_prefix_lens, batch.extend_prefix_lens_cpu)
            wr.plan(q_off, q_off, HQ, HKV, D, causal=True, **common)
            wp.plan(q_off, ip, ids, lp, HQ, HKV, D, PAGE, causal=False, seq_lens=kl, **common)

        def direct():
            o, s = wr.run(q3, k, v, return_lse=True)
            o2, s2 = wp.run(q3, pages, return_lse=True)
            merge_state_in_place(o, s, o2, s2)

    fi_plan()

    def ours():
        layer(q, k, v, batch, save_kv_cache=False)

    def ours_with_store():
        layer(q, k, v, batch)

    for fn in (ours, direct, ours_with_store):  # warm-up
        fn()
    torch.cuda.synchronize()
    t_ours, t_direct = interleaved(ours, direct, rounds, lambda f: gpu_time_us(f, iters, 3))
    t_store = statistics.median(gpu_time_us(ours_with_store, iters, 3))

    # host time of metadata: ours (index building, checks, plans) vs FlashInfer's own plan calls on prebuilt page
    # ids, and vs the same plan calls after building the step's page ids (what an engine without attn does per step)
    def ours_meta():
        backend.init_forward_metadata(batch)

    candidates = {"ours": ours_meta, "plan": fi_plan, "plan_with_pages": fi_plan_with_pages}
    for fn in candidates.values():
        fn()
    host = interleave({k: (lambda f=f: host_time_us(f, 1)) for k, f in candidates.items()}, 40 * rounds, rotate=True)
    h_ours, h_fi, h_fi_pages = (statistics.median(host[k]) for k in candidates)
    res = {
        "name": name,
        "forward_us": t_ours,
        "flashinfer_run_us": t_direct,
        "forward_over_run": t_ours / t_direct,
        "forward_with_kv_store_us": t_store,
        "metadata_host_us": h_ours,
        "flashinfer_plan_host_us": h_fi,
        "metadata_over_plan": h_ours / h_fi,
        "flashinfer_plan_with_page_ids_host_us": h_fi_pages,
        "metadata_over_plan_with_page_ids": h_ours / h_fi_pages,
    }
    if decode:  # CUDA-graph replay metadata: index launch into the graph's buffers + re-plan
        bs = batch.batch_size
        replay_args = (bs, batch.req_pool_indices, batch.seq_lens, batch.seq_lens_sum, None, batch.forward_mode, None)
        replay_args += (batch.seq_lens_cpu,)
        for key, graph_backend in (
            ("", backend),
            ("_public_plan", create_backend("flashinfer", ctx, lean_replan=False)),
        ):
            if graph_backend is not backend:  # one eager step first: its planner then knows the layer setting, as
                batch.attn_backend = graph_backend  # `backend`'s does, and its graph re-plans it on every replay
                graph_backend.init_forward_metadata(batch)
                layer(q, k, v, batch, save_kv_cache=False)
                batch.attn_backend = backend
            graph_backend.init_cuda_graph_state(bs, bs)
            graph_backend.init_forward_metadata_capture_cuda_graph(
                bs, bs, batch.req_pool_indices, batch.seq_lens, None, batch.forward_mode, None
            )

            def replay_meta(b=graph_backend):  # the SGLang-named entry point, the batch's own fields
                b.init_forward_metadata_replay_cuda_graph(*replay_args)

            replay_meta()
            res[f"graph_replay_metadata{key}_host_us"] = statistics.median(host_time_us(replay_meta, 20 * rounds))
    return res


SHAPES = {
    "decode bs64 ctx4096": ("DECODE", [(4095, 1)] * 64),
    "decode bs256 ctx1024": ("DECODE", [(1023, 1)] * 256),
    "extend bs8 q512 prefix3584": ("EXTEND", [(3584, 512)] * 8),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument(
        "--validation", choices=("basic", "full"), default="basic", help="the contexts' batch validation level"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("flashinfer_overhead.py needs a CUDA GPU (and flashinfer-python)")
    if hasattr(os, "sched_setaffinity"):  # one core: fewer migrations in the host timings
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    import flashinfer

    info = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "flashinfer": flashinfer.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "shape": f"GQA {HQ}/{HKV} heads, head_dim {D}, bf16, page size {PAGE}",
        "validation": args.validation,
    }
    print(json.dumps(info))
    results = [
        bench(name, mode, reqs, args.iters, args.rounds, args.validation) for name, (mode, reqs) in SHAPES.items()
    ]
    head = f"{'shape':30} {'forward µs':>11} {'FI run µs':>10} {'ratio':>6} {'+KV store':>10}"
    head += f" {'meta host µs':>13} {'FI plan µs':>11} {'ratio':>6} {'+page ids µs':>13} {'ratio':>6}"
    print(head)
    for r in results:
        print(
            f"{r['name']:30} {r['forward_us']:11.1f} {r['flashinfer_run_us']:10.1f} {r['forward_over_run']:6.3f} "
            f"{r['forward_with_kv_store_us']:10.1f} {r['metadata_host_us']:13.1f} {r['flashinfer_plan_host_us']:11.1f} "
            f"{r['metadata_over_plan']:6.3f} {r['flashinfer_plan_with_page_ids_host_us']:13.1f} "
            f"{r['metadata_over_plan_with_page_ids']:6.3f}"
        )
        if "graph_replay_metadata_host_us" in r:
            print(
                f"{'':30} graph replay metadata: {r['graph_replay_metadata_host_us']:.1f} µs host "
                f"({r['graph_replay_metadata_public_plan_host_us']:.1f} with lean_replan=False)"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
