"""Cascade attention against the plain path on one backend: many requests over one shared prefix.

Workload (defaults: the issue's): `--requests` 64 requests whose first `--prefix` 4096 cached tokens are
the same KV slots, each with `--suffix` 256 own tokens after it; GQA 32 q / 8 kv heads, head_dim 128,
bf16, page size 16. Rows:
  decode   each request's 256 own tokens cached, one new token (seq_len = prefix + suffix + 1)
  extend   each request brings its 256 own tokens as new tokens (seq_len = prefix + suffix)
Peers, same pool, same batch, same backend object kind: `plain` (cascade_prefix_len 0: each request
reads the whole prefix) and `cascade` (cascade_prefix_len = prefix: the prefix once for all queries +
per-request suffix + LSE merge). Metadata is built once per row outside the timed region; the timed
call is one layer's `forward(..., save_kv_cache=False)` after one call that wrote the step's own keys.
The two outputs are compared (relative error printed); `use_cascade_attention`'s answer for the row is
printed next to the measured ratio.

  python benchmarks/cascade_attention.py [--backend triton] [--requests 64] [--prefix 4096] [--suffix 256]
      [--rows decode,extend] [--budget 2.0] [--out cascade.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform

import torch

from attn_core.batching.cascade import use_cascade_attention
from attn_core.bench.timing import time_calls
from attn_core.discovery.registry import create_backend
from attn_core.testing.harness import AttnCase, layer_inputs, make_env, make_layer
from attn_core.testing.reference import relative_error


def run_row(args, mode: str) -> dict:
    new = 1 if mode == "DECODE" else args.suffix
    own = args.suffix if mode == "DECODE" else 0
    case = AttnCase(
        mode,
        [(args.prefix + own, new)] * args.requests,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        page_size=16,
        device=args.device,
        num_layers=1,
        cascade_prefix=args.prefix,
    )
    env = make_env(case)
    layer = make_layer(case, 0)
    x = layer_inputs(env, 0, torch.Generator().manual_seed(0))
    out, times = {}, {}
    for name, p in (("plain", 0), ("cascade", args.prefix)):
        batch = dataclasses.replace(env.batch, cascade_prefix_len=p)
        backend = create_backend(args.backend, env.ctx)
        batch.attn_backend = backend
        backend.init_forward_metadata(batch)

        def call(_i, backend=backend, batch=batch):
            return backend.forward(x["q"], None, None, layer, batch, save_kv_cache=False)

        # the step's own keys go into the pool once (the timed calls read them from there)
        out[name] = backend.forward(x["q"], x["k"], x["v"], layer, batch, save_kv_cache=True).float()
        times[name] = time_calls(call, torch.device(args.device), args.budget).median_us
    return {
        "row": mode.lower(),
        "plain_us": round(times["plain"], 1),
        "cascade_us": round(times["cascade"], 1),
        "speedup": round(times["plain"] / times["cascade"], 3),
        "rel_err_cascade_vs_plain": relative_error(out["cascade"].cpu(), out["plain"].cpu()),
        "use_cascade_attention": use_cascade_attention(args.prefix, env.batch),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="triton")
    p.add_argument("--device", default="cuda")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prefix", type=int, default=4096)
    p.add_argument("--suffix", type=int, default=256)
    p.add_argument("--rows", default="decode,extend")
    p.add_argument("--budget", type=float, default=2.0, help="seconds of timing per peer and row")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
        "torch": torch.__version__,
        "args": vars(args),
    }
    rows = [run_row(args, m.strip().upper()) for m in args.rows.split(",")]
    for r in rows:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
