"""attn-cpu-amx against torch_native and "gather the pages, then torch SDPA" on CPU (all cores).

Rows (GQA 32 q / 8 kv heads, head_dim 128, page size 16 with pages in random order, bf16 and fp32):
  decode bs16 x ctx2048       16 requests, 2047 cached tokens + 1 new
  extend bs4 q512 prefix1536  4 requests, 1536 cached tokens + 512 new (causal)

Peers, all reading the same pool and batch:
  cpu_amx         the attn-cpu-amx backend (`create_backend("cpu_amx", ...)`), path chosen from the CPU
  torch_native    attn-core's reference backend
  gather+sdpa     per step: gather every request's K/V pages into dense [bs, Hkv, L, D] tensors
                  (index_select), then one `scaled_dot_product_attention(..., enable_gqa=True)` call
                  (extend: a bool bottom-right causal mask, as the new tokens follow a prefix)
Metadata (`init_forward_metadata`) is built once per row outside the timed region; the timed call is
one layer's `forward(..., save_kv_cache=False)` (the step's K/V are already in the pool). Each peer's
output is checked against torch_native (relative error printed). Calls are interleaved round-robin and
the median is reported.

  python benchmarks/cpu_vs_peers.py [--out cpu_vs_peers.json] [--threads N] [--dtypes bfloat16,float32]
      [--rows decode,extend] [--reps 7] [--isa auto|amx|avx512|portable]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
from typing import Callable

import torch
import torch.nn.functional as F

from attn_core import (
    AttentionLayer,
    BackendContext,
    MHATokenToKVPool,
    PagedTokenAllocator,
    ReqToTokenPool,
    create_backend,
)
from attn_core.bench.timing import host_times_us, interleave
from attn_core.testing.batch_builder import build_forward_batch
from attn_core.testing.reference import relative_error

HQ, HKV, D, PAGE = 32, 8, 128, 16
ROWS = {
    "decode": ("decode bs16 ctx2048", "DECODE", [(2047, 1)] * 16),
    "extend": ("extend bs4 q512 prefix1536", "EXTEND", [(1536, 512)] * 4),
}


class Row:
    """Pool with random K/V (pages of every request in random order), the batch, q and a layer."""

    def __init__(self, mode: str, requests: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        total = sum(p + e for p, e in requests)
        pages = -(-total // PAGE) + len(requests) + 1
        self.kv_pool = MHATokenToKVPool(pages * PAGE, PAGE, dtype, HKV, D, 1)
        self.req_pool = ReqToTokenPool(len(requests), max(p + e for p, e in requests) + PAGE)
        allocator = PagedTokenAllocator(pages * PAGE, PAGE)
        self.batch = build_forward_batch(
            mode, requests, req_to_token_pool=self.req_pool, allocator=allocator, token_to_kv_pool=self.kv_pool
        )
        # scatter pages: page p -> perm[p] (page 0, the reserved dummy, stays)
        perm = torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(pages, generator=gen)])
        r2t = self.req_pool.req_to_token
        r2t.copy_((perm[r2t.long() // PAGE] * PAGE + r2t.long() % PAGE).to(torch.int32))
        loc = self.batch.out_cache_loc
        self.batch.out_cache_loc = perm[loc // PAGE] * PAGE + loc % PAGE
        for buf in (self.kv_pool.get_key_buffer(0), self.kv_pool.get_value_buffer(0)):
            buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
        T = self.batch.num_tokens
        self.q = torch.randn(T, HQ, D, generator=gen).to(dtype)
        self.layer = AttentionLayer(0, HQ, HKV, D)
        self.ctx = BackendContext(
            device="cpu",
            dtype=dtype,
            num_q_heads=HQ,
            num_kv_heads=HKV,
            head_dim=D,
            page_size=PAGE,
            max_batch_size=len(requests),
            max_context_len=self.req_pool.max_context_len,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool,
        )

    def backend_call(self, backend) -> Callable[[], torch.Tensor]:
        """Metadata once (kept by the backend object), then one layer's forward per call."""
        backend.init_forward_metadata(self.batch)
        return lambda: backend.forward(self.q, None, None, self.layer, self.batch, save_kv_cache=False)

    def gather_sdpa_call(self) -> Callable[[], torch.Tensor]:
        b = self.batch
        bs = b.batch_size
        seq = int(b.seq_lens_cpu[0])
        qlen = b.num_tokens // bs
        if not (bool((b.seq_lens_cpu == seq).all()) and qlen * bs == b.num_tokens):
            raise ValueError("gather+sdpa baseline: uniform batches only")
        slots = self.req_pool.req_to_token[b.req_pool_indices, :seq].reshape(-1).long()  # per step, host
        k_buf, v_buf = self.kv_pool.get_key_buffer(0), self.kv_pool.get_value_buffer(0)
        mask = None
        if qlen > 1:
            pos = torch.arange(seq - qlen, seq)
            mask = torch.arange(seq)[None, :] <= pos[:, None]  # [qlen, seq] bottom-right causal
        scale = self.layer.scaling

        def call() -> torch.Tensor:
            k = k_buf.index_select(0, slots).view(bs, seq, HKV, D).transpose(1, 2)
            v = v_buf.index_select(0, slots).view(bs, seq, HKV, D).transpose(1, 2)
            q = self.q.view(bs, qlen, HQ, D).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            return o.transpose(1, 2).reshape(bs * qlen, HQ * D)

        return call


