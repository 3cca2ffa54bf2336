"""The cost of attn's K/V write (`MHATokenToKVPool.set_kv_buffer` → `attn_core.ops.kv_write.write_kv_rows`),
which stores a (token, head) whose value is not finite as K = NaN, V = 0 (issue 36's masked-values rule),
against the plain write it replaced: two scatters (`cache[slots] = rows` for K, then V) with no finiteness
test. On a GPU the write is one Triton launch (`attn_core.ops.kv_write_triton`).

Rows (8 KV heads, head_dim 128, bf16, page 16, slots in random order over a 1M-slot pool; "NHD" and "HND"):
  decode bs1 / bs64 / bs256 (1 new token each), extend 4096 / 32768 new tokens
Peers, one layer's write each:
  attn              `write_kv_rows(k_cache, v_cache, slots, k, v, ...)`: the write (checked slots)
  two scatters      `k_cache[slots] = k; v_cache[slots] = v` (NHD), the HND equivalent: the write before (no clean)
  torch clean       `clean_nonfinite` + the two scatters (what the write costs without the Triton launch)
  set_kv_buffer     `pool.set_kv_buffer(layer, checked_slots, k, v)`: the pool's whole call (its argument checks too)
Timed in CUDA graphs (GPU µs per write, `interleaved_graph_times_us`: the peers' graphs replayed in turn) and
on the host (µs a call issues, device idle before each sample, `host_times_us`). The claim: attn's times over
the two scatters', same run. Every peer's pool content is checked equal to attn's where the rows are finite.

  python benchmarks/kv_write.py [--rounds 20] [--layouts NHD,HND] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics

import torch

from attn_core.memory import MHATokenToKVPool
from attn_core.ops.kv_write import CheckedSlots, clean_nonfinite, scatter_rows, write_kv_rows

ROWS = [("decode bs1", 1), ("decode bs64", 64), ("decode bs256", 256), ("extend 4096", 4096), ("extend 32768", 32768)]
HEADS, DIM, PAGE, POOL = 8, 128, 16, 1 << 20


def peers(pool: MHATokenToKVPool, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    checked = CheckedSlots(slots, pool.num_slots)
    kc, vc = pool.get_key_buffer(0), pool.get_value_buffer(0)
    layout, ps = pool.kv_layout, pool.page_size

    def attn():
        write_kv_rows(kc, vc, slots, k, v, layout=layout, page_size=ps)

    def set_kv_buffer():
        pool.set_kv_buffer(0, checked, k, v)

    def two_scatters():
        scatter_rows(kc, slots, k, layout, ps)
        scatter_rows(vc, slots, v, layout, ps)

    def torch_clean():
        kq, vq = clean_nonfinite(k, v)
        scatter_rows(kc, slots, kq, layout, ps)
        scatter_rows(vc, slots, vq, layout, ps)

    return {"attn": attn, "two scatters": two_scatters, "torch clean": torch_clean, "set_kv_buffer": set_kv_buffer}


def main() -> None:
    from attn_core.bench.timing import host_times_us, interleaved_graph_times_us

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--layouts", default="NHD,HND")
    ap.add_argument("--json")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    results = []
    print(f"{'row':<16}{'layout':<6}{'peer':<14}{'GPU µs':>10}{'/ scatters':>12}{'host µs':>10}{'/ scatters':>12}")
    for layout in args.layouts.split(","):
        pool = MHATokenToKVPool(POOL, PAGE, torch.bfloat16, HEADS, DIM, 1, device=dev, kv_layout=layout)
        for name, tokens in ROWS:
            slots = (torch.randperm(POOL - PAGE, generator=gen)[:tokens] + PAGE).to(dev)
            k = torch.randn(tokens, HEADS, DIM, generator=gen).to(dev, torch.bfloat16)
            v = torch.randn(tokens, HEADS, DIM, generator=gen).to(dev, torch.bfloat16)
            fns = peers(pool, slots, k, v)
            contents = {}
            for peer, fn in fns.items():  # each writes the same finite rows: the same pool content
                fn()
                torch.cuda.synchronize()
                contents[peer] = (pool.get_key_buffer(0).clone(), pool.get_value_buffer(0).clone())
            ref = contents["attn"]
            for peer, (kb, vb) in contents.items():
                assert torch.equal(kb, ref[0]) and torch.equal(vb, ref[1]), (name, layout, peer)
            del contents, ref
            calls = 50 if tokens <= 256 else 5
            gpu = interleaved_graph_times_us({p: [f] for p, f in fns.items()}, calls, args.rounds)
            host = {p: host_times_us(f, args.rounds * 5, dev) for p, f in fns.items()}
            base_gpu, base_host = statistics.median(gpu["two scatters"]), statistics.median(host["two scatters"])
            for peer in fns:
                g, h = statistics.median(gpu[peer]), statistics.median(host[peer])
                print(f"{name:<16}{layout:<6}{peer:<14}{g:>10.2f}{g / base_gpu:>12.3f}{h:>10.2f}{h / base_host:>12.3f}")
                results.append({"row": name, "layout": layout, "peer": peer, "gpu_us": g, "host_us": h})
    if args.json:
        meta = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "host": platform.node(),
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
