"""attn-sparse's two backends against dense attention of the same length, in one run on one GPU.

Shapes: GQA 32 q / 8 KV heads, head_dim 128, bf16, page size 16, one layer; K/V (and labels) random. Rows:
  ds-decode   DECODE of `--batch-sizes` requests of `--context` keys (default 32768): `double_sparsity`
              (heavy_token_num `--heavy` 1024, `--channels` 16 heavy channels, `--threshold` 4096: every request
              takes the top-k path) against attn-triton's dense decode (`triton`) and double sparsity's own
              dense path (`double_sparsity` with a threshold above the context);
  dc-decode   DECODE of the same batches: `dual_chunk` (chunk_size `--chunk-size` 8192, local_size 1024: five
              chunks, all three parts) against `triton` and dual chunk's own dense path (a chunk longer than the
              context: the intra part alone);
  dc-prefill  one request's `--prefill` 16384 new tokens (EXTEND, nothing cached): the same three peers.
Every peer reads the same pool and batch. The timed call is one layer's `forward(..., save_kv_cache=False)`
after one call that wrote the step's keys; decode rows are timed eagerly and replaying a CUDA graph of that
call (`eager_us`, `graph_us`). Checks printed with each row (not timed): the dense paths against `triton`, and
dual chunk with q_succ = q_inter = q (the values timed), which is dense causal attention, against `triton`.
Ratios (`speedup_vs_triton`: triton time / peer time) are the claim.

  python benchmarks/sparse_attention.py [--rows ds-decode,dc-decode,dc-prefill] [--batch-sizes 1,8] [--context 32768]
      [--heavy 1024] [--channels 16] [--threshold 4096] [--chunk-size 8192] [--local-size 1024] [--prefill 16384]
      [--budget 1.0] [--json out.json] [--device cpu: a smoke run of the logic under TRITON_INTERPRET=1, tiny sizes]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import attn_core as ac
from attn_core.bench.timing import capture_graph, time_calls
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.testing.reference import relative_error
from attn_sparse.double_sparsity.pool import DoubleSparseKVPool

HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
#: where the run happens ("cuda"; `--device cpu` runs the script's logic under the Triton interpreter, tiny
#: shapes only: its times mean nothing and graphs are left out)
DEVICE = "cuda"


@dataclass
class Setup:
    """One row's pools, batch and inputs (q / k / v of the step's tokens, and dual chunk's variants)."""

    ctx: ac.BackendContext
    batch: ac.ForwardBatch
    layer: ac.AttentionLayer
    x: dict


