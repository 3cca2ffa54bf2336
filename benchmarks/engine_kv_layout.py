"""attn-triton over an engine's KV cache (vLLM's layouts, `attn_core.EngineKVPool`) against the same kernels
over attn's own pool (`MHATokenToKVPool`), on the GPU.

Rows (GQA 32 q / 8 kv heads, head_dim 128, bf16, page size 16, pages in random order):
  decode bs64 ctx4096, decode bs1 ctx8192, extend bs8 q512 prefix3584
Peers (one layer each, the same K/V values, block tables, slots and q; metadata built once per row outside
the timed region; the timed call is `forward(q, k, v, layer, batch, save_kv_cache=False)`):
  own           attn's MHATokenToKVPool (NHD, dense)
  flash_attn    vLLM FlashAttention cache [2, blocks, 16, 8, 128]           -> NHD view, dense K
  vllm_lbnhc    vLLM 0.32 LBNHC, K|V side by side [blocks, 16, 8, 256]      -> NHD view, head stride 256
  vllm_lbhnc    vLLM 0.32 LBHNC (its CPU layout) [blocks, 8, 16, 256]      -> HND view (page-strided addressing)
  flashinfer    vLLM FlashInfer [blocks, 2, 16, 8, 128]                     -> HND view of token-major pages
Each output is checked against `own`'s (relative error printed). Calls are timed round-robin
(`attn_core.bench.timing.time_calls` per call, CUDA events), `--rounds` rounds; the claim is each layout's
median time over `own`'s in the same run (target: within 3 %). Extend rows are timed twice: with the
backend's defaults (on SM90 16-bit pools TMA can read take the Hopper kernel, K|V side by side included; page-strided
caches the portable one: `kernel` says which) and with the portable extend kernel for every peer (`same kernel`).

  python benchmarks/engine_kv_layout.py [--rows decode_bs64,decode_bs1,extend] [--rounds 5] [--budget 0.5]
      [--out engine_kv.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import statistics

import torch

import attn_core as ac
from attn_core.bench.timing import time_calls
from attn_core.testing.reference import relative_error
from attn_triton.config import extend_config
from attn_triton.kernels.extend import hopper_extend

HQ, HKV, D, PAGE = 32, 8, 128, 16
ROWS = {
    "decode_bs64": ("decode bs64 ctx4096", [(4095, 1)] * 64),
    "decode_bs1": ("decode bs1 ctx8192", [(8191, 1)]),
    "extend": ("extend bs8 q512 prefix3584", [(3584, 512)] * 8),
    "tiny": ("decode bs2 ctx40 (a smoke run, e.g. on the CPU under TRITON_INTERPRET=1)", [(39, 1)] * 2),
    "tiny_extend": ("extend bs2 q8 prefix24 (a smoke run of the extend path)", [(24, 8)] * 2),
}
LAYOUTS = ("own", "flash_attn", "vllm_lbnhc", "vllm_lbhnc", "flashinfer")


def make_pool(layout: str, pages: int, dtype, dev):
    """(pool, K writer): the cache of `layout` for one layer and a function writing K/V rows by slot."""
    if layout == "own":
        pool = ac.MHATokenToKVPool((pages - 1) * PAGE, PAGE, dtype, HKV, D, 1, dev)
    elif layout == "flash_attn":
        pool = ac.EngineKVPool.from_stacked([torch.empty(2, pages, PAGE, HKV, D, dtype=dtype, device=dev)], kv_dim=0)
    elif layout == "flashinfer":
        pool = ac.EngineKVPool.from_stacked([torch.empty(pages, 2, PAGE, HKV, D, dtype=dtype, device=dev)], kv_dim=1)
    elif layout == "vllm_lbnhc":
        raw = torch.empty(pages, PAGE, HKV, 2 * D, dtype=dtype, device=dev)
        pool = ac.EngineKVPool.from_fused([raw.permute(0, 2, 1, 3)], kv_order="HND")
    else:
        pool = ac.EngineKVPool.from_fused(
            [torch.empty(pages, HKV, PAGE, 2 * D, dtype=dtype, device=dev)], kv_order="HND"
        )
    return pool


def build_row(reqs, dtype, dev, seed=0):
    """The step's engine tensors (random scattered blocks), q, the new K/V and every cached K/V value."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(p + n for p, n in reqs)
    pages = sum(-(-(p + n) // PAGE) for p, n in reqs) + 2
    order = (torch.randperm(pages - 1, generator=gen) + 1).tolist()
    tables, slots, q_lens, seq = [], [], [], []
    for p, n in reqs:
        nb = -(-(p + n) // PAGE)
        blocks = [order.pop() for _ in range(nb)]
        tables.append(blocks)
        pos = torch.arange(p, p + n)
        slots.append(torch.tensor(blocks)[pos // PAGE] * PAGE + pos % PAGE)
        q_lens.append(n)
        seq.append(p + n)
    width = max(len(t) for t in tables)
    table = torch.zeros(len(reqs), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_t = torch.tensor(seq, dtype=torch.int32)
    # every key's value, by slot (the cache content every peer holds)
    all_slots = torch.cat(
        [torch.tensor(t)[torch.arange(s) // PAGE] * PAGE + torch.arange(s) % PAGE for t, s in zip(tables, seq)]
    )
    kv = torch.randn(2, all_slots.numel(), HKV, D, generator=gen).to(dtype).to(dev)
    T = int(qsl[-1])
    q = torch.randn(T, HQ, D, generator=gen).to(dtype).to(dev)
    engine = dict(
        query_start_loc=qsl.to(dev),
        seq_lens=seq_t.to(dev),
        block_table=table.to(dev),
        slot_mapping=torch.cat(slots).to(dev),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_t,
    )
    return engine, q, all_slots.to(dev), kv, pages, max(seq), tokens


def peer(layout, row, dtype, dev, portable_extend: bool):
    engine, q, all_slots, kv, pages, longest, _ = row
    pool = make_pool(layout, pages, dtype, dev)
    pool.set_kv_buffer(0, all_slots, kv[0], kv[1])
    steps = ac.EngineBatches(pool, max_requests=engine["seq_lens"].numel(), max_context_len=longest, device=dev)
    bs = engine["seq_lens"].numel()
    ctx = ac.BackendContext(
        device=dev,
        dtype=dtype,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        page_size=PAGE,
        max_batch_size=bs,
        max_context_len=steps.req_to_token_pool.max_context_len,
        req_to_token_pool=steps.req_to_token_pool,
        token_to_kv_pool=pool,
        forward_modes={"extend", "decode", "mixed"},
    )
    cfg = extend_config(D, D, dtype, dev, False)  # the backend's default for this context
    if portable_extend:
        cfg = dataclasses.replace(cfg, wgmma_block_n=0)
    backend = ac.create_backend("triton", ctx, extend_config=cfg)
    batch = steps.build(**engine, attn_backend=backend, check_indices=False)
    backend.init_forward_metadata(batch)
    layer = ac.AttentionLayer(0, HQ, HKV, D)
    k_buf, v_buf = pool.get_key_buffer(0), pool.get_value_buffer(0)
    hopper = hopper_extend(cfg, dtype, k_buf, v_buf, D, D, True)
    kernel = "decode" if batch.forward_mode.is_decode() else ("extend (Hopper)" if hopper else "extend (portable)")
    T = q.shape[0]
    k = torch.zeros(T, HKV, D, dtype=dtype, device=dev)

    def call(_i=0):
        return backend.forward(q, k, k, layer, batch, save_kv_cache=False)

    return call, kernel, pool.describe() if layout != "own" else "MHATokenToKVPool NHD dense"


def run_row(name, args, dtype, dev, portable_extend=False) -> dict:
    label, reqs = ROWS[name]
    row = build_row(reqs, dtype, dev)
    peers = {lay: peer(lay, row, dtype, dev, portable_extend) for lay in LAYOUTS}
    ref = peers["own"][0]().float()
    errors = {lay: relative_error(peers[lay][0]().float(), ref) for lay in LAYOUTS}
    times = {lay: [] for lay in LAYOUTS}
    for _ in range(args.rounds):
        for lay in LAYOUTS:
            times[lay].append(time_calls(peers[lay][0], dev, args.budget).median_us)
    med = {lay: statistics.median(t) for lay, t in times.items()}
    out = {
        "row": label + (" (same portable extend kernel)" if portable_extend else ""),
        "peers": {
            lay: {
                "median_us": round(med[lay], 2),
                "vs_own": round(med[lay] / med["own"], 4),
                "rel_err_vs_own": errors[lay],
                "kernel": peers[lay][1],
                "pool": peers[lay][2],
            }
            for lay in LAYOUTS
        },
    }
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.5, help="seconds per timed peer per round")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--device", default="cuda", help="cuda; cpu only for a smoke run under TRITON_INTERPRET=1 (float32)"
    )
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("engine_kv_layout.py needs a CUDA GPU (or --device cpu --rows tiny under TRITON_INTERPRET=1)")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    results = []
    for name in args.rows.split(","):
        results.append(run_row(name, args, dtype, dev))
        if name in ("extend", "tiny_extend"):
            results.append(run_row(name, args, dtype, dev, portable_extend=True))
    report = {
        "benchmark": "engine_kv_layout",
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "host": platform.node(),
        "rows": results,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
