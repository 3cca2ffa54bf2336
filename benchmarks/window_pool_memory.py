"""KV memory of sliding-window layers: a `SlidingWindowKVPool` against keeping them in the full pool.

Drives attn-core's real `SlidingWindowAllocator` (host bookkeeping only, no K/V buffers are allocated,
so it runs anywhere in seconds) through an engine-like schedule: `--requests` requests each prefill
`--prefill` tokens in chunks of `--chunk`, then decode `--decode` tokens one step at a time; after every
step the engine releases what slid out of the window (`release_out_of_window`). It records the peak
number of window slots in use and the full slots in use at the end, and converts them to bytes with the
per-token, per-layer K+V size `kv_heads * (head_dim + v_head_dim) * dtype bytes`.

Reported (the claim is the ratio):
  full pool     bytes per context token per layer when a window layer keeps every token (= the slot size)
  window pool   peak window-pool bytes of one window layer / context tokens held (the peak comes from
                the prefill chunks: window + chunk per request), and the same at the end (decode steady state)
  saving        1 - window / full, and the model-level KV saving for `--window-layer-fraction` of layers

  python benchmarks/window_pool_memory.py [--requests 64] [--prefill 8192] [--decode 256] [--window 1024]
      [--page-size 16] [--kv-heads 8] [--head-dim 128] [--dtype-bytes 2] [--window-layer-fraction 0.8333]
      [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform

from attn_core.memory import SlidingWindowAllocator


def simulate(args) -> dict:
    """Run the schedule of the module docstring on a `SlidingWindowAllocator` and return its numbers
    (slot counts in slots, sizes in bytes per context token per layer, savings as fractions).
    `args`: the parsed command line (`v_head_dim` already defaulted to `head_dim`).

    Worked example: 2 requests, prefill 8 in chunks of 4, decode 2, window 4, page size 2, 1 KV head of
    head_dim 4 (v 4), 2-byte dtype, window-layer fraction 0.5 → 20 context tokens, slot size 16 bytes,
    peak 16 window slots (12.8 bytes/token), 8 at the end (6.4 bytes/token), window_layer_saving 0.2,
    model_kv_saving 0.1.
    """
    ps, w = args.page_size, args.window
    per_req = args.prefill + args.decode
    full_size = -(-per_req // ps) * ps * args.requests + ps
    # the window pool is sized for the worst case of one step: window + chunk + 2 partial pages per request
    window_size = (-(-(w + args.chunk) // ps) + 2) * ps * args.requests
    alloc = SlidingWindowAllocator(full_size, window_size, w, ps)
    rows: list[list[int]] = [[] for _ in range(args.requests)]
    released = [0] * args.requests  # positions already released (the engine passes only the new part)
    peak = 0

    def step(lengths: list[int]) -> None:
        nonlocal peak
        for r, n in enumerate(lengths):
            slots = rows[r]
            new = alloc.alloc_extend([len(slots)], [len(slots) + n], [slots[-1] if slots else 0])
            if new is None:
                raise SystemExit(f"window pool of {window_size} slots ran out: the sizing rule is wrong")
            slots.extend(new.tolist())
        peak = max(peak, window_size - alloc.window_available_size())
        for r, slots in enumerate(rows):
            dead = max(len(slots) - w + 1, 0)
            alloc.release_out_of_window(slots[released[r] : dead], len(slots), first_pos=released[r])
            released[r] = max(released[r], dead)

    done = 0
    while done < args.prefill:
        n = min(args.chunk, args.prefill - done)
        step([n] * args.requests)
        done += n
    for _ in range(args.decode):
        step([1] * args.requests)
    tokens = sum(len(s) for s in rows)
    end = window_size - alloc.window_available_size()
    slot_bytes = args.kv_heads * (args.head_dim + args.v_head_dim) * args.dtype_bytes
    full_bpt = slot_bytes  # a full-pool layer holds one slot per context token
    window_bpt = peak * slot_bytes / tokens
    frac = args.window_layer_fraction
    return {
        "context_tokens": tokens,
        "window_slots_peak": peak,
        "window_pool_provisioned_slots": window_size,
        "slot_bytes_per_layer": slot_bytes,
        "full_pool_bytes_per_token_per_layer": full_bpt,
        "window_pool_bytes_per_token_per_layer": round(window_bpt, 2),
        "window_slots_at_end": end,
        "window_pool_bytes_per_token_per_layer_decode_steady": round(end * slot_bytes / tokens, 2),
        "window_layer_saving": round(1 - window_bpt / full_bpt, 4),
        "model_kv_saving": round(frac * (1 - window_bpt / full_bpt), 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prefill", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens per request per step)")
    p.add_argument("--decode", type=int, default=256)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--v-head-dim", type=int, default=None)
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument(
        "--window-layer-fraction", type=float, default=5 / 6, help="share of layers with a window (5 of 6: Gemma-3)"
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.v_head_dim = args.v_head_dim or args.head_dim
    result = simulate(args)
    meta = {"date": datetime.date.today().isoformat(), "host": platform.node(), "args": vars(args)}
    for k, v in result.items():
        print(f"{k:40s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, **result}, f, indent=2)


if __name__ == "__main__":
    main()
