"""What attn-flashinfer adds on top of FlashInfer itself, measured side by side on one GPU.

Two numbers per shape (GQA 32 q / 8 kv heads, head_dim 128, bf16, page size 16):
- per-layer `forward` time (CUDA events over back-to-back calls) against calling FlashInfer's own
  wrappers directly on the very plans the backend made (decode: the decode wrapper's run; extend with a
  prefix: ragged run + paged run + FlashInfer's merge_state_in_place). Our forward runs with
  save_kv_cache=False, as FlashInfer's run stores nothing; the time with the K/V store is reported too.
- host time of one step's `init_forward_metadata` (index building + plans; from the second step on the
  backend re-plans its wrappers lean, see attn_flashinfer/replan.py) against FlashInfer's own plan calls
  on the same, prebuilt, inputs; for decode also the CUDA-graph replay metadata (index launch into the
  graph's buffers + lean re-plan, and with lean_replan=False FlashInfer's own plan).

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
from flashinfer import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper
from flashinfer.cascade import merge_state_in_place

from attn_core.batch_builder import build_forward_batch
from attn_core.context import BackendContext
from attn_core.layer import AttentionLayer
from attn_core.memory import MHATokenToKVPool, PagedTokenAllocator, ReqToTokenPool
from attn_flashinfer.backend import FlashInferBackend
from attn_flashinfer.steps import LayerKey

HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16


def setup(mode: str, reqs: list[tuple[int, int]], validation: str = "basic"):
    total = sum(p + e for p, e in reqs)
    size = PAGE * (sum(-(-(p + e) // PAGE) for p, e in reqs) + 2)
    max_len = max(p + e for p, e in reqs) + PAGE
    kv_pool = MHATokenToKVPool(size, PAGE, DTYPE, HKV, D, 1, "cuda")
    kv_pool.k_buffer[0].normal_()
    kv_pool.v_buffer[0].normal_()
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
    backend = FlashInferBackend(ctx)
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
    return backend, batch, layer, q, k, v


def gpu_time_us(fn, iters: int, reps: int) -> list[float]:
    """Per-call µs of `fn` run `iters` times back to back, `reps` samples."""
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) * 1000.0 / iters)
    return out


def host_time_us(fn, reps: int) -> list[float]:
    """Host wall µs of single calls of `fn`, each started with the GPU idle."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return out


def interleaved(a, b, rounds: int, measure) -> tuple[float, float]:
    """Medians of `measure(a)` and `measure(b)`, alternated `rounds` times (drift hits both)."""
    sa, sb = [], []
    for _ in range(rounds):
        sa += measure(a)
        sb += measure(b)
    return statistics.median(sa), statistics.median(sb)


