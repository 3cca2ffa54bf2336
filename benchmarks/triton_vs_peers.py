"""attn-triton against FlashInfer and torch_native on the docs/design.md §8 shapes (run on a GPU machine).

GQA 32 q / 8 kv heads, head_dim 128, bf16, page size 16 with pages in random order. For every row the
script (1) checks each implementation once against the float64 reference on a subsample (first and last
request; the last 64 queries of extend requests), (2) times each one: FlashInfer and attn-triton inside
CUDA graphs (one captured graph of several calls, replayed; device events; median), torch_native eagerly,
(3) prints a table of times and attn-triton / FlashInfer ratios and writes everything to JSON. Small
decode rows rotate among several independent KV sets so that L2 cannot hold the working set.
`--only fp8` adds the fp8 KV row (issue 16): decode bs64 ctx4096 over a float8_e4m3fn cache with
per-layer k_scale / v_scale, attn-triton fp8 against attn-triton bf16 (same shapes) and FlashInfer's fp8
decode (kv_data_type fp8, run with k_scale / v_scale), each checked against the float64 reference on the
dequantized cache and timed interleaved with the others (`time_graphs_interleaved`); `--fp8-configs` adds
attn-triton fp8 rows with other stage-1 tiles (same format as `--decode-configs`: "n,h,w,s[,v]", v 0 reads V
byte-wise), timed in the same run next to the default. It also measures the host time of attn-triton's
`init_forward_metadata` (no host-device sync allowed: checked with torch's sync debug mode) and of
FlashInfer's plan at batch 1, 64 and 256, with its two parts in the JSON's "metadata" rows: attn-core's
`check_forward_batch` alone and the backend's `build_forward_metadata` alone, and the same step at
validation "full". `ATTN_META_PROFILE=1` adds each row's cProfile of init_forward_metadata ("profile_top",
printed too).
The "mixed" rows time a MIXED step (64 decodes x 4096 keys + one 512-token prefill chunk, decodes first;
and 4 decodes + two 2048-token chunks): attn-triton unsplit (`mixed_split=False`: every request through the
extend kernel) and split (the default: decodes through the decode kernel, the chunks through the extend
kernel), FlashInfer's prefill wrapper over the whole step, and the attn-flashinfer backend unsplit (its
default: ragged over the new tokens + paged over the prefixes, merged) and split (`mixed_split=True`:
decodes through FlashInfer's decode wrapper, the chunks through the prefill plan; to become its default
only if it wins), every one in CUDA graphs (eager where capture fails, marked in the JSON's "timing").

Verify rows (`--only verify`, issue 15): speculative TARGET_VERIFY batches, bs64 x 4096 keys with the
last 4 or 8 of each request new (causal), timed for attn-triton's verify kernel, attn-triton's extend
kernel on the same batch run as EXTEND (the path verify took before), and FlashInfer's paged prefill
(causal); the rate is the bytes of K and V read per second, and the run also measures the device's
copy bandwidth (a plain torch copy of a 2 GiB buffer, bytes read + written per second) to compare with.

FlashAttention-4 rows (`--only fa4`, issue 38): every decode and extend row for fa4 through attn
(`create_backend("fa4")`), FA4's own `flash_attn_varlen_func` on the same pool pages and lengths, attn-triton and
the hybrid the selection names on compute capability 9.0 (`hybrid(prefill=fa4,decode=triton)`), each checked
against float64, timed in CUDA graphs with replays interleaved; aims: fa4 <= 1.03 x FA4's time on the extend
rows, the hybrid <= 1.03 x the faster of its parts on every row.

  python benchmarks/triton_vs_peers.py [--out FILE] [--only decode,extend,verify,mixed,meta,fp8,fa4] [--no-torch-native]
      [--decode-configs "64,16,4,3;32,16,4,4"] [--extend-configs "128,64,8,3;128,128,8,3"] [--waves 1,2,4]
      [--verify-configs "64,128,8,3;64,64,4,3"] [--fp8-configs "128,16,8,2;128,16,8,2,0;16,16,4,5,1,4"]
      [--fp8-waves 1,8]

FlashInfer is used through its own API (BatchDecodeWithPagedKVCacheWrapper with tensor cores,
BatchPrefillWithPagedKVCacheWrapper, causal), planned once per batch outside the timed region. The attn
backends are made with `attn_core.create_backend` and driven through the public contract only; every
timing goes through `attn_core.bench.timing`.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Optional

import torch

from attn_core import (
    AttentionLayer,
    BackendContext,
    ForwardBatch,
    ForwardMode,
    MHATokenToKVPool,
    ReqToTokenPool,
    create_backend,
)
from attn_core.bench.timing import event_times_us, graph_times_us, host_times_us, interleave, interleaved_graph_times_us
from attn_core.contract.validation import check_forward_batch
from attn_core.memory.fp8 import is_fp8
from attn_core.testing.reference import reference_attention, relative_error
from attn_triton.config import DecodeConfig, ExtendConfig, SplitPolicy, VerifyConfig

HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DECODE_ROWS = [
    ("decode bs1 ctx8192", 1, 8192),
    ("decode bs64 ctx4096", 64, 4096),
    ("decode bs256 ctx1024", 256, 1024),
    ("decode bs16 ctx32768", 16, 32768),
]
EXTEND_ROWS = [
    ("extend bs8 q512 prefix3584", 8, 512, 3584),
    ("prefill bs2 q4096", 2, 4096, 0),
    ("extend bs32 q128 prefix2048", 32, 128, 2048),
]
# decodes, their keys, new tokens per prefill chunk (no prefix), chunks; the second row: few decodes
MIXED_ROWS = [("mixed 64x4096 + 1x512", 64, 4096, 512, 1), ("mixed 4x4096 + 2x2048", 4, 4096, 2048, 2)]
VERIFY_ROWS = [
    ("verify bs64 ctx4096 4 drafts", 64, 4096, 4),
    ("verify bs64 ctx4096 8 drafts", 64, 4096, 8),
]
VERIFY_AIM = 0.5  # min attn-triton K/V read rate / measured copy bandwidth (issue 15)
DECODE_TARGET = {"decode bs1 ctx8192": 1.3}  # max attn-triton / FlashInfer time; others 1.05
EXTEND_AIM, EXTEND_FLOOR = 0.8, 0.6  # min attn-triton / FlashInfer TFLOP/s
FP8 = torch.float8_e4m3fn
FP8_ROW = ("decode bs64 ctx4096", 64, 4096)
#: per-layer dequantization factors of the fp8 row: random normal K/V / scale stay well inside ±448
FP8_K_SCALE, FP8_V_SCALE = 0.02, 0.03
FP8_VS_BF16_TARGET, FP8_VS_FI_TARGET = 0.6, 1.05  # max attn-triton fp8 time / bf16 time, / FlashInfer fp8 time
FP8_SWEEP_PREFIX = "attn-triton fp8 tiles "  # times_us key of a `--fp8-configs` entry, then its label


@dataclass
class Workload:
    """One batch over its own paged pool: kv_lens keys per request, the last q_lens of them new."""

    kv_lens: list[int]
    q_lens: list[int]
    pool: MHATokenToKVPool
    rows: ReqToTokenPool
    batch: ForwardBatch
    q: torch.Tensor
    page_indptr: torch.Tensor
    page_indices: torch.Tensor
    last_page_len: torch.Tensor
    qo_indptr: torch.Tensor

    @property
    def decode(self) -> bool:
        return self.batch.forward_mode.is_decode()

    def pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.pool.get_key_buffer(0), self.pool.get_value_buffer(0)
        return k.view(-1, PAGE, HKV, D), v.view(-1, PAGE, HKV, D)


def _new_token_slots(rows: ReqToTokenPool, kv_lens: list[int], q_lens: list[int]) -> torch.Tensor:
    """The slots of each request's new tokens (its last q_len keys), as an engine's out_cache_loc."""
    return torch.cat([rows.req_to_token[r, n - q : n] for r, (n, q) in enumerate(zip(kv_lens, q_lens))]).to(torch.int64)


def make_workload(
    kv_lens: list[int],
    q_lens: list[int],
    decode: bool,
    gen: torch.Generator,
    mixed: bool = False,
    kv_dtype: torch.dtype = DTYPE,
) -> Workload:
    dev = torch.device("cuda")
    bs = len(kv_lens)
    n_pages = [-(-n // PAGE) for n in kv_lens]
    total_pages = sum(n_pages)
    pool = MHATokenToKVPool(total_pages * PAGE, PAGE, kv_dtype, HKV, D, 1, dev)
    if is_fp8(kv_dtype):  # random normal K/V in every slot, quantized by the pool's own write (e4m3(x / scale))
        shape = pool.get_key_buffer(0).shape
        k, v = (torch.empty(shape, dtype=torch.float32, device=dev).normal_(generator=gen) for _ in range(2))
        every_slot = torch.arange(shape[0], device=dev)
        pool.set_kv_buffer(FP8_LAYER, every_slot, k, v, k_scale=FP8_K_SCALE, v_scale=FP8_V_SCALE)
        del k, v, every_slot
    else:
        pool.get_key_buffer(0).normal_(generator=gen)
        pool.get_value_buffer(0).normal_(generator=gen)
    width = -(-max(kv_lens) // PAGE) * PAGE
    rows = ReqToTokenPool(bs, width, dev)
    perm = torch.randperm(total_pages, device=dev, generator=gen).to(torch.int32) + 1  # page 0 is the dummy
    offs = torch.arange(PAGE, device=dev, dtype=torch.int32)
    start = 0
    for r, (n, p) in enumerate(zip(kv_lens, n_pages)):
        mine = perm[start : start + p]
        rows.req_to_token[r, :n] = (mine[:, None] * PAGE + offs).reshape(-1)[:n]
        start += p
    page_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
    page_indptr[1:] = torch.tensor(n_pages, device=dev).cumsum(0)
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(kv_lens, n_pages)], dtype=torch.int32, device=dev)
    qo_cpu = torch.zeros(bs + 1, dtype=torch.int32)
    qo_cpu[1:] = torch.tensor(q_lens).cumsum(0)
    T = int(qo_cpu[-1])
    seq_cpu = torch.tensor(kv_lens, dtype=torch.int32)
    q_lens_cpu = torch.tensor(q_lens, dtype=torch.int32)
    batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE if decode else (ForwardMode.MIXED if mixed else ForwardMode.EXTEND),
        batch_size=bs,
        req_pool_indices=torch.arange(bs, dtype=torch.int64, device=dev),
        seq_lens=seq_cpu.to(dev),
        seq_lens_cpu=seq_cpu,
        seq_lens_sum=int(seq_cpu.sum()),
        out_cache_loc=_new_token_slots(rows, kv_lens, q_lens),
        positions=torch.zeros(T, dtype=torch.int64, device=dev),
        req_to_token_pool=rows,
        token_to_kv_pool=pool,
    )
    if not decode:
        batch.extend_prefix_lens = (seq_cpu - q_lens_cpu).to(dev)
        batch.extend_prefix_lens_cpu = seq_cpu - q_lens_cpu
        batch.extend_seq_lens = q_lens_cpu.to(dev)
        batch.extend_seq_lens_cpu = q_lens_cpu
        batch.extend_start_loc = qo_cpu[:-1].to(dev)
        batch.extend_num_tokens = T
    q = torch.randn(T, HQ, D, device=dev, dtype=torch.float32, generator=gen).to(DTYPE)
    return Workload(kv_lens, q_lens, pool, rows, batch, q, page_indptr, perm, last, qo_cpu.to(dev))


def make_context(w: Workload, validation: str = "basic") -> BackendContext:
    modes = {"extend", "decode", "mixed"} if w.batch.forward_mode.is_mixed() else {"extend", "decode"}
    return BackendContext(
        device="cuda",
        dtype=DTYPE,
        kv_dtype=w.pool.dtype,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        page_size=PAGE,
        max_batch_size=len(w.kv_lens),
        max_context_len=w.rows.max_context_len,
        req_to_token_pool=w.rows,
        token_to_kv_pool=w.pool,
        validation=validation,
        forward_modes=modes,
    )


LAYER = AttentionLayer(0, HQ, HKV, D)
FP8_LAYER = AttentionLayer(0, HQ, HKV, D, k_scale=FP8_K_SCALE, v_scale=FP8_V_SCALE)


def layer_of(w: Workload) -> AttentionLayer:
    """The layer a workload runs: with k_scale / v_scale over an fp8 pool."""
    return FP8_LAYER if is_fp8(w.pool.dtype) else LAYER


# ---- implementations: each returns a zero-argument callable that computes the whole batch ----------
def triton_impl(
    w: Workload, decode_cfg=None, extend_cfg=None, policy=None, verify_cfg=None, mode=None, mixed_split=False
) -> Callable[[], torch.Tensor]:
    """attn-triton on the workload's batch; `mode` runs a copy of the batch in another forward mode
    (a verify batch as EXTEND: the extend kernel on the same queries and keys)."""
    batch = w.batch if mode is None else replace(w.batch, forward_mode=mode)
    configs = dict(decode_config=decode_cfg, extend_config=extend_cfg, verify_config=verify_cfg, split_policy=policy)
    backend = create_backend("triton", make_context(w), mixed_split=mixed_split, **configs)
    backend.init_forward_metadata(batch)
    batch.attn_backend = backend
    layer = layer_of(w)
    return lambda: backend.forward(w.q, None, None, layer, batch, save_kv_cache=False)


def torch_native_impl(w: Workload) -> Callable[[], torch.Tensor]:
    backend = create_backend("torch_native", make_context(w))
    backend.init_forward_metadata(w.batch)
    return lambda: backend.forward(w.q, None, None, LAYER, w.batch, save_kv_cache=False)


def flashinfer_backend_impl(w: Workload, mixed_split: bool = False) -> Callable[[], torch.Tensor]:
    """The attn-flashinfer backend on the workload's batch (its ragged pass reads the new tokens' K/V:
    given as the pool holds them, nothing is written)."""
    backend = create_backend("flashinfer", make_context(w), mixed_split=mixed_split)
    backend.init_forward_metadata(w.batch)
    w.batch.attn_backend = backend
    slots = w.batch.out_cache_loc
    k_new, v_new = w.pool.get_key_buffer(0)[slots], w.pool.get_value_buffer(0)[slots]
    layer = layer_of(w)
    return lambda: backend.forward(w.q, k_new, v_new, layer, w.batch, save_kv_cache=False)


def flashinfer_impl(w: Workload) -> Callable[[], torch.Tensor]:
    import flashinfer

    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    common = dict(q_data_type=DTYPE, kv_data_type=w.pool.dtype, sm_scale=LAYER.scaling)
    if w.decode:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        wrapper.plan(w.page_indptr, w.page_indices, w.last_page_len, HQ, HKV, D, PAGE, **common)
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        wrapper.plan(
            w.qo_indptr, w.page_indptr, w.page_indices, w.last_page_len, HQ, HKV, D, PAGE, causal=True, **common
        )
    pages = w.pages()
    if is_fp8(w.pool.dtype):  # FlashInfer folds k_scale into the softmax scale and scales the output by v_scale
        return lambda: wrapper.run(w.q, pages, k_scale=FP8_K_SCALE, v_scale=FP8_V_SCALE)
    return lambda: wrapper.run(w.q, pages)


# ---- checking and timing ---------------------------------------------------------------------------
def check(w: Workload, out: torch.Tensor) -> float:
    """Max relative error over the first and last request (last 64 queries of each) vs float64 (on the
    dequantized cache for an fp8 pool)."""
    out = out.reshape(-1, HQ, D)
    worst = 0.0
    layer = layer_of(w)
    k_buf = w.pool.get_key_buffer(0).double() * (layer.k_scale or 1.0)
    v_buf = w.pool.get_value_buffer(0).double() * (layer.v_scale or 1.0)
    for r in sorted({0, len(w.kv_lens) - 1}):
        n, ql = w.kv_lens[r], w.q_lens[r]
        slots = w.rows.req_to_token[r, :n].long()
        take = min(ql, 64)
        q0 = int(w.qo_indptr[r]) + ql - take
        pos = torch.arange(n - take, n)
        ref, _ = reference_attention(
            w.q[q0 : q0 + take], k_buf[slots], v_buf[slots], q_positions=pos, scale=LAYER.scaling
        )
        worst = max(worst, relative_error(out[q0 : q0 + take], ref))
    return worst


def time_graph(fns: list[Callable], calls: int, reps: int) -> float:
    """Median µs per call: `calls` rounds over `fns` captured in one CUDA graph, replayed `reps` times."""
    return statistics.median(graph_times_us(fns, calls, reps))


def time_graphs_interleaved(groups: dict[str, list[Callable]], calls: int, reps: int) -> dict[str, float]:
    """`time_graph` for several implementations at once, their replays interleaved (each round starting one
    group later: `attn_core.bench.timing.interleaved_graph_times_us`); the median µs per call of each group."""
    return {name: statistics.median(us) for name, us in interleaved_graph_times_us(groups, calls, reps).items()}


def time_eager(fns: list[Callable], calls: int, reps: int) -> float:
    """Median µs per call of `calls` eager rounds over `fns` between two CUDA events, `reps` samples."""

    def run():
        for _ in range(calls):
            for f in fns:
                f()

    run()
    torch.cuda.synchronize()
    return statistics.median(event_times_us(run, reps)) / (calls * len(fns))


@dataclass
class RowResult:
    name: str
    kind: str
    work: float  # bytes (decode) or FLOPs (extend)
    times_us: dict[str, float] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    timing: dict[str, str] = field(default_factory=dict)
    sweep: list[dict] = field(default_factory=list)

    def rate(self, impl: str) -> Optional[float]:
        t = self.times_us.get(impl)
        if not t:
            return None
        return self.work / (t * 1e-6) / 1e12  # TB/s or TFLOP/s

    def ratio(self) -> Optional[float]:
        t, f = self.times_us.get("attn-triton"), self.times_us.get("flashinfer")
        return t / f if t and f else None


def row_workloads(
    kind: str, spec: tuple, gen: torch.Generator, l2_bytes: int, kv_dtype: torch.dtype = DTYPE
) -> list[Workload]:
    if kind == "verify":
        _, bs, ctx, drafts = spec
        w = make_workload([ctx] * bs, [drafts] * bs, False, gen)
        w.batch.forward_mode = ForwardMode.TARGET_VERIFY  # no custom mask: the causal chain
        return [w]
    if kind == "decode":
        _, bs, ctx = spec
        kv, q = [ctx] * bs, [1] * bs
        per_set = bs * ctx * HKV * D * 2 * 2
        sets = min(8, max(1, math.ceil(3 * l2_bytes / per_set)))
    else:
        _, bs, ql, prefix = spec
        kv, q = [prefix + ql] * bs, [ql] * bs
        sets = 1
    return [make_workload(kv, q, kind == "decode", gen, kv_dtype=kv_dtype) for _ in range(sets)]


def run_mixed_row(spec: tuple, args, gen: torch.Generator) -> RowResult:
    """A MIXED step: attn-triton unsplit and split, FlashInfer's prefill wrapper, attn-flashinfer unsplit
    and split, in CUDA graphs (eagerly where capture fails)."""
    name, decodes, ctx, chunk, chunks = spec
    w = make_workload([ctx] * decodes + [chunk] * chunks, [1] * decodes + [chunk] * chunks, False, gen, mixed=True)
    res = RowResult(name, "mixed", work_of("mixed", w))
    impls = {"attn-triton": lambda: triton_impl(w), "attn-triton split": lambda: triton_impl(w, mixed_split=True)}
    if not args.no_flashinfer:
        impls["flashinfer"] = lambda: flashinfer_impl(w)
        impls["attn-flashinfer"] = lambda: flashinfer_backend_impl(w)
        impls["attn-flashinfer split"] = lambda: flashinfer_backend_impl(w, mixed_split=True)
    for impl, make in impls.items():
        try:
            fn = make()
            res.errors[impl] = check(w, fn())  # the first request (a decode) and the chunk
        except Exception as exc:
            print(f"  {impl} failed: {exc!r:.300}", flush=True)
            continue
        try:
            res.times_us[impl] = time_graph([fn], 3, args.reps)
            res.timing[impl] = "cuda graph"
        except Exception as exc:
            print(f"  {impl} graph capture failed ({exc!r:.120}); timing eagerly", flush=True)
            res.times_us[impl] = time_eager([fn], 3, args.reps)
            res.timing[impl] = "eager"
    return res


def print_mixed_table(rows: list[RowResult]) -> str:
    """The mixed rows: times, unsplit / split (> 1: the split is faster) and split / FlashInfer, for
    attn-triton, then for attn-flashinfer (its unsplit / split time, and its split / FlashInfer's wrapper)."""
    lines = [
        "| row | attn-triton unsplit µs | attn-triton split µs | FlashInfer µs | unsplit/split time | split/FI time "
        "| attn-flashinfer unsplit µs | attn-flashinfer split µs "
        "| FI-backend unsplit/split time | FI-backend split/FI time |",
        "|" + "---|" * 10,
    ]

    def fmt(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    def ratio(a, b):
        return fmt(a / b if a and b else None, ".3f")

    for r in rows:
        t = r.times_us
        u, s, f = t.get("attn-triton"), t.get("attn-triton split"), t.get("flashinfer")
        bu, bs = t.get("attn-flashinfer"), t.get("attn-flashinfer split")
        lines.append(
            f"| {r.name} | {fmt(u)} | {fmt(s)} | {fmt(f)} | {ratio(u, s)} | {ratio(s, f)} "
            f"| {fmt(bu)} | {fmt(bs)} | {ratio(bu, bs)} | {ratio(bs, f)} |"
        )
    return "\n".join(lines)


def work_of(kind: str, w: Workload) -> float:
    """The work a row's throughput is measured in: for "decode" and "verify", the bytes of fp16 K and V
    read once (keys x HKV x D x 2 bytes x 2); for an extend kind, the FLOPs of QK^T and PV over the causal
    (query, key) pairs (4 x HQ x D per pair; a request of n keys, q of them new, has
    q * (n - q) + q * (q + 1) / 2 pairs).

    Example (HQ 32, HKV 8, D 128): decode with kv_lens [1000, 1000] → 8,192,000.0 bytes; extend with
    kv_lens [10], q_lens [4] (34 pairs) → 557,056.0 FLOPs.
    """
    if kind in ("decode", "verify"):
        return float(sum(w.kv_lens) * HKV * D * 2 * 2)
    pairs = sum(q * (n - q) + q * (q + 1) / 2 for n, q in zip(w.kv_lens, w.q_lens))
    return 4.0 * HQ * D * pairs


def parse_configs(text: Optional[str], cls):
    """The kernel tile configs of a `--decode-configs` / `--extend-configs` value: items split by ";",
    each four comma-separated ints passed positionally to `cls` (a fifth is DecodeConfig's `fp8_v_words`,
    0 or 1, or ExtendConfig's `lazy_rescale`, 0..8; ExtendConfig's sixth and
    seventh are `wgmma_block_n` and `wgmma_stages`, the Hopper kernel's tiles, an eighth `wgmma_regs`, its
    consumers' registers a thread, and a ninth `wgmma_clean_masked`, 0 or 1); `[None]` (the kernel's own choice)
    when `text` is empty or None.

    Example: `parse_configs("64,16,4,3;32,16,4,4", DecodeConfig)` →
    `[DecodeConfig(64, 16, 4, 3), DecodeConfig(32, 16, 4, 4)]`; `parse_configs(None, DecodeConfig)` → `[None]`.
    """
    if not text:
        return [None]
    out = []
    for item in text.split(";"):
        values: list = [int(x) for x in item.split(",")]
        if cls is ExtendConfig and len(values) > 8:
            values[8] = bool(values[8])  # wgmma_clean_masked
        out.append(cls(*values))
    return out


def run_row(kind: str, spec: tuple, args, gen: torch.Generator, l2: int) -> RowResult:
    loads = row_workloads(kind, spec, gen, l2)
    res = RowResult(spec[0], kind, work_of(kind, loads[0]))
    calls = 3 if kind == "extend" else 20
    # attn-triton, with an optional sweep over tile configs and split waves
    variants = []
    if kind == "decode":
        for cfg in parse_configs(args.decode_configs, DecodeConfig):
            for waves in args.waves or [None]:
                variants.append(
                    (
                        cfg,
                        None,
                        None if waves is None else SplitPolicy(waves=waves, min_split_len=args.min_split_len),
                        None,
                    )
                )
    elif kind == "verify":
        variants = [(None, None, None, cfg) for cfg in parse_configs(args.verify_configs, VerifyConfig)]
    else:
        variants = [(None, cfg, None, None) for cfg in parse_configs(args.extend_configs, ExtendConfig)]
    best = None
    for dcfg, ecfg, policy, vcfg in variants:
        tiles = {"decode": _cfg(dcfg), "extend": _cfg(ecfg), "policy": _cfg(policy), "verify": _cfg(vcfg)}
        try:
            fns = [triton_impl(w, dcfg, ecfg, policy, vcfg) for w in loads]
            err = check(loads[0], fns[0]())
            t = time_graph(fns, calls, args.reps)
        except Exception as exc:  # a config that does not compile (shared memory) is reported, not fatal
            res.sweep.append({**tiles, "error": repr(exc)[:300]})
            continue
        res.sweep.append({**tiles, "us": t, "err": err})
        if best is None or t < best[0]:
            best = (t, err)
    if best is not None:
        res.times_us["attn-triton"], res.errors["attn-triton"] = best
        res.timing["attn-triton"] = "cuda graph"
    if kind == "verify":  # the same batch through the extend kernel (as EXTEND): the path verify took before
        fns = [triton_impl(w, mode=ForwardMode.EXTEND) for w in loads]
        res.errors["attn-triton extend kernel"] = check(loads[0], fns[0]())
        res.times_us["attn-triton extend kernel"] = time_graph(fns, calls, args.reps)
        res.timing["attn-triton extend kernel"] = "cuda graph"
    if not args.no_flashinfer:
        try:
            fns = [flashinfer_impl(w) for w in loads]
            res.errors["flashinfer"] = check(loads[0], fns[0]())
            try:
                res.times_us["flashinfer"] = time_graph(fns, calls, args.reps)
                res.timing["flashinfer"] = "cuda graph"
            except Exception as exc:
                print(f"  flashinfer graph capture failed ({exc!r:.120}); timing eagerly", flush=True)
                res.times_us["flashinfer"] = time_eager(fns, calls, args.reps)
                res.timing["flashinfer"] = "eager"
        except Exception as exc:
            print(f"  flashinfer failed: {exc!r:.300}", flush=True)
    if not args.no_torch_native:
        try:
            fn = torch_native_impl(loads[0])
            res.errors["torch_native"] = check(loads[0], fn())
            res.times_us["torch_native"] = time_eager([fn], 1, 3)
            res.timing["torch_native"] = "eager"
            del fn
        except Exception as exc:
            print(f"  torch_native failed: {exc!r:.200}", flush=True)
        torch.cuda.empty_cache()
    return res


def run_fp8_row(args, gen: torch.Generator, l2: int) -> RowResult:
    """FP8_ROW timed three ways in one run: attn-triton over an fp8 cache ("attn-triton fp8"), over a
    bf16 cache ("attn-triton bf16"), FlashInfer's fp8 decode ("flashinfer fp8"); `work` is the fp8 bytes
    of K and V read (1 byte per element)."""
    _, bs, ctx = FP8_ROW
    res = RowResult(f"fp8 {FP8_ROW[0]}", "decode", float(bs * ctx * HKV * D * 2))

    impls = [("attn-triton fp8", FP8, triton_impl), ("attn-triton bf16", DTYPE, triton_impl)]
    tiles = parse_configs(args.fp8_configs, DecodeConfig) if args.fp8_configs else []
    for cfg in ([None] if args.fp8_waves else []) + tiles:
        for waves in args.fp8_waves or [None]:
            policy = None if waves is None else SplitPolicy(waves=waves, min_split_len=args.min_split_len)
            label = ("default" if cfg is None else fp8_config_label(cfg)) + (
                "" if waves is None else f" waves {waves:g}"
            )
            impls.append(
                (f"{FP8_SWEEP_PREFIX}{label}", FP8, functools.partial(triton_impl, decode_cfg=cfg, policy=policy))
            )
    if not args.no_flashinfer:
        impls.append(("flashinfer fp8", FP8, flashinfer_impl))
    loads = {dt: row_workloads("decode", FP8_ROW, gen, l2, dt) for dt in (FP8, DTYPE)}  # one cache a dtype, for all
    groups = {}
    for name, kv_dtype, impl in impls:
        try:
            fns = [impl(w) for w in loads[kv_dtype]]
            res.errors[name] = check(loads[kv_dtype][0], fns[0]())
            groups[name] = fns
        except Exception as exc:  # reported, not fatal: the other columns still print
            print(f"  {name} failed: {exc!r:.300}", flush=True)
    # interleaved: in one run the same launch read ~2.5 % slower timed first than timed later
    # (docs/dev/perf-notebook.md, the fp8 section)
    for name, us in time_graphs_interleaved(groups, 20, args.reps).items():
        res.times_us[name], res.timing[name] = us, "cuda graph, interleaved"
    del loads, groups
    torch.cuda.empty_cache()
    return res


def fp8_config_label(cfg) -> str:
    """A `--fp8-configs` entry as it is named in the fp8 table: `DecodeConfig(128, 16, 8, 2)` → "128,16,8,2";
    V read byte-wise (`fp8_v_words` False) adds ",0"."""
    label = f"{cfg.block_n},{cfg.block_h},{cfg.num_warps},{cfg.num_stages}"
    return label + ("" if cfg.fp8_v_words else ",0")


def print_fp8_table(r: RowResult) -> str:
    """The fp8 row: times, attn-triton fp8 / bf16 and fp8 / FlashInfer fp8 time ratios against targets;
    one more line per `--fp8-configs` tile (the same bf16 and FlashInfer times)."""
    t16, fi8 = (r.times_us.get(k) for k in ("attn-triton bf16", "flashinfer fp8"))

    def ratio(a, b):
        return None if not a or not b else a / b

    def fmt(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    def line(name: str, t8: Optional[float]) -> str:
        vs16, vsfi = ratio(t8, t16), ratio(t8, fi8)
        ok16 = "-" if vs16 is None else ("yes" if vs16 <= FP8_VS_BF16_TARGET else "no")
        okfi = "-" if vsfi is None else ("yes" if vsfi <= FP8_VS_FI_TARGET else "no")
        return (
            f"| {name} | {fmt(t8)} | {fmt(t16)} | {fmt(fi8)} | {fmt(vs16, '.3f')} | {fmt(vsfi, '.3f')} "
            f"| {ok16} | {okfi} |"
        )

    sweep = [k for k in r.times_us if k.startswith(FP8_SWEEP_PREFIX)]
    return "\n".join(
        [
            "| row | attn-triton fp8 µs | attn-triton bf16 µs | FlashInfer fp8 µs | fp8/bf16 time | fp8/FI fp8 time | "
            f"≤ {FP8_VS_BF16_TARGET} | ≤ {FP8_VS_FI_TARGET} |",
            "|---|---|---|---|---|---|---|---|",
            line(r.name, r.times_us.get("attn-triton fp8")),
        ]
        + [line(f"{r.name}, tiles {k[len(FP8_SWEEP_PREFIX) :]}", r.times_us[k]) for k in sweep]
    )


def _cfg(c) -> Optional[dict]:
    return None if c is None else asdict(c)


def _host_us(fn: Callable, n: int, idle: bool = True) -> list[float]:
    """Host µs of `n` calls of `fn`, each started with the GPU idle (`idle`: a device sync before each
    call, outside the timed region, as for FlashInfer's plan below). Back-to-back calls without it time
    the GPU once its queue fills: the index kernel of a large batch can take longer than its launch."""
    return host_times_us(fn, n, "cuda", idle=idle)


def _p90(samples: list[float]) -> float:
    """The 90th percentile of `samples` (the sample at index int(0.9 n) of the sorted list).

    >>> _p90([float(i) for i in range(10)])
    9.0
    """
    return sorted(samples)[int(0.9 * len(samples))]


def metadata_host_times(batch_sizes=(1, 64, 256), ctx_len: int = 4096, n: int = 300) -> list[dict]:
    """Host µs of init_forward_metadata (DECODE; median and p90 of `n` calls) and of FlashInfer's
    decode plan. A second pass runs the calls under torch's sync debug mode "error", so any
    host-device sync raises. Also its two parts (attn-core's validation, the backend's build) and the
    step at validation "full"."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    interleaved = _metadata_interleaved(batch_sizes, ctx_len, gen)
    out = []
    for bs in batch_sizes:
        try:
            row = _metadata_row(bs, ctx_len, n, gen)
        except Exception as exc:  # report and go on: the timing table above still prints
            row = {"bs": bs, "error": repr(exc)[:300]}
        row.update(interleaved.get(bs, {}))
        out.append(row)
        top = row.pop("profile_top", None)
        print(f"  metadata bs={bs}: {row}", flush=True)
        if top is not None:
            print("    own µs/call | cumulative µs/call | function\n    " + "\n    ".join(top), flush=True)
            row["profile_top"] = top
    return out


def _metadata_interleaved(batch_sizes, ctx_len: int, gen: torch.Generator, rounds: int = 12, calls: int = 40) -> dict:
    """{bs: {"attn_triton_us_interleaved_median": µs, "..._p90": µs}}: init_forward_metadata of every batch
    size in turn, `rounds` rounds of `calls` calls each (GPU idle before each call), so the host's drift
    (clock, other processes) hits every batch size alike; the per-row numbers of `_metadata_row` are
    taken one batch size after another and drift between rows by up to ~10 µs on the lent host."""
    steps = {}
    for bs in batch_sizes:
        w, backend = _warm_decode_backend(bs, ctx_len, gen)
        steps[bs] = functools.partial(backend.init_forward_metadata, w.batch)
    samples = interleave({bs: functools.partial(_host_us, step, calls) for bs, step in steps.items()}, rounds)
    torch.cuda.synchronize()
    return {
        bs: {"attn_triton_us_interleaved_median": statistics.median(v), "attn_triton_us_interleaved_p90": _p90(v)}
        for bs, v in samples.items()
    }


def _warm_decode_backend(bs: int, ctx_len: int, gen: torch.Generator):
    """(workload, attn-triton backend) of a DECODE step of `bs` requests with `ctx_len` keys each, the
    step's metadata built 20 times first (compiles, scratch sizes)."""
    w = make_workload([ctx_len] * bs, [1] * bs, True, gen)
    return w, _warm_backend(w, "basic")


def _warm_backend(w: Workload, validation: str):
    """attn-triton over `w` at batch validation level `validation`, its step's metadata built 20 times."""
    backend = create_backend("triton", make_context(w, validation=validation))
    for _ in range(20):
        backend.init_forward_metadata(w.batch)
    return backend


def _metadata_row(bs: int, ctx_len: int, n: int, gen: torch.Generator) -> dict:

    w, backend = _warm_decode_backend(bs, ctx_len, gen)
    torch.cuda.synchronize()
    samples = _host_us(lambda: backend.init_forward_metadata(w.batch), n)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _host_us(lambda: backend.init_forward_metadata(w.batch), 20, idle=False)
        sync = "none (sync debug mode 'error')"
    except RuntimeError as exc:
        sync = f"SYNC: {exc!r:.100}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # the parts of init_forward_metadata: attn-core's batch validation alone, the backend's build alone
    ctx = make_context(w)
    validation = _host_us(lambda: check_forward_batch(w.batch, w.rows.req_to_token, w.pool, ctx), n)
    build = _host_us(lambda: backend.build_forward_metadata(w.batch), n)
    profile = _metadata_profile(backend, w.batch) if os.environ.get("ATTN_META_PROFILE") else None
    full = _warm_backend(w, "full")  # + the device checks: one sync per step
    full_samples = _host_us(lambda: full.init_forward_metadata(w.batch), n)
    torch.cuda.synchronize()
    row = {
        "bs": bs,
        "attn_triton_us_median": statistics.median(samples),
        "attn_triton_us_p90": _p90(samples),
        "check_forward_batch_us_median": statistics.median(validation),
        "build_forward_metadata_us_median": statistics.median(build),
        "validation_full_us_median": statistics.median(full_samples),
        "sync": sync,
    }
    if profile is not None:
        row["profile_top"] = profile
    try:
        import flashinfer

        ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        args = (w.page_indptr, w.page_indices, w.last_page_len, HQ, HKV, D, PAGE)

        def plan():
            wrapper.plan(*args, q_data_type=DTYPE, kv_data_type=DTYPE)

        for _ in range(10):  # warm-up
            plan()
        row["flashinfer_plan_us_median"] = statistics.median(_host_us(plan, 50))
    except Exception as exc:
        row["flashinfer_plan_error"] = repr(exc)[:200]
    return row


def _metadata_profile(backend, batch, calls: int = 2000, top: int = 25) -> list[str]:
    """cProfile of `calls` init_forward_metadata calls (GPU idle before each): the `top` functions by
    own time, as lines "own µs per call | cumulative µs per call | function" (profiling inflates
    small Python functions; the ranking is the point)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        prof.enable()
        backend.init_forward_metadata(batch)
        prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        f"{tt / calls * 1e6:8.2f} | {ct / calls * 1e6:8.2f} | {pstats.func_std_string(f)}"
        for f, (_, _, tt, ct, _) in rows
    ]


def copy_bandwidth_tb_s(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """The device's copy bandwidth in TB/s: a plain torch copy of an `nbytes` buffer into another,
    counting the bytes read and written (2 x nbytes per copy); median of `reps` timed copies."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    us = statistics.median(event_times_us(lambda: dst.copy_(src), reps))
    return 2 * nbytes / (us * 1e-6) / 1e12


def print_verify_table(rows: list[RowResult], copy_tb_s: float) -> str:
    """The verify rows: times, K/V read rates and their share of the measured copy bandwidth."""
    impls = ["attn-triton", "attn-triton extend kernel", "flashinfer"]
    lines = [
        f"measured copy bandwidth (read + write): {copy_tb_s:.2f} TB/s",
        "| row | "
        + " | ".join(f"{i} µs (TB/s, % of copy)" for i in impls)
        + f" | triton/FI time | ≥ {VERIFY_AIM:.0%} of copy |",
        "|---|" + "---|" * (len(impls) + 2),
    ]
    for r in rows:
        cells = []
        for i in impls:
            t, rate = r.times_us.get(i), r.rate(i)
            cells.append("-" if t is None else f"{t:.1f} ({rate:.2f}, {rate / copy_tb_s:.0%})")
        ratio, rate = r.ratio(), r.rate("attn-triton")
        ok = "-" if rate is None else ("yes" if rate >= VERIFY_AIM * copy_tb_s else "no")
        lines.append(f"| {r.name} | " + " | ".join(cells) + f" | {'-' if ratio is None else f'{ratio:.3f}'} | {ok} |")
    return "\n".join(lines)


def print_table(rows: list[RowResult]) -> str:
    cols = [
        "attn-triton µs",
        "FlashInfer µs",
        "torch_native µs",
        "triton/FI time",
        "attn-triton rate",
        "FlashInfer rate",
        "target",
        "ok",
    ]
    head = f"| {'row':28s} | " + " | ".join(cols) + " |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        unit = "TB/s" if r.kind == "decode" else "TFLOP/s"
        ratio = r.ratio()
        if r.kind == "decode":
            limit = DECODE_TARGET.get(r.name, 1.05)
            target = f"≤ {limit:.2f}× time"
            ok = "yes" if ratio is not None and ratio <= limit else "no"
        else:
            target = f"≥ {EXTEND_AIM}× rate (floor {EXTEND_FLOOR})"
            speed = None if ratio is None else 1.0 / ratio
            ok = (
                "-"
                if speed is None
                else ("yes" if speed >= EXTEND_AIM else ("floor" if speed >= EXTEND_FLOOR else "no"))
            )

        def fmt(x, spec=".1f"):
            return "-" if x is None else format(x, spec)

        lines.append(
            f"| {r.name:28s} | {fmt(r.times_us.get('attn-triton'))} | {fmt(r.times_us.get('flashinfer'))} | "
            f"{fmt(r.times_us.get('torch_native'))} | {fmt(ratio, '.3f')} | "
            f"{fmt(r.rate('attn-triton'), '.2f')} {unit} | "
            f"{fmt(r.rate('flashinfer'), '.2f')} {unit} | {target} | {ok} |"
        )
    return "\n".join(lines)


# ---- FlashAttention-4 (attn-flashattention, issue 38): fa4 through attn, FA4 itself, the hybrid ----------
FA4_HYBRID = "hybrid(prefill=fa4,decode=triton)"  # what select_backend names on compute capability 9.0


def backend_impl(name: str, w: Workload) -> Callable[[], torch.Tensor]:
    """Backend `name` (a composed name too) made by `create_backend` on the workload's batch, K/V as cached."""
    backend = create_backend(name, make_context(w))
    backend.init_forward_metadata(w.batch)
    w.batch.attn_backend = backend
    return lambda: backend.forward(w.q, None, None, LAYER, w.batch, save_kv_cache=False)


def fa4_direct_impl(w: Workload) -> Callable[[], torch.Tensor]:
    """FlashAttention-4's own `flash_attn_varlen_func` on the same pool pages, queries and lengths, its page
    table made here from the workload's page list (planned nothing: FA4 has no plan)."""
    from flash_attn.cute import flash_attn_varlen_func

    indptr = w.page_indptr.tolist()
    table = torch.zeros(
        len(w.kv_lens), max(b - a for a, b in zip(indptr, indptr[1:])), dtype=torch.int32, device="cuda"
    )
    for r, (a, b) in enumerate(zip(indptr, indptr[1:])):
        table[r, : b - a] = w.page_indices[a:b]
    k, v = w.pages()
    args = dict(cu_seqlens_q=w.qo_indptr, max_seqlen_q=max(w.q_lens), seqused_k=w.batch.seq_lens, page_table=table)
    return lambda: flash_attn_varlen_func(w.q, k, v, softmax_scale=LAYER.scaling, causal=True, **args)[0]


def run_fa4_row(kind: str, spec: tuple, args, gen: torch.Generator, l2: int) -> RowResult:
    """One decode or extend row: fa4 through attn, FA4 called directly, attn-triton and the hybrid, each
    checked against the float64 reference, then timed in CUDA graphs with their replays interleaved."""
    loads = row_workloads(kind, spec, gen, l2)
    res = RowResult(spec[0], f"fa4 {kind}", work_of(kind, loads[0]))
    impls = {"fa4": lambda w: backend_impl("fa4", w), "FA4 direct": fa4_direct_impl}
    impls.update({"attn-triton": lambda w: backend_impl("triton", w), "hybrid": lambda w: backend_impl(FA4_HYBRID, w)})
    groups = {}
    for name, make in impls.items():
        try:
            groups[name] = [make(w) for w in loads]
            res.errors[name] = check(loads[0], groups[name][0]())
        except Exception as exc:
            groups.pop(name, None)
            print(f"  {name} failed: {exc!r:.300}", flush=True)
    res.times_us.update(time_graphs_interleaved(groups, 3 if kind == "extend" else 20, args.reps))
    res.timing.update({name: "cuda graph" for name in groups})
    return res


def print_fa4_table(rows: list[RowResult]) -> str:
    """fa4 through attn against FA4 itself (aim: <= 1.03 x its time on every prefill/extend row) and the
    hybrid against the faster of its two parts (aim: <= 1.03 x on every row)."""
    lines = [
        "| row | fa4 µs | FA4 direct µs | fa4 / FA4 time | attn-triton µs | hybrid µs "
        "| hybrid / faster part | fa4 rate |",
        "|" + "---|" * 8,
    ]

    def fmt(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    for r in rows:
        t = r.times_us
        a, d, tri, h = t.get("fa4"), t.get("FA4 direct"), t.get("attn-triton"), t.get("hybrid")
        parts = [x for x in (a, tri) if x]
        best = min(parts) if len(parts) == 2 else None
        unit = "TFLOP/s" if r.kind.endswith("extend") else "TB/s"
        lines.append(
            f"| {r.name} | {fmt(a)} | {fmt(d)} | {fmt(a / d if a and d else None, '.3f')} | {fmt(tri)} | {fmt(h)} "
            f"| {fmt(h / best if h and best else None, '.3f')} | {fmt(r.rate('fa4'), '.1f')} {unit} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "triton_vs_peers.json"))
    p.add_argument("--only", default="decode,extend,verify,mixed,meta,fp8")
    p.add_argument("--no-torch-native", action="store_true")
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--decode-configs", default=None, help='"block_n,block_h,warps,stages;..."')
    p.add_argument(
        "--extend-configs",
        default=None,
        help='"block_m,block_n,warps,stages[,lazy[,wgmma_block_n,wgmma_stages[,wgmma_regs]]];..."',
    )
    p.add_argument("--verify-configs", default=None, help='"block_m_max,block_n,warps,stages;..."')
    p.add_argument(
        "--fp8-configs",
        default=None,
        help='extra fp8 decode rows: "block_n,block_h,warps,stages[,v_words];..."',
    )
    p.add_argument("--waves", default=None, help="comma list of split-policy waves to sweep")
    p.add_argument(
        "--fp8-waves",
        default=None,
        help="comma list of split-policy waves: the fp8 row times the default tile and each --fp8-configs tile at each",
    )
    p.add_argument("--min-split-len", type=int, default=256)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    args.waves = [float(x) for x in args.waves.split(",")] if args.waves else None
    args.fp8_waves = [float(x) for x in args.fp8_waves.split(",")] if args.fp8_waves else None
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    only = set(args.only.split(","))
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    info = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "torch": torch.__version__,
        "shapes": f"GQA {HQ}q/{HKV}kv, head_dim {D}, {DTYPE}, page size {PAGE}, random page order",
    }
    try:
        import triton

        info["triton"] = triton.__version__
        import flashinfer

        info["flashinfer"] = flashinfer.__version__
    except Exception as exc:
        info["flashinfer"] = f"unavailable: {exc!r:.100}"
    print(json.dumps(info), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[RowResult] = []
    specs = ([("decode", s) for s in DECODE_ROWS] if "decode" in only else []) + (
        [("extend", s) for s in EXTEND_ROWS] if "extend" in only else []
    )
    specs += [("verify", s) for s in VERIFY_ROWS] if "verify" in only else []
    if only & {"verify", "decode", "fp8"}:  # the memory-bound rows' ceiling, measured in the same run
        info["copy_tb_s"] = copy_bandwidth_tb_s()
        print(f"device copy bandwidth: {info['copy_tb_s']:.2f} TB/s", flush=True)
    for kind, spec in specs:
        t0 = time.time()
        r = run_row(kind, spec, args, gen, l2)
        rows.append(r)
        print(f"{r.name}: {r.times_us} errors {r.errors} ({time.time() - t0:.0f}s)", flush=True)
        for s in r.sweep:
            print("   sweep", s, flush=True)
        torch.cuda.empty_cache()
    mixed_rows = []
    for spec in MIXED_ROWS if "mixed" in only else []:
        r = run_mixed_row(spec, args, gen)
        mixed_rows.append(r)
        print(f"{r.name}: {r.times_us} errors {r.errors}", flush=True)
        torch.cuda.empty_cache()
    fa4_rows = []
    for kind, spec in (
        ([("decode", s) for s in DECODE_ROWS] + [("extend", s) for s in EXTEND_ROWS]) if "fa4" in only else []
    ):
        fa4_rows.append(run_fa4_row(kind, spec, args, gen, l2))
        print(f"{fa4_rows[-1].name} (fa4): {fa4_rows[-1].times_us} errors {fa4_rows[-1].errors}", flush=True)
        torch.cuda.empty_cache()
    fp8 = run_fp8_row(args, gen, l2) if "fp8" in only else None
    meta = metadata_host_times() if "meta" in only else []
    table = print_table([r for r in rows if r.kind != "verify"])
    verify_rows = [r for r in rows if r.kind == "verify"]
    if verify_rows:
        table += "\n\n" + print_verify_table(verify_rows, info["copy_tb_s"])
    if mixed_rows:
        table += "\n\n" + print_mixed_table(mixed_rows)
    if fp8 is not None:
        print(f"{fp8.name}: {fp8.times_us} errors {fp8.errors}", flush=True)
        table += "\n\n" + print_fp8_table(fp8)
        rows.append(fp8)
    if fa4_rows:
        table += "\n\n" + print_fa4_table(fa4_rows)
        rows += fa4_rows
    bad = {r.name: e for r in rows + mixed_rows for e in r.errors.values() if e > 2e-2}
    print(table)
    if meta:
        head = (
            "init_forward_metadata host µs (median / p90), validation basic, batch sizes interleaved "
            "| same, one batch size at a time"
        )
        print(f"| batch | {head} | validation full | FlashInfer plan host µs | host-device sync |")
        print("|---|---|---|---|---|---|")
        for m in meta:
            if "error" in m:
                print(f"| {m['bs']} | error: {m['error']} | - | - | - | - |")
                continue
            fi = m.get("flashinfer_plan_us_median")
            fi = "-" if fi is None else f"{fi:.1f}"
            mixed = f"{m['attn_triton_us_interleaved_median']:.1f} / {m['attn_triton_us_interleaved_p90']:.1f}"
            basic = f"{m['attn_triton_us_median']:.1f} / {m['attn_triton_us_p90']:.1f}"
            print(f"| {m['bs']} | {mixed} | {basic} | {m['validation_full_us_median']:.1f} | {fi} | {m['sync']} |")
    if bad:
        print(f"ACCURACY FAILURES (rel err > 2e-2): {bad}")
    with open(args.out, "w") as f:
        json.dump(
            {"info": info, "rows": [asdict(r) for r in rows + mixed_rows], "metadata": meta, "table": table},
            f,
            indent=1,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
