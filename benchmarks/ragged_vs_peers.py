"""The ragged op (`attn_core.contract.ragged`) on a vision-tower shape: attn-triton's varlen kernel against FlashInfer's
ragged prefill and FlashAttention-4's varlen attention (non-causal), run on a GPU machine.

Shape (default): 16 heads, head_dim 80, bf16, 4 images of 1024, 2304, 3136 and 4096 patches packed as one
batch (T = 10560), non-causal, q / k / v the strided views of one fused qkv projection output `[T, 3·H·D]`
as a ViT block makes them. Per head dim (`--head-dims`) the script

1. builds every implementation it can run here:
   - `attn-triton` (the backend's default tiles) and `attn-triton <tiles>` (each `--configs` entry
     "block_m,block_n,warps,stages,lazy"), through attn's public API (`create_backend("triton", ctx)`,
     `init_ragged_metadata`, `ragged_attention`);
   - `attn-flashinfer` (attn's FlashInfer backend: FA2's ragged prefill, the channels zero-padded to 64 /
     128 / 256 around the call, padding included in its time);
   - `flashinfer-fa2` / `flashinfer-fa3`: FlashInfer's `BatchPrefillWithRaggedKVCacheWrapper` called
     directly (plan outside the timed region) on inputs already padded to the head dim its kernels serve
     (the padding is not timed: the strongest form of the peer);
   - `fa4`: `flash_attn.cute.flash_attn_varlen_func` when `flash_attn.cute` imports, at the head dim itself
     and, where that fails or is not one of FA4's 64 / 96 / 128, on inputs pre-padded to the next of them;
   - `torch-sdpa`: `torch.nn.functional.scaled_dot_product_attention` image by image (for reference, no peer);
2. checks every implementation's output against the float64 reference of each image
   (`attn_core.testing.reference.reference_attention`; bf16 tolerance 2e-2): a wrong one is reported and
   left out of the ratios;
3. times them interleaved (`--rounds` rounds, each implementation `attn_core.bench.timing.time_calls` per
   round; the median of the rounds' medians), and prints time, TFLOP/s (4·H·D·Σ n² flops) and the ratio
   peer time / attn-triton time of the fastest correct peer (FlashInfer's or FA4's): the target is >= 0.9.

  python benchmarks/ragged_vs_peers.py [--head-dims 80,128] [--lens 1024,2304,3136,4096] [--heads 16]
      [--dtype bfloat16] [--configs "128,64,4,3,4;128,128,8,3,4"] [--flashinfer-backends fa2,fa3] [--rounds 3]
      [--budget 0.5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import attn_core as ac
from attn_core.bench.timing import time_calls
from attn_core.testing.reference import reference_attention, relative_error, tolerance

DEFAULT_CONFIGS = "128,64,4,3,4;128,128,8,3,4;128,64,8,2,4;64,64,4,3,0;128,64,8,3,4"
FA4_HEAD_DIMS = (64, 96, 128)
FLASHINFER_HEAD_DIMS = (64, 128, 256)


@dataclass
class Impl:
    """One implementation of a row: `run()` returns the output `[T, H, D]` (or wider, padded channels)."""

    name: str
    run: Callable[[], torch.Tensor]
    peer: bool  # counts as a peer in the ratio
    note: str = ""
    error: Optional[str] = None
    rel_err: Optional[float] = None
    times_us: list = field(default_factory=list)

    @property
    def median_us(self) -> Optional[float]:
        return statistics.median(self.times_us) if self.times_us else None


def _padded_to(x: torch.Tensor, width: int) -> torch.Tensor:
    return x.contiguous() if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _next_width(d: int, widths) -> Optional[int]:
    return next((w for w in widths if w >= d), None)


def _inputs(lens, heads, d, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    total = sum(lens)
    qkv = torch.randn(total, 3 * heads * d, generator=gen, device=device, dtype=torch.float32).to(dtype)
    q, k, v = (t.view(total, heads, d) for t in qkv.split(heads * d, dim=-1))
    return q, k, v


def _attn_impls(name, backend_name, options, ragged, q, k, v, heads, d, dtype, device, peer=False) -> list[Impl]:
    ctx = ac.BackendContext(
        device=device,
        dtype=dtype,
        num_q_heads=heads,
        num_kv_heads=heads,
        head_dim=d,
        forward_modes=frozenset(),
        features=frozenset({ac.Feature.RAGGED}),
    )
    try:
        backend = ac.create_backend(backend_name, ctx, **options)
        backend.init_ragged_metadata(ragged)
    except Exception as exc:  # not installed, unavailable, refused: reported
        return [Impl(name, lambda: None, peer, error=f"{type(exc).__name__}: {exc}")]
    T = q.shape[0]
    return [Impl(name, lambda: backend.ragged_attention(q, k, v, ragged).view(T, heads, d), peer)]


def _flashinfer_impls(ragged, q, k, v, heads, d, dtype, device, kernel_backends) -> list[Impl]:
    try:
        import flashinfer
    except ImportError as exc:
        return [Impl("flashinfer", lambda: None, True, error=f"not installed: {exc}")]
    width = _next_width(d, FLASHINFER_HEAD_DIMS)
    qp, kp, vp = (_padded_to(x, width) for x in (q, k, v))
    indptr = ragged.cu_seqlens_cpu.to(torch.int32)
    out = []
    for kernels in kernel_backends:
        name = f"flashinfer-{kernels}"
        try:
            ws = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
            w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=kernels)
            w.plan(
                indptr,
                indptr,
                heads,
                heads,
                width,
                causal=False,
                sm_scale=d**-0.5,
                q_data_type=dtype,
                kv_data_type=dtype,
            )
            w.run(qp, kp, vp)  # compile / first run outside the timing
            note = f"inputs pre-padded to d{width}" if width != d else ""
            out.append(Impl(name, lambda w=w: w.run(qp, kp, vp), True, note=note))
        except Exception as exc:
            out.append(Impl(name, lambda: None, True, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
    return out


def _fa4_impls(ragged, q, k, v, heads, d, dtype, device) -> list[Impl]:
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as exc:
        return [Impl("fa4", lambda: None, True, error=f"flash_attn.cute does not import: {type(exc).__name__}: {exc}")]
    cu, n = ragged.cu_seqlens, ragged.max_seqlen
    widths = [d] + ([w] if (w := _next_width(d, FA4_HEAD_DIMS)) not in (None, d) else [])
    out = []
    for width in widths:
        qp, kp, vp = (_padded_to(x, width) for x in (q, k, v))

        def run(qp=qp, kp=kp, vp=vp):
            res = flash_attn_varlen_func(
                qp,
                kp,
                vp,
                cu_seqlens_q=cu,
                cu_seqlens_k=cu,
                max_seqlen_q=n,
                max_seqlen_k=n,
                softmax_scale=d**-0.5,
                causal=False,
            )
            return res[0] if isinstance(res, tuple) else res

        name = "fa4" if width == d else f"fa4 (d{width})"
        try:
            run()
            out.append(Impl(name, run, True, note="" if width == d else f"inputs pre-padded to d{width}"))
        except Exception as exc:
            out.append(Impl(name, lambda: None, True, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
    return out


def _sdpa_impl(lens, q, k, v, d) -> Impl:
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)

    def run():
        outs = []
        for a, b in zip(bounds, bounds[1:]):
            qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, scale=d**-0.5)[0].transpose(0, 1))
        return torch.cat(outs)

    return Impl("torch-sdpa", run, False, note="image by image, for reference")


def _reference(lens, q, k, v, d) -> torch.Tensor:
    outs, start = [], 0
    for n in lens:
        rows = slice(start, start + n)
        o, _ = reference_attention(q[rows], k[rows], v[rows], q_positions=torch.arange(n), scale=d**-0.5, causal=False)
        outs.append(o)
        start += n
    return torch.cat(outs)


def run_row(d: int, args, device: torch.device) -> dict:
    dtype, heads, lens = getattr(torch, args.dtype), args.heads, args.lens
    q, k, v = _inputs(lens, heads, d, dtype, device)
    ragged = ac.ragged_batch(lens, device)
    impls = _attn_impls("attn-triton", "triton", {}, ragged, q, k, v, heads, d, dtype, device)
    from attn_triton.kernels.ragged import RaggedConfig

    for spec in filter(None, args.configs.split(";")):
        bm, bn, w, s, lazy = (int(x) for x in spec.split(","))
        options = {"ragged_config": RaggedConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s, lazy_rescale=lazy)}
        impls += _attn_impls(f"attn-triton {spec}", "triton", options, ragged, q, k, v, heads, d, dtype, device)
    impls += _attn_impls("attn-flashinfer", "flashinfer", {}, ragged, q, k, v, heads, d, dtype, device)
    impls += _flashinfer_impls(ragged, q, k, v, heads, d, dtype, device, args.flashinfer_backends)
    impls += _fa4_impls(ragged, q, k, v, heads, d, dtype, device)
    impls.append(_sdpa_impl(lens, q, k, v, d))

    ref = _reference(lens, q, k, v, d)
    tol = tolerance(dtype)
    for impl in impls:
        if impl.error:
            continue
        try:
            out = impl.run()
            torch.cuda.synchronize() if device.type == "cuda" else None
            impl.rel_err = relative_error(out[..., :d].reshape(ref.shape), ref)
            if not impl.rel_err <= tol:
                impl.error = f"wrong: rel err {impl.rel_err:.3g} > {tol}"
        except Exception as exc:
            impl.error = f"{type(exc).__name__}: {str(exc)[:200]}"
    live = [i for i in impls if not i.error]
    for _ in range(args.rounds):
        for impl in live:
            impl.times_us.append(time_calls(lambda _i, f=impl.run: f(), device, args.budget).median_us)

    flops = 4 * heads * d * sum(n * n for n in lens)
    triton = [i for i in live if i.name.startswith("attn-triton")]
    best_triton = min(triton, key=lambda i: i.median_us) if triton else None
    peers = [i for i in live if i.peer]
    best_peer = min(peers, key=lambda i: i.median_us) if peers else None
    ratio = best_peer.median_us / best_triton.median_us if best_triton and best_peer else None
    default = next((i for i in triton if i.name == "attn-triton"), None)
    ratio_default = best_peer.median_us / default.median_us if default and best_peer else None
    return {
        "head_dim": d,
        "heads": heads,
        "lens": list(lens),
        "dtype": args.dtype,
        "tflops_per_call": flops / 1e12,
        "impls": [
            {
                **{k: v for k, v in asdict(i).items() if k != "run"},
                "median_us": i.median_us,
                "tflops": (flops / i.median_us / 1e6) if i.median_us else None,
            }
            for i in impls
        ],
        "fastest_triton": best_triton.name if best_triton else None,
        "fastest_peer": best_peer.name if best_peer else None,
        "peer_over_triton_best": ratio,
        "peer_over_triton_default": ratio_default,
    }


def _print_row(row: dict) -> None:
    print(f"\n== ragged, {row['heads']} heads, d{row['head_dim']}, {row['dtype']}, images {row['lens']} (non-causal)")
    print(f"{'implementation':34s} {'median us':>10s} {'TFLOP/s':>8s} {'rel err':>9s}  note")
    for i in row["impls"]:
        if i["error"]:
            print(f"{i['name']:34s} {'-':>10s} {'-':>8s} {'-':>9s}  {i['error']}")
        else:
            print(f"{i['name']:34s} {i['median_us']:10.1f} {i['tflops']:8.1f} {i['rel_err']:9.2g}  {i['note']}")
    r, rd = row["peer_over_triton_best"], row["peer_over_triton_default"]
    if r is not None:
        print(
            f"fastest peer {row['fastest_peer']} / fastest attn-triton {row['fastest_triton']}: {r:.3f}x "
            f"(default tiles: {rd:.3f}x; target >= 0.9)"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dims", default="80,128", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--lens", default="1024,2304,3136,4096", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument(
        "--configs", default=DEFAULT_CONFIGS, help='attn-triton tiles "block_m,block_n,warps,stages,lazy;..."'
    )
    p.add_argument(
        "--flashinfer-backends",
        default="fa2,fa3",
        type=lambda s: [x for x in s.split(",") if x],
        help="FlashInfer kernel backends timed as peers (fa3: SM90 only; each may JIT-compile once)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget", type=float, default=0.5, help="seconds of timing per implementation per round")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("ragged_vs_peers: needs a CUDA GPU (--device cpu runs it under TRITON_INTERPRET=1 as a smoke test)")
        return 2
    t0 = time.time()
    env = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import flashinfer

        env["flashinfer"] = flashinfer.__version__
    except ImportError:
        pass
    rows = []
    for d in args.head_dims:
        row = run_row(d, args, device)
        _print_row(row)
        rows.append(row)
    print(f"\n{env} ({time.time() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "args": {k: v for k, v in vars(args).items()}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