def bench(calls: dict[str, Callable[[], torch.Tensor]], reps: int) -> dict[str, list[float]]:
    """Wall seconds per call: two warm-up calls each, then `reps` rounds, peers interleaved."""
    for fn in calls.values():
        fn()
        fn()
    measures = {name: (lambda f=fn: host_times_us(f, 1, "cpu")) for name, fn in calls.items()}
    return {name: [us * 1e-6 for us in samples] for name, samples in interleave(measures, reps).items()}


def cpu_description() -> dict:
    from attn_cpu_amx import isa

    flags = sorted(f for f in isa.cpu_flags() if f in isa.AMX_FLAGS)
    return {
        "model": isa.cpu_model(),
        "flags": flags,
        "runnable_paths": list(isa.runnable_paths()),
        "cpus": os.cpu_count(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="cpu_vs_peers.json")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rows", default="decode,extend")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--isa", default=None, help="force the cpu_amx path (default: $ATTN_CPU_AMX_ISA or auto)")
    ap.add_argument("--no-torch-native", action="store_true", help="skip torch_native (slow)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from attn_cpu_amx import build

    build.load_kernels()
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_description(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "kernel_build_seconds": round(build.last_build().seconds, 2),
        "kernel_build_compiled": build.last_build().compiled,
        "rows": [],
    }
    print(
        f"CPU {report['cpu']['model']}, flags {' '.join(report['cpu']['flags'])}, "
        f"{report['threads']} threads, torch {torch.__version__}"
    )
    header = (
        f"{'row':28} {'dtype':9} {'path':7} {'cpu_amx ms':>11} {'native ms':>10} {'gath+sdpa ms':>12} "
        f"{'x native':>9} {'x sdpa':>7}"
    )
    header += "  rel err amx/sdpa"
    print(header)
    for key in args.rows.split(","):
        title, mode, requests = ROWS[key]
        for dname in args.dtypes.split(","):
            dtype = getattr(torch, dname)
            row = Row(mode, requests, dtype)
            options = {} if args.isa is None else {"isa": args.isa}
            amx = create_backend("cpu_amx", row.ctx, **options)
            native = create_backend("torch_native", row.ctx)
            first_step = functools.partial(amx.init_forward_metadata, row.batch)
            meta_us = host_times_us(first_step, 1, "cpu")[0]  # the first step's metadata, cold
            amx_call = row.backend_call(amx)
            calls = {"cpu_amx": amx_call, "gather+sdpa": row.gather_sdpa_call()}
            errs = {}
            if not args.no_torch_native:
                calls["torch_native"] = row.backend_call(native)
                ref = calls["torch_native"]().float()
                errs = {name: relative_error(calls[name]().float(), ref) for name in ("cpu_amx", "gather+sdpa")}
            times = bench(calls, args.reps)
            med = {name: statistics.median(ts) for name, ts in times.items()}
            x_native = med["torch_native"] / med["cpu_amx"] if "torch_native" in med else None
            x_sdpa = med["gather+sdpa"] / med["cpu_amx"]
            err_txt = f"{errs.get('cpu_amx', float('nan')):.2g}/{errs.get('gather+sdpa', float('nan')):.2g}"
            print(
                f"{title:28} {dname:9} {amx.kernel_path:7} {med['cpu_amx'] * 1e3:11.2f} "
                f"{med.get('torch_native', float('nan')) * 1e3:10.1f} {med['gather+sdpa'] * 1e3:12.2f} "
                f"{(x_native or float('nan')):9.2f} {x_sdpa:7.2f}  {err_txt}",
                flush=True,
            )
            report["rows"].append(
                {
                    "row": title,
                    "dtype": dname,
                    "path": amx.kernel_path,
                    "median_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
                    "all_ms": {k: [round(t * 1e3, 3) for t in v] for k, v in times.items()},
                    "speedup_vs_torch_native": None if x_native is None else round(x_native, 2),
                    "speedup_vs_gather_sdpa": round(x_sdpa, 2),
                    "rel_err_vs_torch_native": {k: float(v) for k, v in errs.items()},
                    "cpu_amx_metadata_us": round(meta_us, 1),
                }
            )
            with open(args.out, "w") as f:  # after every row: a run cut short keeps what it measured
                json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