def make_setup(lens: list[int], new: int, channels: int, gen: torch.Generator) -> Setup:
    """Requests with `lens` cached keys each and `new` new tokens each (DECODE when new == 1 and lens > 0)."""
    size = sum(-(-(n + new) // PAGE) * PAGE for n in lens) + PAGE
    chans = torch.stack([torch.randperm(D, generator=gen)[:channels] for _ in range(HKV)])[None]
    pool = DoubleSparseKVPool(size, PAGE, DTYPE, HKV, D, 1, heavy_channels=chans, device=DEVICE)
    for buf in (pool.get_key_buffer(0), pool.get_value_buffer(0)):
        buf.normal_()
    index = pool.heavy_channels[0].unsqueeze(0).expand(pool.num_slots, -1, -1)
    pool.get_label_buffer(0).copy_(torch.gather(pool.get_key_buffer(0), 2, index))
    width = max(lens) + new + PAGE
    rows = ac.ReqToTokenPool(len(lens), width, device=DEVICE)
    requests = ac.RequestPool(rows, ac.PagedTokenAllocator(size, PAGE), pool)
    reqs = [requests.add() for _ in lens]
    cached = [(r, n) for r, n in zip(reqs, lens) if n]
    if cached:
        ac.build_step(requests, cached)  # their slots (the pool already holds random K/V there)
    batch = ac.build_step(requests, [(r, new) for r in reqs])
    ctx = ac.BackendContext(
        device=DEVICE,
        dtype=DTYPE,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        page_size=PAGE,
        max_batch_size=len(lens),
        max_context_len=width,
        req_to_token_pool=rows,
        token_to_kv_pool=pool,
        forward_modes={"extend", "decode"},
        cuda_graph=ac.CudaGraphLevel.UNIFORM_SINGLE_TOKEN_DECODE,
    )
    T = batch.num_tokens
    q = torch.randn(T, HQ, D, device=DEVICE, dtype=DTYPE)
    x = {
        "q": q,
        "k": torch.randn(T, HKV, D, device=DEVICE, dtype=DTYPE),
        "v": torch.randn(T, HKV, D, device=DEVICE, dtype=DTYPE),
    }
    x["extras"] = {"q_succ": q, "q_inter": q}
    return Setup(ctx, batch, ac.AttentionLayer(0, HQ, HKV, D), x)


def measure(
    s: Setup, name: str, options: dict, extras: bool, graphs: bool, budget: float
) -> tuple[torch.Tensor, float, Optional[float]]:
    """(output, eager µs, graph µs or None) of one peer on the setup's batch."""
    backend = ac.create_backend(name, s.ctx, **options)
    batch, x, layer = s.batch, s.x, s.layer
    more = x["extras"] if extras else {}
    batch.attn_backend = backend
    backend.init_forward_metadata(batch)
    out = backend.forward(x["q"], x["k"], x["v"], layer, batch, save_kv_cache=True, **more)

    def call(_i: int = 0):
        return backend.forward(x["q"], None, None, layer, batch, save_kv_cache=False, **more)

    dev = torch.device(DEVICE)
    eager = time_calls(call, dev, budget).median_us
    graph_us = None
    if graphs:
        backend.init_cuda_graph_state(batch.batch_size, batch.batch_size)
        backend.capture_cuda_graph_metadata(CudaGraphStep.from_batch(batch))
        graph = capture_graph([call], calls=1)
        backend.replay_cuda_graph_metadata(CudaGraphStep.from_batch(batch))  # as an engine does before each replay
        graph_us = time_calls(lambda _i: graph.replay(), dev, budget).median_us
    return out.float(), eager, graph_us


PEERS: dict[str, Callable[[argparse.Namespace], list[tuple[str, str, dict, bool]]]] = {
    # label -> (label, backend, options, takes dual chunk's extras)
    "ds": lambda a: [
        ("triton", "triton", {}, False),
        (
            "double_sparsity",
            "double_sparsity",
            {"heavy_token_num": a.heavy, "sparse_decode_threshold": a.threshold},
            False,
        ),
        ("double_sparsity_dense", "double_sparsity", {"sparse_decode_threshold": 1 << 30}, False),
    ],
    "dc": lambda a: [
        ("triton", "triton", {}, False),
        ("dual_chunk", "dual_chunk", {"chunk_size": a.chunk_size, "local_size": a.local_size}, True),
        ("dual_chunk_dense", "dual_chunk", {"chunk_size": 1 << 30}, True),
    ],
}


def run_row(args: argparse.Namespace, row: str, bs: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    prefill = row == "dc-prefill"
    s = make_setup([0] if prefill else [args.context] * bs, args.prefill if prefill else 1, args.channels, gen)
    result = {"row": row, "batch_size": 1 if prefill else bs, "keys": args.prefill if prefill else args.context + 1}
    outs, times = {}, {}
    for label, name, options, extras in PEERS[row[:2]](args):
        out, eager, graph_us = measure(
            s, name, options, extras, graphs=not prefill and DEVICE == "cuda", budget=args.budget
        )
        outs[label], times[label] = out, (eager, graph_us)
        result[f"{label}_eager_us"] = round(eager, 1)
        if graph_us is not None:
            result[f"{label}_graph_us"] = round(graph_us, 1)
    base = times["triton"]
    for label, (eager, graph_us) in times.items():
        if label != "triton":
            result[f"{label}_speedup_vs_triton"] = round(base[0] / eager, 3)
            if graph_us is not None:
                result[f"{label}_graph_speedup_vs_triton"] = round(base[1] / graph_us, 3)
    dense = [label for label in outs if label != "triton" and (label.endswith("_dense") or label == "dual_chunk")]
    result["rel_err_vs_triton"] = {
        label: round(relative_error(outs[label].cpu(), outs["triton"].cpu()), 5) for label in dense
    }
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="ds-decode,dc-decode,dc-prefill")
    p.add_argument("--batch-sizes", default="1,8", help="decode rows' batch sizes")
    p.add_argument("--context", type=int, default=32768, help="cached keys per request in the decode rows")
    p.add_argument("--heavy", type=int, default=1024, help="double sparsity's heavy_token_num")
    p.add_argument("--channels", type=int, default=16, help="heavy channels per KV head")
    p.add_argument("--threshold", type=int, default=4096, help="double sparsity's sparse_decode_threshold")
    p.add_argument("--chunk-size", type=int, default=8192)
    p.add_argument("--local-size", type=int, default=1024)
    p.add_argument("--prefill", type=int, default=16384, help="new tokens of the dc-prefill row")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timed calls per peer and mode")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run under TRITON_INTERPRET=1"
    )
    args = p.parse_args()
    global DEVICE, DTYPE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("sparse_attention.py needs a CUDA GPU (or --device cpu under TRITON_INTERPRET=1)")
    if DEVICE == "cpu":
        DTYPE = torch.float32  # the interpreter's bf16 tl.dot is wrong (triton-lang/triton#11584)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "args": vars(args),
    }
    print(json.dumps({k: meta[k] for k in ("date", "device", "torch")}))
    rows = []
    for row in args.rows.split(","):
        row = row.strip()
        if row not in ("ds-decode", "dc-decode", "dc-prefill"):
            raise SystemExit(f"--rows: unknown row {row!r}")
        for bs in [1] if row == "dc-prefill" else [int(b) for b in args.batch_sizes.split(",")]:
            rows.append(run_row(args, row, bs))
            print(json.dumps(rows[-1]), flush=True)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