def bench(name: str, mode: str, reqs, iters: int, rounds: int, validation: str = "basic") -> dict:
    backend, batch, layer, q, k, v = setup(mode, reqs, validation)
    step = backend.forward_metadata
    key = LayerKey.of(layer)
    plan = step.plans[key]
    k_buf, v_buf = batch.token_to_kv_pool.get_key_buffer(0), batch.token_to_kv_pool.get_value_buffer(0)
    pages = (k_buf.view(-1, PAGE, HKV, D), v_buf.view(-1, PAGE, HKV, D))
    q3 = q.view(-1, HQ, D)

    def ours():
        layer(q, k, v, batch, save_kv_cache=False)

    def ours_with_store():
        layer(q, k, v, batch)

    if plan.decode is not None:

        def direct():
            plan.decode.run(q3, pages)
    else:

        def direct():
            o, s = plan.ragged.run(q3, k, v, return_lse=True)
            o2, s2 = plan.paged.run(q3, pages, return_lse=True)
            merge_state_in_place(o, s, o2, s2)

    for fn in (ours, direct, ours_with_store):  # warm-up
        fn()
    torch.cuda.synchronize()
    t_ours, t_direct = interleaved(ours, direct, rounds, lambda f: gpu_time_us(f, iters, 3))
    t_store = statistics.median(gpu_time_us(ours_with_store, iters, 3))

    # host time of metadata: ours (index building + plans) vs FlashInfer's own plan calls, same inputs
    common = dict(window_left=-1, logits_soft_cap=None, sm_scale=layer.scaling, q_data_type=DTYPE, kv_data_type=DTYPE, non_blocking=True)
    if plan.decode is not None:
        kv = step.kv["seq"]
        w = BatchDecodeWithPagedKVCacheWrapper(backend.planner.workspace, "NHD", use_tensor_cores=True, backend="fa2")

        def fi_plan():
            w.plan(kv.indptr, kv.indices, kv.last_page_len, HQ, HKV, D, PAGE, seq_lens=kv.kv_lens, **common)
    else:
        kv, qo = step.kv["prefix"], step.qo.indptr
        wr = BatchPrefillWithRaggedKVCacheWrapper(backend.planner.workspace, "NHD", backend="fa2")
        wp = BatchPrefillWithPagedKVCacheWrapper(backend.planner.workspace, "NHD", backend="fa2")

        def fi_plan():
            wr.plan(qo, qo, HQ, HKV, D, causal=True, **common)
            wp.plan(qo, kv.indptr, kv.indices, kv.last_page_len, HQ, HKV, D, PAGE, causal=False, seq_lens=kv.kv_lens, **common)

    def ours_meta():
        backend.init_forward_metadata(batch)

    for fn in (ours_meta, fi_plan):
        fn()
    h_ours, h_fi = interleaved(ours_meta, fi_plan, 40 * rounds, lambda f: host_time_us(f, 1))  # alternate call by call
    res = {
        "name": name,
        "forward_us": t_ours,
        "flashinfer_run_us": t_direct,
        "forward_over_run": t_ours / t_direct,
        "forward_with_kv_store_us": t_store,
        "metadata_host_us": h_ours,
        "flashinfer_plan_host_us": h_fi,
        "metadata_over_plan": h_ours / h_fi,
    }
    if plan.decode is not None:  # CUDA-graph replay metadata: index launch into the graph's buffers + re-plan
        bs = batch.batch_size
        backend.init_cuda_graph_state(bs, bs)
        args = (batch.req_pool_indices, batch.seq_lens, None, batch.forward_mode, None)
        backend.init_forward_metadata_capture_cuda_graph(bs, bs, *args)

        def replay_meta():
            backend.init_forward_metadata_replay_cuda_graph(
                bs, batch.req_pool_indices, batch.seq_lens, batch.seq_lens_sum, None, batch.forward_mode, None, batch.seq_lens_cpu
            )

        replay_meta()
        res["graph_replay_metadata_host_us"] = statistics.median(host_time_us(replay_meta, 20 * rounds))
        backend.planner.lean_replan = False
        res["graph_replay_metadata_public_plan_host_us"] = statistics.median(host_time_us(replay_meta, 20 * rounds))
        backend.planner.lean_replan = True
    backend.init_forward_metadata(batch)
    res["breakdown_host_us"] = breakdown(backend, batch, backend.forward_metadata, backend.forward_metadata.plans[key], fi_plan)
    return res


