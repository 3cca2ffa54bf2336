"""MLA on one GPU, in one run: attn-flashinfer's `flashinfer_mla` against FlashInfer's MLA wrapper called
directly on its own plan of the same batch, and attn-triton's MLA kernels (absorbed MLA: 128 heads,
latent 512 + 64, bf16, page size 64), plus DeepSeek's non-absorbed prefill with a chunked prefix.

Rows: decode bs1 x 8192, bs64 x 4096, bs128 x 2048 keys; verify (TARGET_VERIFY, 4 draft tokens, chain) at
bs64 x 4096; prefill bs4, 1024 new tokens each after a 3072-token prefix read in chunks (capacity 4096
tokens: 3 chunks of 1024 per request), 128 heads, 192 / 128.

attn-triton runs its MLA kernel (`attn_triton/kernels/mla_decode.py`) on the decode rows and, the four
drafts of every request folded into the kernel's M dimension, on the verify row; `triton_over_run` is
its time over FlashInfer's direct run on the same pages (issue 15's ratios).

The peer: FlashInfer's `BatchMLAPagedAttentionWrapper` planned by its own public `plan` on the same batch
(the page ids and lengths computed from the batch's request rows with attn-core's public index ops, as an
engine calling FlashInfer directly would hand them) and run on the same pages.

Per row: per-layer forward time (CUDA events over back-to-back calls, save_kv_cache=False as FlashInfer's
run stores nothing) of flashinfer_mla, of flashinfer_mla with `device_works=False` (FlashInfer's host
scheduler instead of the device work list), the direct run and attn-triton's forward; the same (and every
`--mla-tiles` variant) timed again inside CUDA graphs (`graph_us`: `iters` calls captured in one graph,
replayed; on by default, `--no-graphs` skips it); the host time of one step's metadata
(`init_forward_metadata`: attn-core's validation, then one launch writing the page ids and FlashInfer's
MLA work list) against FlashInfer's own `plan` on the same host inputs (page ids prebuilt); one forward
call's host time next to one direct run's (GPU idle); and for DECODE the CUDA-graph replay metadata.
`ATTN_META_PROFILE=1` adds to each absorbed row a cProfile of init_forward_metadata and of one layer's
forward ("profile_metadata" / "profile_forward": the top functions by own time, per call; printed too).
The prefill row (`--no-prefill` skips it) times `PrefillPlan.attend` (`plan_prefill`) against the plan's
FlashInfer wrappers run by hand (ragged + one ragged per chunk + attn-core's merge_state) and against one
causal ragged pass over the whole sequence (what chunking trades for bounded memory). Every timing goes
through `attn_core.bench.timing`; the backends are made with `attn_core.create_backend`.

Back-to-back eager calls are host-bound where the kernels are short (bs1: attn-triton's eager forward
spends ~200 us of host time per call, FlashInfer's ~100 us, against ~25-40 us of GPU time), so the
kernel ratios issue 15 claims are the graph rows' (`triton_over_run_graph`: attn-triton's forward over
FlashInfer's direct run, both replayed from CUDA graphs, as engines run decode); the eager columns stay
for the host cost.

`--mla-tiles` adds attn-triton MLA kernel variants to every row, timed next to the default and
FlashInfer in the same run. Spelling: `BHxBNxWxS` (block_h x block_n x num_warps x num_stages) followed
by options joined with ':' — `cK` (MLAConfig.ctas_per_sm = K: wave-aware decode splits for K programs per
SM; one split runs without the merge launch), `lK` (lazy_rescale = K: the accumulator is rescaled only when
a row's max grew by more than K, base 2), `g1` (wgmma: the Hopper kernel `kernels/mla_wgmma.py`, tiles
64x32x8x4 only). E.g. (the SM90 default is 64x32x8x4:c1:g1; docs/dev/perf-notebook.md, "The warp-specialized Hopper MLA
kernel")

    python benchmarks/mla_vs_peers.py --no-prefill --mla-tiles 64x32x8x4:g1,32x64x4x3:c2:l8 --json out.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics

import torch

from attn_core import (
    AttentionLayer,
    BackendContext,
    MLATokenToKVPool,
    PagedTokenAllocator,
    ReqToTokenPool,
    create_backend,
    merge_state,
)
from attn_core.bench.timing import event_times_us, graph_times_us, host_times_us, interleave
from attn_core.ops.kv_indices import kv_indices_from_req_to_token, page_indptr_from_lens
from attn_core.testing.batch_builder import build_forward_batch
from attn_triton.config import MLAConfig

H, LORA, ROPE, PAGE, DTYPE = 128, 512, 64, 64, torch.bfloat16
D = LORA + ROPE
SCALE = 192**-0.5
WORKSPACE_BYTES = 128 << 20  # the peers' FlashInfer workspace (attn-flashinfer's default size)


def gpu_time_us(fn, iters: int, reps: int) -> list[float]:
    """Per-call µs of `fn` run `iters` times back to back between two CUDA events, `reps` samples."""
    return event_times_us(fn, reps, iters)


def graph_time_us(fn, iters: int, reps: int) -> list[float]:
    """Per-call GPU time of `fn` replayed from one CUDA graph holding `iters` calls (`reps` samples, µs).

    `fn` must launch only graph-safe work (metadata built before); it runs twice on a side stream
    first (warm-up: compiles, allocator pools), then is captured once."""
    return graph_times_us([fn], iters, reps, warmup=2)


def host_time_us(fn, reps: int) -> list[float]:
    """Host µs of single calls of `fn`, each started with the GPU idle."""
    out = host_times_us(fn, reps, "cuda")
    torch.cuda.synchronize()
    return out


def host_profile(fn, calls: int = 2000, top: int = 25) -> list[str]:
    """cProfile of `calls` calls of `fn` (GPU idle before each): the `top` functions by own time, as
    lines "own us per call | cumulative us per call | function" (profiling inflates small Python
    functions; the ranking is the point)."""
    prof = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        prof.enable()
        fn()
        prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        f"{tt / calls * 1e6:8.2f} | {ct / calls * 1e6:8.2f} | {pstats.func_std_string(f)}"
        for f, (_, _, tt, ct, _) in rows
    ]


def interleaved(fns: dict, rounds: int, measure) -> dict:
    """Median of `measure(fn)` per name, the functions alternated `rounds` times (drift hits all)."""
    samples = interleave({name: (lambda f=fn: measure(f)) for name, fn in fns.items()}, rounds)
    return {name: statistics.median(s) for name, s in samples.items()}


def new_step(
    mode: str, reqs, rows: ReqToTokenPool, allocator: PagedTokenAllocator, pool: MLATokenToKVPool, backend=None
):
    """One step of `reqs` ((cached, new) token counts) in `mode` over fresh request rows (attn-core's batch
    fixture: the cached tokens get slots too; the pool's contents stand for their latents). Verify steps
    run their drafts as a chain without a custom mask (FlashInfer's MLA kernels run verify causally)."""
    batch = build_forward_batch(
        mode, reqs, req_to_token_pool=rows, allocator=allocator, token_to_kv_pool=pool, attn_backend=backend
    )
    if batch.spec_info is not None:
        batch.spec_info.custom_mask = None
        batch.spec_info.mask_indptr = None
    return batch


def setup(mode: str, reqs):
    size = PAGE * (sum(-(-(p + e) // PAGE) for p, e in reqs) + 2)
    max_len = max(p + e for p, e in reqs) + PAGE
    pool = MLATokenToKVPool(size, PAGE, DTYPE, LORA, ROPE, 1, "cuda")
    pool.get_key_buffer(0).normal_()
    r2t = ReqToTokenPool(len(reqs), max_len, "cuda")
    batch = new_step(mode, reqs, r2t, PagedTokenAllocator(size, PAGE, "cuda"), pool)
    ctx = BackendContext(
        device="cuda",
        dtype=DTYPE,
        num_q_heads=H,
        num_kv_heads=1,
        head_dim=D,
        attention_arch="mla",
        kv_lora_rank=LORA,
        qk_rope_head_dim=ROPE,
        page_size=PAGE,
        max_batch_size=len(reqs),
        max_context_len=max_len,
        req_to_token_pool=r2t,
        token_to_kv_pool=pool,
        forward_modes=frozenset({mode}),
    )
    return ctx, batch, pool


def flashinfer_inputs(batch) -> dict:
    """FlashInfer's MLA plan inputs for `batch`, as the backend hands them to its plans (so FlashInfer's plan
    copies nothing back from the device): query offsets, page offsets and key counts on the host (int32,
    from the `*_cpu` lengths), the page ids on the device (built from the batch's request rows with
    attn-core's public index ops), and whether the queries are causal; keyed by the names of FlashInfer's
    `BatchMLAPagedAttentionWrapper.plan` (0.6.6 and 0.7 alike)."""
    seq_lens_cpu = batch.seq_lens_cpu.to(torch.int32)
    q_lens_cpu = batch.extend_seq_lens_cpu if batch.extend_seq_lens_cpu is not None else torch.ones_like(seq_lens_cpu)
    qo_indptr = page_indptr_from_lens(q_lens_cpu, 1)
    kv_indptr = page_indptr_from_lens(seq_lens_cpu, PAGE)
    r2t, rows, pages = batch.req_to_token_pool.req_to_token, batch.req_pool_indices, int(kv_indptr[-1])
    kv_indices = kv_indices_from_req_to_token(
        r2t, rows, page_indptr_from_lens(batch.seq_lens, PAGE), pages, page_size=PAGE
    )
    causal = not batch.forward_mode.is_decode()
    return dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=seq_lens_cpu, causal=causal)


def triton_forward(ctx, mode: str, reqs, pool, layer, q, k, **options):
    """attn-triton's forward on the same pool (its own request rows, the same pages in the same order),
    as a closure; `options` go to the backend (e.g. `mla_config`)."""
    triton = create_backend("triton", ctx, **options)
    rows = ReqToTokenPool(len(reqs), ctx.max_context_len, "cuda")
    tbatch = new_step(mode, reqs, rows, PagedTokenAllocator(pool.size, PAGE, "cuda"), pool, backend=triton)
    triton.init_forward_metadata(tbatch)

    def forward():
        layer(q, k, None, tbatch, save_kv_cache=False)

    return forward


#: --mla-tiles options: letter -> MLAConfig field (the value follows the letter)
TILE_OPTIONS = {"c": "ctas_per_sm", "l": "lazy_rescale", "g": "wgmma"}


def tiles_label(tiles: MLAConfig) -> str:
    """The --mla-tiles spelling of `tiles`: block_h x block_n x num_warps x num_stages, then the fields
    that differ from MLAConfig's defaults.

    >>> tiles_label(MLAConfig(64, 32, 8, 2))
    '64x32x8x2'
    >>> tiles_label(MLAConfig(32, 64, 4, 3, ctas_per_sm=2, lazy_rescale=8))
    '32x64x4x3:c2:l8'
    """
    label = f"{tiles.block_h}x{tiles.block_n}x{tiles.num_warps}x{tiles.num_stages}"
    base = MLAConfig()
    for letter, field in TILE_OPTIONS.items():
        if getattr(tiles, field) != getattr(base, field):
            label += f":{letter}{int(getattr(tiles, field))}"
    return label


def parse_tiles(text: str) -> list[MLAConfig]:
    """Comma-separated --mla-tiles items -> `MLAConfig`s: `BHxBNxWxS` then `:`-joined options
    (`cK`, `lK`: TILE_OPTIONS).

    >>> parse_tiles("64x32x8x2,32x64x4x3:c2:l8")[1]
    MLAConfig(block_h=32, block_n=64, num_warps=4, num_stages=3, ctas_per_sm=2, lazy_rescale=8, wgmma=False)
    >>> tiles_label(parse_tiles("64x32x8x4:c1:g1")[0])
    '64x32x8x4:c1:g1'
    """
    out = []
    for item in filter(None, text.split(",")):
        tiles, *options = item.strip().split(":")
        h, n, w, st = (int(x) for x in tiles.split("x"))
        fields = {}
        for opt in options:
            if opt[:1] not in TILE_OPTIONS or not opt[1:].isdigit():
                raise SystemExit(f"--mla-tiles: unknown option {opt!r} in {item!r} (known: cK, lK, g1)")
            fields[TILE_OPTIONS[opt[0]]] = int(opt[1:]) if opt[0] != "g" else bool(int(opt[1:]))
        out.append(MLAConfig(block_h=h, block_n=n, num_warps=w, num_stages=st, **fields))
    return out


def over_run(times: dict, label: str):
    """times[label] / times["flashinfer_run"], None when either is missing.

    >>> over_run({"triton": 30.0, "flashinfer_run": 20.0}, "triton"), over_run({}, "triton")
    (1.5, None)
    """
    if label in times and "flashinfer_run" in times:
        return times[label] / times["flashinfer_run"]
    return None


def bench_absorbed(
    name: str, mode: str, reqs, iters: int, rounds: int, mla_tiles: list[MLAConfig], graphs: bool = True
) -> dict:
    ctx, batch, pool = setup(mode, reqs)
    layer = AttentionLayer(0, H, 1, D, scaling=SCALE, v_head_dim=LORA)
    T = batch.num_tokens
    q = torch.randn(T, H, D, dtype=DTYPE, device="cuda")
    k = torch.randn(T, 1, D, dtype=DTYPE, device="cuda")
    backend = create_backend("flashinfer_mla", ctx)
    batch.attn_backend = backend
    backend.init_forward_metadata(batch)
    layer(q, k, None, batch)  # first step: learns the layer's scaling, stores the new latents
    backend.init_forward_metadata(batch)  # planned up front, lean
    pages = pool.get_key_buffer(0).view(-1, PAGE, D)
    ckv, kpe, q_nope, q_pe = pages[..., :LORA], pages[..., LORA:], q[..., :LORA], q[..., LORA:]
    out = torch.empty(T, H, LORA, dtype=DTYPE, device="cuda")
    # the peer: FlashInfer's wrapper on its own public plan of the same batch (same page ids)
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    fi = BatchMLAPagedAttentionWrapper(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda"), backend="auto")
    plan_in = flashinfer_inputs(batch)

    def fi_plan():  # by keyword: FlashInfer 0.7 deprecates positional MLA arguments (same names in 0.6.6)
        fi.plan(
            **plan_in,
            num_heads=H,
            head_dim_ckv=LORA,
            head_dim_kpe=ROPE,
            page_size=PAGE,
            sm_scale=SCALE,
            q_data_type=DTYPE,
            kv_data_type=DTYPE,
        )

    fi_plan()

    # the backend with FlashInfer's host scheduler instead of the device work list (its kernel time alone)
    host_planned = create_backend("flashinfer_mla", ctx, device_works=False)
    batch.attn_backend = host_planned
    host_planned.init_forward_metadata(batch)
    layer(q, k, None, batch, save_kv_cache=False)
    host_planned.init_forward_metadata(batch)

    def ours():
        batch.attn_backend = backend
        layer(q, k, None, batch, save_kv_cache=False)

    def ours_host_plan():
        batch.attn_backend = host_planned
        layer(q, k, None, batch, save_kv_cache=False)

    def direct():
        fi.run(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe, out=out)

    fns = {"flashinfer_mla": ours, "flashinfer_mla_host_plan": ours_host_plan, "flashinfer_run": direct}
    ours()
    direct()
    errors = {}
    for label, tiles in [("triton", None)] + [(f"triton {tiles_label(t)}", t) for t in mla_tiles]:
        try:  # a variant that fails is reported in the row, not fatal: the others stand alone
            options = {} if tiles is None else {"mla_config": tiles}
            fn = triton_forward(ctx, mode, reqs, pool, layer, q, k, **options)
            fn()
            fns[label] = fn
        except Exception as exc:
            errors[label] = f"{type(exc).__name__}: {exc}"[:300]
    torch.cuda.synchronize()
    t = interleaved(fns, rounds, lambda f: gpu_time_us(f, iters, 3))
    g = {}
    if graphs:
        graphed = {}
        for label, fn in fns.items():
            try:
                graph_time_us(fn, 2, 1)  # capture check
                graphed[label] = fn
            except Exception as exc:
                errors[label + " (graph)"] = f"{type(exc).__name__}: {exc}"[:300]
        g = interleaved(graphed, rounds, lambda f: graph_time_us(f, iters, 3))

    # host time of metadata: ours (validation + one launch: page ids and work list) vs FlashInfer's own plan
    def ours_meta():
        batch.attn_backend = backend
        backend.init_forward_metadata(batch)

    h = interleaved({"ours": ours_meta, "fi": fi_plan}, 40 * rounds, lambda f: host_time_us(f, 1))
    # one forward call's host time (GPU idle) against one direct run's: whether back-to-back calls are host-bound
    hb = interleaved({"forward": ours, "run": direct}, 10 * rounds, lambda f: host_time_us(f, 1))
    row = {
        "name": name,
        "forward_us": t["flashinfer_mla"],
        "flashinfer_run_us": t["flashinfer_run"],
        "forward_over_run": t["flashinfer_mla"] / t["flashinfer_run"],
        "triton_forward_us": t.get("triton"),
        "triton_over_run": t["triton"] / t["flashinfer_run"] if "triton" in t else None,
        "triton_tiles_us": {label[len("triton ") :]: us for label, us in t.items() if label.startswith("triton ")}
        or None,
        "graph_us": g or None,
        "forward_over_run_graph": over_run(g, "flashinfer_mla"),
        "host_plan_over_run_graph": over_run(g, "flashinfer_mla_host_plan"),
        "triton_over_run_graph": over_run(g, "triton"),
        "triton_tiles_over_run_graph": {
            label[len("triton ") :]: over_run(g, label) for label in g if label.startswith("triton ")
        }
        or None,
        "metadata_host_us": h["ours"],
        "flashinfer_plan_host_us": h["fi"],
        "metadata_over_plan": h["ours"] / h["fi"],
        "forward_host_us": hb["forward"],
        "flashinfer_run_host_us": hb["run"],
    }
    if errors:
        row["triton_error"] = errors
    if mode == "DECODE":  # CUDA-graph replay metadata: index launch into the graph's buffers + lean re-plan
        bs = batch.batch_size
        backend.init_cuda_graph_state(bs, bs)
        backend.init_forward_metadata_capture_cuda_graph(
            bs, bs, batch.req_pool_indices, batch.seq_lens, None, batch.forward_mode, None
        )

        replay_args = (bs, batch.req_pool_indices, batch.seq_lens, batch.seq_lens_sum, None, batch.forward_mode, None)

        def replay_meta():  # the engine-facing (SGLang-named) entry point
            backend.init_forward_metadata_replay_cuda_graph(*replay_args, batch.seq_lens_cpu)

        replay_meta()
        row["graph_replay_metadata_host_us"] = statistics.median(host_time_us(replay_meta, 20 * rounds))
    if os.environ.get("ATTN_META_PROFILE"):  # eager metadata first: it rebinds the eager step the forward runs on
        for key, fn in (("profile_metadata", ours_meta), ("profile_forward", ours)):
            row[key] = host_profile(fn)
            print(f"{name}: {key} (own us | cumulative us | function):\n    " + "\n    ".join(row[key]))
    return row


def bench_prefill(
    iters: int, rounds: int, bs: int = 4, new: int = 1024, prefix: int = 3072, capacity: int = 4096
) -> dict:
    ctx, batch, pool = setup("EXTEND", [(prefix, new)] * bs)
    backend = create_backend("flashinfer_mla", ctx)
    plan = backend.plan_prefill(batch, capacity, scaling=SCALE)
    T = batch.num_tokens
    q, k = (torch.randn(T, H, 192, dtype=DTYPE, device="cuda") for _ in range(2))
    v = torch.randn(T, H, 128, dtype=DTYPE, device="cuda")
    chunk_kv = [
        (
            torch.randn(c.num_tokens, H, 192, dtype=DTYPE, device="cuda"),
            torch.randn(c.num_tokens, H, 128, dtype=DTYPE, device="cuda"),
        )
        for c in plan.chunk_plan.chunks
    ]

    def ours():
        plan.attend(q, k, v, lambda c, s: chunk_kv[c.index])

    def direct():  # the same kernels by hand (FlashInfer's merge_state_in_place cannot launch at 128 heads)
        o, s = plan.new.run(q, k, v, return_lse=True)
        for w, (kc, vc) in zip(plan.chunks, chunk_kv):
            o2, s2 = w.run(q, kc, vc, return_lse=True)
            merge_state(o, s, o2, s2, out=o, out_lse=s)

    from flashinfer import BatchPrefillWithRaggedKVCacheWrapper

    whole = BatchPrefillWithRaggedKVCacheWrapper(
        torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda"), "NHD", backend="fa2"
    )
    qo = torch.arange(0, T + 1, new, dtype=torch.int32)
    kvp = torch.arange(0, bs * (prefix + new) + 1, prefix + new, dtype=torch.int32)
    whole.plan(qo, kvp, H, H, 192, head_dim_vo=128, causal=True, sm_scale=SCALE, q_data_type=DTYPE, kv_data_type=DTYPE)
    kw = torch.randn(bs * (prefix + new), H, 192, dtype=DTYPE, device="cuda")
    vw = torch.randn(bs * (prefix + new), H, 128, dtype=DTYPE, device="cuda")

    def unchunked():
        whole.run(q, kw, vw)

    fns = {"ours": ours, "direct": direct, "unchunked": unchunked}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    t = interleaved(fns, rounds, lambda f: gpu_time_us(f, max(1, iters // 10), 3))
    return {
        "name": f"prefill bs{bs} q{new} prefix{prefix} ({len(plan.chunks)} chunks of {plan.chunk_plan.chunk_len})",
        "forward_us": t["ours"],
        "flashinfer_run_us": t["direct"],
        "forward_over_run": t["ours"] / t["direct"],
        "unchunked_ragged_us": t["unchunked"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-prefill", action="store_true", help="skip the DeepSeek prefill row")
    ap.add_argument(
        "--mla-tiles",
        default="",
        help="extra attn-triton MLA kernel variants to time in the same run, e.g. 64x32x8x2:c1,32x64x8x2:c1:l8 "
        "(block_h x block_n x warps x stages, then options cK / lK: see the module doc)",
    )
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph timings (the ratios issue 15 claims)")
    ap.add_argument("--rows", default="", help="comma-separated subset of rows: bs1,bs64,bs128,verify (default all)")
    args = ap.parse_args()
    tiles = parse_tiles(args.mla_tiles)
    if not torch.cuda.is_available():
        raise SystemExit("mla_vs_peers.py needs a CUDA GPU (and flashinfer-python)")
    absorbed = {
        "bs1": ("decode bs1 x 8192", "DECODE", [(8191, 1)]),
        "bs64": ("decode bs64 x 4096", "DECODE", [(4095, 1)] * 64),
        "bs128": ("decode bs128 x 2048", "DECODE", [(2047, 1)] * 128),
        "verify": ("verify bs64 x 4096 (4 drafts)", "TARGET_VERIFY", [(4092, 4)] * 64),
    }
    wanted = [r for r in args.rows.split(",") if r] or list(absorbed)
    unknown = set(wanted) - absorbed.keys()
    if unknown:
        raise SystemExit(f"--rows: unknown {sorted(unknown)} (known: {', '.join(absorbed)})")
    graphs = not args.no_graphs
    rows = [bench_absorbed(*absorbed[key], args.iters, args.rounds, tiles, graphs) for key in wanted]
    if not args.no_prefill:
        rows.append(bench_prefill(args.iters, args.rounds))
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    cols = [
        "forward_us",
        "flashinfer_run_us",
        "forward_over_run",
        "triton_forward_us",
        "triton_over_run",
        "forward_over_run_graph",
        "triton_over_run_graph",
        "metadata_host_us",
        "flashinfer_plan_host_us",
        "host_plan_over_run_graph",
        "metadata_over_plan",
        "graph_replay_metadata_host_us",
        "forward_host_us",
        "flashinfer_run_host_us",
        "unchunked_ragged_us",
    ]
    for r in rows:
        vals = ", ".join(f"{c}={r[c]:.3g}" for c in cols if r.get(c) is not None)
        if r.get("triton_tiles_us"):
            vals += ", triton tiles (eager): " + ", ".join(f"{k}={v:.3g} us" for k, v in r["triton_tiles_us"].items())
        if r.get("graph_us"):
            vals += ", graph: " + ", ".join(f"{k}={v:.3g} us" for k, v in r["graph_us"].items())
        if r.get("triton_tiles_over_run_graph"):
            vals += ", tiles over run (graph): " + ", ".join(
                f"{k}={v:.3g}" for k, v in r["triton_tiles_over_run_graph"].items()
            )
        print(f"{r['name']}: {vals}" + (f" [{r['triton_error']}]" if r.get("triton_error") else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
