"""Host cost of attn-core's per-layer call: `AttentionLayer.__call__` → `AttentionBackend.forward` →
argument validation → dispatch, with the backend's kernels stubbed out.

The backend is attn-core's `torch_native` with `forward_decode` / `forward_extend` replaced by a stub that
returns a preallocated output, so the time is attn-core's path alone (what every backend pays per layer
before its own code runs). Inputs as an engine hands them: q `[T, Hq*D]`, k / v `[T, Hkv, D]`,
save_kv_cache=True (the stub writes nothing), no extras. Sizes as in `cpu_vs_peers.py` (GQA 32 q / 8 kv
heads, head_dim 128, bf16, page size 16); the context length does not matter with the kernels stubbed.

Rows:
  decode bs1        DECODE, 1 request (2047 cached tokens + 1 new)
  decode bs64       DECODE, 64 requests (255 cached + 1 new)
  extend bs4 q128   EXTEND, 4 requests (128 cached + 128 new)

Timed paths per row (calls interleaved round-robin, `--groups` samples of `--calls` back-to-back calls
each, the median sample / calls reported, in µs):
  layer()           `layer(q, k, v, batch)`: what a model's forward calls
  backend.forward   `batch.attn_backend.forward(q, k, v, layer, batch)`
  stub alone        the stubbed `forward_decode` / `forward_extend` called directly (the floor)

Before/after a change to attn-core: run it on each tree, back to back, e.g.
  git archive <base> core/src | tar -x -C /tmp/base
  PYTHONPATH=/tmp/base/core/src python benchmarks/forward_host_cost.py --json base.json
  python benchmarks/forward_host_cost.py --json new.json
(the script prints which attn_core it imported).

  python benchmarks/forward_host_cost.py [--calls 200] [--groups 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from typing import Callable

import torch

import attn_core
from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.batch_builder import build_forward_batch
from attn_core.context import BackendContext
from attn_core.layer import AttentionLayer
from attn_core.memory import MHATokenToKVPool, PagedTokenAllocator, ReqToTokenPool

HQ, HKV, D, PAGE, DTYPE = 32, 8, 128, 16, torch.bfloat16
ROWS = {
    "decode bs1": ("DECODE", [(2047, 1)]),
    "decode bs64": ("DECODE", [(255, 1)] * 64),
    "extend bs4 q128": ("EXTEND", [(128, 128)] * 4),
}


class StubbedKernels(TorchNativeBackend):
    """torch_native with its per-layer work replaced by returning a preallocated output."""

    name = "torch_native_stubbed"

    def __init__(self, ctx: BackendContext, out: torch.Tensor):
        super().__init__(ctx)
        self.out = out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        return self.out

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        return self.out


def make_row(mode: str, requests: list[tuple[int, int]]) -> dict[str, Callable[[], object]]:
    """The three timed calls of one row, over a fresh pool, batch and stubbed backend."""
    total = sum(p + e for p, e in requests)
    pages = -(-total // PAGE) + len(requests) + 1
    kv_pool = MHATokenToKVPool(pages * PAGE, PAGE, DTYPE, HKV, D, 1)
    req_pool = ReqToTokenPool(len(requests), max(p + e for p, e in requests) + PAGE)
    batch = build_forward_batch(
        mode, requests, req_to_token_pool=req_pool, allocator=PagedTokenAllocator(pages * PAGE, PAGE), token_to_kv_pool=kv_pool
    )
    ctx = BackendContext(
        device="cpu",
        dtype=DTYPE,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        page_size=PAGE,
        max_batch_size=len(requests),
        max_context_len=req_pool.max_context_len,
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
    )
    T = batch.num_tokens
    backend = StubbedKernels(ctx, torch.empty(T, HQ * D, dtype=DTYPE))
    batch.attn_backend = backend
    backend.init_forward_metadata(batch)
    layer = AttentionLayer(0, HQ, HKV, D)
    q = torch.randn(T, HQ * D).to(DTYPE)
    k = torch.randn(T, HKV, D).to(DTYPE)
    v = torch.randn(T, HKV, D).to(DTYPE)
    q3 = q.view(T, HQ, D)
    stub = backend.forward_decode if batch.forward_mode.is_decode() else backend.forward_extend
    return {
        "layer()": lambda: layer(q, k, v, batch),
        "backend.forward": lambda: backend.forward(q, k, v, layer, batch),
        "stub alone": lambda: stub(q3, k, v, layer, batch),
    }


def sample(calls: dict[str, Callable[[], object]], n: int, groups: int) -> dict[str, float]:
    """Median µs per call of each entry: `groups` rounds, each timing `n` back-to-back calls of every
    entry in turn (interleaved, so drift hits all alike)."""
    for fn in calls.values():
        for _ in range(n):
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(groups):
        for name, fn in calls.items():
            t = time.perf_counter()
            for _ in range(n):
                fn()
            times[name].append((time.perf_counter() - t) / n)
    return {name: statistics.median(ts) * 1e6 for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200, help="back-to-back calls per sample")
    ap.add_argument("--groups", type=int, default=200, help="samples per timed path")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "attn_core": attn_core.__file__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
        "rows": {},
    }
    print(f"attn_core from {attn_core.__file__}; torch {torch.__version__}, python {platform.python_version()}")
    print(f"{'row':18} {'layer() µs':>11} {'backend.forward µs':>19} {'stub alone µs':>14}")
    for title, (mode, requests) in ROWS.items():
        med = sample(make_row(mode, requests), args.calls, args.groups)
        report["rows"][title] = med
        print(f"{title:18} {med['layer()']:11.2f} {med['backend.forward']:19.2f} {med['stub alone']:14.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