def breakdown(backend, batch, step, plan, fi_plan) -> dict:
    """Host µs of each piece of one step's metadata (GPU idle before each call), to see where it goes."""
    from attn_core.ops import kv_indices as kvi
    from attn_flashinfer import replan
    from attn_flashinfer.indices import build_paged_kv, query_layout

    which = "seq" if plan.decode is not None else "prefix"
    kv, qo, key, dims = step.kv[which], step.qo, next(iter(step.plans)), backend.planner.dims
    lens_dev = batch.seq_lens if which == "seq" else batch.extend_prefix_lens
    lens_cpu = batch.seq_lens_cpu if which == "seq" else batch.extend_prefix_lens_cpu
    r2t, rpi, total, bs = batch.req_to_token_pool.req_to_token, batch.req_pool_indices, kv.num_pages, batch.batch_size
    scratch, indptr, last, qo_dev = (torch.empty(n, dtype=torch.int32, device="cuda") for n in (total, bs + 1, bs, bs + 1))

    def torch_ids():
        indptr = kvi.page_indptr_from_lens(lens_dev, PAGE)
        return kvi.kv_indices_from_req_to_token(r2t, rpi, indptr, total, page_size=PAGE)

    def public_plans():
        backend.planner.lean_replan = False
        backend.init_forward_metadata(batch)
        backend.planner.lean_replan = True

    def lean():
        if plan.decode is not None:
            replan.decode(plan.decode, qo, kv, key, dims)
        else:
            replan.ragged(plan.ragged, qo, key, dims)
            replan.paged(plan.paged, qo, kv, key, dims, causal=False)

    def layout():  # host side only: the device writes are deferred to the launch below
        return build_paged_kv(r2t, rpi, lens_dev, lens_cpu, PAGE, out=lambda b, n: (scratch, indptr, last), defer=True)

    def ids():
        q = dict(q_lens=batch.extend_seq_lens, qo_indptr_out=qo_dev) if plan.decode is None else {}
        return kvi.build_kv_indices(r2t, rpi, lens_dev, total, page_size=PAGE, out=scratch, indptr_out=indptr, last_page_len_out=last, **q)

    def torch_layout():
        return kvi.page_indptr_from_lens(lens_cpu, PAGE), kvi.last_page_len_from_lens(lens_cpu, PAGE)

    pieces = {
        "host layout (used)": layout,
        "host layout, torch ops (attn_core)": torch_layout,
        "device ids + indptr + last page (+ qo), one Triton launch (used)": ids,
        "device page ids, torch ops": torch_ids,
        "lean re-plan(s) (used)": lean,
        "FlashInfer plan call(s) alone": fi_plan,
        "init_forward_metadata (all)": lambda: backend.init_forward_metadata(batch),
        "init_forward_metadata, lean_replan=False": public_plans,
    }
    if plan.decode is None:
        pieces["query layout, host (used)"] = lambda: query_layout(batch.extend_seq_lens_cpu, qo_dev, batch.extend_seq_lens)
    for fn in pieces.values():
        fn()
    return {name: statistics.median(host_time_us(fn, 100)) for name, fn in pieces.items()}


SHAPES = {
    "decode bs64 ctx4096": ("DECODE", [(4095, 1)] * 64),
    "decode bs256 ctx1024": ("DECODE", [(1023, 1)] * 256),
    "extend bs8 q512 prefix3584": ("EXTEND", [(3584, 512)] * 8),
}


def main() -> None:
    if hasattr(os, "sched_setaffinity"):  # one core: fewer migrations in the host timings
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--validation", choices=("basic", "full"), default="basic", help="the contexts' batch validation level")
    args = ap.parse_args()
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
    results = [bench(name, mode, reqs, args.iters, args.rounds, args.validation) for name, (mode, reqs) in SHAPES.items()]
    head = f"{'shape':30} {'forward µs':>11} {'FI run µs':>10} {'ratio':>6} {'+KV store':>10}"
    head += f" {'meta host µs':>13} {'FI plan µs':>11} {'ratio':>6}"
    print(head)
    for r in results:
        print(
            f"{r['name']:30} {r['forward_us']:11.1f} {r['flashinfer_run_us']:10.1f} {r['forward_over_run']:6.3f} "
            f"{r['forward_with_kv_store_us']:10.1f} {r['metadata_host_us']:13.1f} {r['flashinfer_plan_host_us']:11.1f} "
            f"{r['metadata_over_plan']:6.3f}"
        )
        if "graph_replay_metadata_host_us" in r:
            print(
                f"{'':30} graph replay metadata: {r['graph_replay_metadata_host_us']:.1f} µs host "
                f"({r['graph_replay_metadata_public_plan_host_us']:.1f} with lean_replan=False)"
            )
        for piece, us in r["breakdown_host_us"].items():
            print(f"{'':30} {piece:58} {us:8.1f} µs host")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
