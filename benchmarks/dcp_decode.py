"""Decode context parallelism: one DECODE attention step (one layer) with the KV split over the ranks,
against one rank holding all of it, and the collectives' share of the DCP step.

Run under torchrun, one process per GPU (NCCL; gloo with --device cpu for a smoke run):

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/dcp_decode.py --device cuda --backend triton \\
        --bs 64 --ctx 32768 --dtype bfloat16 --json out.json

Rows (medians over --reps steps, CUDA-synchronized host time):
- `single`: rank 0 alone, all q heads over each request's whole KV (`ctx` tokens), the backend's decode.
- `dcp_<exchange>`: every rank, `dcp_decode_attention` with q heads sharded over the ranks (each rank
  owns Hq/world heads, as under TP): q all-gather + local attention over the rank's shard + exchange
  + merge; exchange "all_gather" or "all_to_all".
- `dcp_<exchange>_graph`: the same step graph-shaped (`build_dcp_step(..., graph_shaped=True)`) through
  `attn_core.CudaGraphRunner` captured for --bs: `runner.run` (static-buffer copies, the backend's replay
  metadata, the replay with the new K/V write, q gather, attention, exchange and merge inside the graph;
  on a CPU the runner runs the layers eagerly instead).
- `collective_<exchange>`: the q all-gather plus that exchange alone on tensors of the step's shapes.
- KV tokens per rank for the batch (single: bs * ctx; DCP: each rank's local tokens) and bytes.

Shapes: GQA --q-heads / --kv-heads of head_dim 128, page size (= interleave) --page-size.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

import attn_core as ac
from attn_core.bench.timing import time_host
from attn_core.dcp import DCP_GRAPH_INPUTS, DcpLayout, DcpRequestPool, DcpStep, build_dcp_step, dcp_decode_attention


def timed(fn, reps: int, device: torch.device) -> float:
    """Median seconds of fn() over reps calls after 3 warm-up calls, each call timed from a synchronized
    device to its work done (`attn_core.bench.timing.time_host`, which makes the third warm-up call)."""
    fn()
    fn()
    return time_host(fn, device, reps).median_us * 1e-6


def setup(args, device, tokens_per_request: int):
    """A KV pool, request pool and backend for `args.bs` requests of up to tokens_per_request local tokens."""
    dtype, ps = getattr(torch, args.dtype), args.page_size
    slots = args.bs * (-(-tokens_per_request // ps) + 1) * ps
    kv = ac.MHATokenToKVPool(
        size=slots, page_size=ps, dtype=dtype, head_num=args.kv_heads, head_dim=128, layer_num=1, device=device
    )
    rows = ac.ReqToTokenPool(size=args.bs, max_context_len=args.ctx + 1, device=device)
    requests = ac.RequestPool(rows, ac.PagedTokenAllocator(slots, ps), kv)
    ctx = ac.BackendContext(
        device=device,
        dtype=dtype,
        num_q_heads=args.q_heads,
        num_kv_heads=args.kv_heads,
        head_dim=128,
        page_size=ps,
        max_batch_size=args.bs,
        max_context_len=args.ctx + 1,
        req_to_token_pool=rows,
        token_to_kv_pool=kv,
        forward_modes={"extend", "decode"},
        features={ac.Feature.LSE_OUTPUT},
    )
    return kv, requests, ac.create_backend(args.backend, ctx)


def fill(save, layer, n: int, args, device, g) -> None:
    k = torch.randn(n, args.kv_heads, 128, generator=g, device=device).to(getattr(torch, args.dtype))
    save(layer, k, k.clone())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=32768, help="cached tokens per request before the decode step")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    g = torch.Generator(device=device).manual_seed(rank)
    layer = ac.AttentionLayer(0, args.q_heads, args.kv_heads, 128)
    dtype = getattr(torch, args.dtype)
    rows: dict[str, float] = {}

    if rank == 0:  # one rank with all the KV
        kv, requests, backend = setup(args, device, args.ctx + 1)
        reqs = [requests.add() for _ in range(args.bs)]
        for r in reqs:
            b = ac.build_step(requests, [(r, args.ctx)])
            kv.set_kv_buffer(
                layer,
                b.out_cache_loc,
                *(torch.randn(args.ctx, args.kv_heads, 128, generator=g, device=device).to(dtype) for _ in range(2)),
            )
        step = ac.build_step(requests, [(r, 1) for r in reqs], attn_backend=backend)
        backend.init_forward_metadata(step)
        q = torch.randn(args.bs, args.q_heads, 128, generator=g, device=device).to(dtype)
        rows["single_s"] = timed(lambda: layer(q, None, None, step, save_kv_cache=False), args.reps, device)
        rows["single_kv_tokens"] = args.bs * (args.ctx + 1)
        del kv, requests, backend, step
    dist.barrier()

    layout = DcpLayout(world, args.page_size)
    local = int(layout.local_lens(torch.tensor(args.ctx + 1), 0))
    kv, requests, backend = setup(args, device, local)
    pool = DcpRequestPool(requests, layout, rank)
    reqs = [pool.add() for _ in range(args.bs)]
    for r in reqs:
        s = build_dcp_step(pool, [(r, args.ctx)])
        fill(lambda lay, k, v, s=s: s.save_kv(lay, k, v), layer, args.ctx, args, device, g)
    step = build_dcp_step(pool, [(r, 1) for r in reqs], attn_backend=backend)
    fill(step.save_kv, layer, args.bs, args, device, g)
    step.init_forward_metadata()
    h_rank = args.q_heads // world
    q = torch.randn(args.bs, h_rank, 128, generator=g, device=device).to(dtype)
    gathered = q.new_empty((world * args.bs, h_rank, 128))
    part = torch.zeros((args.bs, args.q_heads, 129), dtype=torch.float32, device=device)  # partial output | LSE
    parts = part.new_empty((world * args.bs, args.q_heads, 129))
    send = part.view(args.bs, world, h_rank, 129).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    collectives = {
        "all_gather": lambda: (gather(gathered, q), gather(parts, part)),
        "all_to_all": lambda: (gather(gathered, q), dist.all_to_all_single(recv, send)),
    }
    for exchange, coll in collectives.items():
        rows[f"dcp_{exchange}_s"] = timed(
            lambda ex=exchange: dcp_decode_attention(q, layer, step, exchange=ex), args.reps, device
        )
        rows[f"collective_{exchange}_s"] = timed(coll, args.reps, device)
    # graph-shaped: the next decode step (one more token per request) through a runner per exchange
    graph_step = build_dcp_step(pool, [(r, 1) for r in reqs], attn_backend=backend, graph_shaped=True)
    new_kv = torch.randn(args.bs, args.kv_heads, 128, generator=g, device=device).to(dtype)
    shapes = {
        "q": ((h_rank, 128), dtype),
        "k": ((args.kv_heads, 128), dtype),
        "v": ((args.kv_heads, 128), dtype),
        **DCP_GRAPH_INPUTS,
    }
    inputs = {"q": q, "k": new_kv, "v": new_kv, **graph_step.graph_inputs()}
    for exchange in collectives:

        def run_layers(batch, x, ex=exchange):
            s = DcpStep.from_graph_batch(batch, x)
            s.save_kv(layer, x["k"], x["v"])
            return dcp_decode_attention(x["q"], layer, s, exchange=ex)

        runner = ac.CudaGraphRunner(backend, [args.bs], run_layers, shapes)  # every rank captures here
        rows[f"dcp_{exchange}_graph_s"] = timed(
            lambda r=runner: r.run(graph_step.local_batch, inputs), args.reps, device
        )
        del runner
    rows["dcp_kv_tokens_per_rank"] = sum(r.kv_len for r in reqs)
    bytes_per_token = 2 * args.kv_heads * 128 * dtype.itemsize
    result = [None] * world
    dist.all_gather_object(result, rows)
    if rank == 0:
        out = dict(
            command=vars(args),
            world=world,
            device=torch.cuda.get_device_name(device) if cuda else "cpu",
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            kv_bytes_per_token=bytes_per_token,
            ranks=result,
        )
        single = result[0]["single_s"]
        for exchange in ("all_gather", "all_to_all"):
            slow = max(r[f"dcp_{exchange}_s"] for r in result)
            share = max(r[f"collective_{exchange}_s"] for r in result) / slow
            graph = max(r[f"dcp_{exchange}_graph_s"] for r in result)
            print(
                f"DCP={world} {exchange}: {slow * 1e6:.0f} us vs single {single * 1e6:.0f} us ({single / slow:.2f}x); "
                f"collectives {100 * share:.0f}% of the step; graph-shaped through the graph runner "
                f"{graph * 1e6:.0f} us ({single / graph:.2f}x)"
            )
        print(
            f"KV tokens per rank: single {result[0]['single_kv_tokens']}, "
            f"DCP {[r['dcp_kv_tokens_per_rank'] for r in result]} ({bytes_per_token} bytes each)"
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
