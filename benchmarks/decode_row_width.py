"""attn-triton's decode kernel by the width of one KV head's row of a slot: does a 128-byte run per slot cost
bandwidth against a 256-byte one? (issue 16's fp8 row reads 128-byte runs: head_dim 128 at one byte.)

    python benchmarks/decode_row_width.py [--bs 64] [--ctx 4096] [--reps 5] [--json out.json]

Rows (bs requests of ctx keys, GQA 4 q heads a KV head, page size 16 in random page order, one split a request,
the default decode tile of each cache dtype from `attn_triton.config.decode_config`):
- bf16, 8 KV heads x 128: 256-byte runs (the decode rows of `triton_vs_peers.py`);
- bf16, 16 KV heads x 64: 128-byte runs, the same bytes;
- bf16, 8 KV heads x 64: 128-byte runs, half the bytes (the fp8 row's bytes);
- fp8 (e4m3), 8 KV heads x 128: the fp8 row itself.
Each: `decode_attention` launched 20 times in one CUDA graph, median of --reps replays (`triton_vs_peers.time_graph`);
TB/s counts the K and V bytes read. A CUDA GPU is required; the numbers are in docs/dev/perf-notebook.md ("fp8 KV cache decode").
"""

from __future__ import annotations

import argparse
import json

import torch
from triton_vs_peers import time_graph

from attn_core.ops.device_faults import DeviceFaultFlags
from attn_triton.config import decode_config
from attn_triton.kernels.decode import decode_attention

ROWS = [
    ("bf16", 8, 128, torch.bfloat16),
    ("bf16", 16, 64, torch.bfloat16),
    ("bf16", 8, 64, torch.bfloat16),
    ("fp8", 8, 128, torch.float8_e4m3fn),
]
GROUP = 4
PAGE = 16
LAUNCHES = 20


def time_row(bs: int, ctx: int, hkv: int, d: int, kv_dtype: torch.dtype, reps: int, gen: torch.Generator) -> dict:
    """Median µs of one decode launch over a paged pool of `hkv` heads x `d` channels, and its K/V bytes."""
    dev = torch.device("cuda")
    n_pages = bs * ctx // PAGE + 8
    perm = torch.randperm(n_pages, generator=gen)[: bs * ctx // PAGE].view(bs, -1)
    kv_indices = (perm[:, :, None] * PAGE + torch.arange(PAGE)).reshape(-1).to(torch.int32).to(dev)
    kv_indptr = torch.arange(bs + 1, dtype=torch.int32, device=dev) * ctx
    k = torch.randn(n_pages * PAGE, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    if kv_dtype != torch.bfloat16:
        k, v = (k * 0.1).to(kv_dtype), (v * 0.1).to(kv_dtype)
    q = torch.randn(bs, hkv * GROUP, d, device=dev, dtype=torch.bfloat16)
    o = torch.empty_like(q)
    part_o = torch.empty(bs, hkv * GROUP, 1, d, device=dev, dtype=torch.float32)
    part_lse = torch.empty(bs, hkv * GROUP, 1, device=dev, dtype=torch.float32)
    faults = DeviceFaultFlags(dev)
    cfg = decode_config(d, d, torch.bfloat16, dev, False, kv_dtype)

    def launch():
        decode_attention(q, k, v, o, kv_indptr, kv_indices, 1, ctx, part_o, part_lse, faults.buffer, sm_scale=d**-0.5, config=cfg)

    us = time_graph([launch], LAUNCHES, reps)
    refused = faults.poll()
    if refused:
        raise RuntimeError(f"the kernel refused part of its input: {refused}")
    nbytes = 2 * bs * ctx * hkv * d * k.element_size()
    return {"us": us, "bytes": nbytes, "tb_s": nbytes / us / 1e6, "tile": str(cfg)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_row_width.py needs a CUDA GPU")
    gen = torch.Generator().manual_seed(0)
    out = {"device": torch.cuda.get_device_name(), "bs": args.bs, "ctx": args.ctx, "rows": []}
    print("| cache | KV heads x head_dim | bytes a slot-head | µs | TB/s |\n|---|---|---:|---:|---:|")
    for name, hkv, d, kv_dtype in ROWS:
        r = time_row(args.bs, args.ctx, hkv, d, kv_dtype, args.reps, gen)
        run = d * torch.empty(0, dtype=kv_dtype).element_size()
        out["rows"].append({"cache": name, "kv_heads": hkv, "head_dim": d, "run_bytes": run, **r})
        print(f"| {name} | {hkv} x {d} | {run} | {r['us']:.1f} | {r['tb_s']:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
