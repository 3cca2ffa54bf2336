"""The kernels compile for sm_90 (Hopper) on a machine without a GPU: Triton's CUDA backend lowers them
to PTX and cubin ahead of time. Catches what the interpreter does not check (non-constexpr globals, dot
shapes, shared-memory limits) for the variants with every feature switched on; the verify and MLA
kernels also for sm_80 with their Ampere tiles."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import os, subprocess, tempfile
import triton, triton.backends.nvidia, torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attn_triton.config import FP8_DECODE_CONFIG, decode_config, extend_config_for, mla_config_for, verify_config
from attn_triton.kernels import decode as de, extend as ex, mla_decode as ml, verify as vf

# a TMA descriptor type of [rows, cols] boxes (extend_wgmma.kv_descriptors, mla_wgmma.latent_descriptors)
def tma_desc(dt, rows, cols):
    from triton.experimental.gluon import language as gl
    layout = gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float16)
    return f"tensordesc<{dt}[{rows},{cols}],{layout!r}>"

def mla_descs(rank, rope):  # the Hopper MLA kernel's descriptors: a tile's nope and rope columns
    from attn_triton.kernels.mla_wgmma import TILE_KEYS
    return {"NOPE_DESC": (TILE_KEYS, rank), "ROPE_DESC": (TILE_KEYS, rope)}

def types_for(fn, dt, kv_dt=None, v_dt=None, descs=None):
    t = {}
    for n in fn.arg_names:
        if n == "V" and v_dt: t[n] = "*" + v_dt
        elif n in ("K", "V") and kv_dt: t[n] = "*" + kv_dt
        elif n in ("Q", "K", "V", "KV", "OUT"): t[n] = "*" + dt
        elif n in ("LSE", "SINKS", "PART_O", "PART_LSE"): t[n] = "*fp32"
        elif n == "MASK": t[n] = "*u8"
        elif n == "MASK_INDPTR": t[n] = "*i64"
        elif n.endswith("_DESC"):
            from attn_triton.kernels.extend_wgmma import TMA_BOX, TMA_CHANNELS
            t[n] = tma_desc(dt, *(descs or {}).get(n, (TMA_BOX, TMA_CHANNELS)))
        elif n.isupper(): t[n] = "*i32"
        elif n in ("qk_scale", "cap_scale", "v_scale"): t[n] = "fp32"
        else: t[n] = "i32"
    return t

def build(fn, dt, consts, cfg_warps, cfg_stages, arch=90, kv_dt=None, v_dt=None, source=ASTSource, descs=None):
    if "PAGE" in fn.arg_names and "PAGE" not in consts:  # attn's own [slots, H, D] pools (common.paged_strides)
        consts = {**consts, "PAGE": 1}
    types = types_for(fn, dt, kv_dt, v_dt, descs)
    sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
    runtime = [
        i for i, n in enumerate(fn.arg_names) if n not in consts and (types[n][0] == "*" or n.startswith("stride"))
    ]
    attrs = {(i,): [["tt.divisibility", 16]] for i in runtime}
    src = source(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    options = {"num_warps": cfg_warps} if cfg_stages is None else {"num_warps": cfg_warps, "num_stages": cfg_stages}
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    assert k.asm["cubin"], fn
    return k

def res_usage(k):  # cuobjdump's resource line of a compiled kernel: REG (per thread), STACK (spills), SHARED, ...
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cub:
        cub.write(k.asm["cubin"]); cub.flush()
        tool = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "cuobjdump")
        out = subprocess.run([tool, "-res-usage", cub.name], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1].strip()

def sass_of(k):  # the SASS of a compiled kernel (nvdisasm)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cub:
        cub.write(k.asm["cubin"]); cub.flush()
        tool = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "nvdisasm")
        return subprocess.run([tool, "-c", cub.name], capture_output=True, text=True, check=True).stdout

# whether ptxas serialized the warpgroup MMAs of a kernel's SASS (a wait after every one; C7515)
def serialized_wgmma(sass):
    mmas, waits = sass.count("HGMMA."), sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0")
    return mmas == 0 or waits * 4 > mmas

dev = torch.device("cuda")
for dt, tdt, d, dv, dpe, mla in (
    ("bf16", torch.bfloat16, 128, 128, 0, False),
    ("fp32", torch.float32, 512, 512, 64, True),
):
    p2 = lambda x: max(16, triton.next_power_of_2(x))
    common = dict(D=d, BLOCK_D=p2(d), DPE=dpe, BLOCK_DPE=p2(dpe) if dpe else 0, DV=dv, BLOCK_DV=p2(dv), SHARE_KV=mla,
                  LOGIT_CAP=True, HAS_WINDOW=True, DOT_PREC="ieee" if dt == "fp32" else "tf32")
    # SM90's tiles (the Hopper kernel's launches are compiled below)
    e = extend_config_for(d + dpe, dv, tdt, mla, True)
    build(ex._extend_kernel, dt,
          dict(GROUP=4, BLOCK_M=e.block_m, BLOCK_N=e.block_n, CAUSAL=False, USE_MASK=True, HAS_SINK=True,
               STORE_LSE=True, LAZY=e.lazy_rescale, HAS_SPAN=False, **common), e.num_warps, e.num_stages)
    if not mla:  # causal with bidirectional spans (attn_core.contract.bidirectional; no window with spans)
        spans = dict(GROUP=4, BLOCK_M=e.block_m, BLOCK_N=e.block_n, CAUSAL=True, USE_MASK=False, HAS_SINK=True,
                     STORE_LSE=True, LAZY=e.lazy_rescale, HAS_SPAN=True, **{**common, "HAS_WINDOW": False})
        build(ex._extend_kernel, dt, spans, e.num_warps, e.num_stages)
    c = decode_config(d + dpe, dv, tdt, dev, mla)
    no_fp8 = dict(KV_FP8=False, FP8_PTX=False, V_WORDS=False)
    for split in (True, False):  # stage 1 of a merged launch, and one split finishing its rows (sink, LSE) itself
        build(de._decode_split_kernel, dt,
              dict(GROUP=4, HEAD_BLOCKS=1, BLOCK_H=16, BLOCK_N=c.block_n, SPLIT=split, HAS_SINK=True, STORE_LSE=True,
                   **no_fp8, **common), c.num_warps, c.num_stages)
    # fp8 (e4m3) cache under bf16 q: the bytes-to-fp16 PTX path with the fp8 tiles, no F2F converts, no spills
    if not mla:
        f = decode_config(d, dv, tdt, dev, False, torch.float8_e4m3fn)
        assert f == FP8_DECODE_CONFIG, f
        plain = {**common, "LOGIT_CAP": False, "HAS_WINDOW": False}
        fp8 = dict(GROUP=4, HEAD_BLOCKS=1, BLOCK_H=16, BLOCK_N=f.block_n, KV_FP8=True, FP8_PTX=True, V_WORDS=True,
                   SPLIT=False, HAS_SINK=False, STORE_LSE=False, **plain)
        k = build(de._decode_split_kernel, dt, fp8, f.num_warps, f.num_stages, kv_dt="u8", v_dt="i32")
        ptx = k.asm["ptx"]
        assert "prmt.b32" in ptx and "e4m3x2" not in ptx and "cvt.bf16.f16" not in ptx, (
            "fp8 decode: F2F conversions in the loop"
        )
        usage = res_usage(k)
        assert " LOCAL:0 " in usage and " STACK:0 " in usage, usage  # spills would live in local memory
        print("fp8 decode", usage, "shared", k.metadata.shared)
        # V read as int32 words keeps the p.v dot off byte-wise shared-memory reads with 4 warps (the 2-warp
        # default's byte-wise reads are its key masks' layout conversions, which only its masked steps, the
        # tail and a redo, have: docs/dev/perf-notebook.md, "Whole tiles without per-key masks")
        k4 = build(de._decode_split_kernel, dt, fp8, 4, 2, kv_dt="u8", v_dt="i32")
        assert "ld.shared.b8" not in k4.asm["ptx"] and "ld.shared.u8" not in k4.asm["ptx"], (
            "fp8 decode: byte-wise shared-memory reads"
        )
    build(de._decode_merge_kernel, dt, dict(SPLITS_BLOCK=32, DV=dv, BLOCK_DV=p2(dv), HAS_SINK=True, STORE_LSE=True),
          2, 1)
    if not mla:  # the MHA verify kernel on SM90 and SM80 tiles: 4 heads x 8 drafts, and 4 x 16 (the 64-row cap)
        for arch in (90, 80):
            v = verify_config(d, dv, tdt, dev, sm_major=arch // 10)
            for q_len in (8, 16):
                heads = min(4, v.block_m_max // q_len)
                vc = dict(D=d, BLOCK_D=p2(d), DV=dv, BLOCK_DV=p2(dv), LOGIT_CAP=True, HAS_WINDOW=True,
                          DOT_PREC=common["DOT_PREC"])
                k = build(vf._verify_kernel, dt,
                          dict(Q_LEN=q_len, GROUP=4, HEADS=heads, HEAD_BLOCKS=4 // heads, BLOCK_M=p2(heads * q_len),
                               BLOCK_N=v.block_n, CAUSAL=False, USE_MASK=True, HAS_SINK=True, STORE_LSE=True, **vc),
                          v.num_warps, v.num_stages, arch)
                # shared memory within the smallest part of each family: 227 KiB (H100/H200), 99 KiB (SM86/SM89)
                assert k.metadata.shared <= (227 if arch == 90 else 99) * 1024, (arch, q_len, k.metadata.shared)
# absorbed MLA over an fp8 cache takes the split decode kernel (V shares K's bytes) under bf16 q
m8 = decode_config(576, 512, torch.bfloat16, dev, True, torch.float8_e4m3fn)
mla8 = dict(GROUP=16, HEAD_BLOCKS=1, BLOCK_H=16, BLOCK_N=m8.block_n, D=512, BLOCK_D=512, DPE=64, BLOCK_DPE=64, DV=512,
            BLOCK_DV=512, SHARE_KV=True, LOGIT_CAP=False, HAS_WINDOW=False, DOT_PREC="tf32", KV_FP8=True, FP8_PTX=True,
            V_WORDS=False, SPLIT=True, HAS_SINK=False, STORE_LSE=False)
k = build(de._decode_split_kernel, "bf16", mla8, m8.num_warps, m8.num_stages, kv_dt="u8")
assert k.metadata.shared <= 227 * 1024, k.metadata.shared
print("mla fp8 decode shared", k.metadata.shared)
# the MLA kernels at DeepSeek's 512 + 64 with each architecture's tiles: decode (split) and verify (tree mask); on
# SM90 in 16-bit the Hopper kernel (Gluon, kernels/mla_wgmma.py), elsewhere the portable one
def build_mla(m, dt, q_len, split, arch):
    consts = dict(Q_LEN=q_len, BLOCK_H=m.block_h, BLOCK_N=m.block_n, RANK=512, BLOCK_R=512, ROPE=64, BLOCK_ROPE=64,
                  SPLIT=split, USE_MASK=not split, HAS_WINDOW=True, LOGIT_CAP=True, HAS_SINK=not split,
                  STORE_LSE=not split, DOT_PREC="ieee" if dt == "fp32" else "tf32", LAZY=m.lazy_rescale)
    if ml.uses_wgmma(m, torch.float32 if dt == "fp32" else torch.bfloat16, 512, 64):
        from triton.experimental.gluon._runtime import GluonASTSource
        from attn_triton.kernels.mla_wgmma import mla_wgmma_kernel
        k = build(mla_wgmma_kernel, dt, consts, ml.WGMMA_WARPS // 2, None, arch, source=GluonASTSource,
                  descs=mla_descs(512, 64))
        # the kernel's point is overlapped MMAs (module doc)
        assert not serialized_wgmma(sass_of(k)), (dt, q_len, split)
        return k
    return build(ml._mla_kernel, dt, consts, m.num_warps, m.num_stages, arch)

for arch, dt, tdt in ((90, "bf16", torch.bfloat16), (80, "bf16", torch.bfloat16), (90, "fp32", torch.float32)):
    m = mla_config_for(tdt, arch // 10)
    smem = {90: 227 * 1024, 80: 163 * 1024}[arch]  # per-block shared memory of H100/H200 and A100
    for split, q_len in ((True, 1), (False, 4)):
        k = build_mla(m, dt, q_len, split, arch)
        assert k.metadata.shared <= smem, (arch, dt, split, k.metadata.shared)
        print("mla", arch, dt, "split" if split else "verify", "shared", k.metadata.shared)
# the SM90 default (the Hopper kernel) and the former default on the portable kernel (benchmarks/mla_vs_peers.py
# --mla-tiles spelling) on sm_90: registers, spills (STACK) and shared memory printed for the occupancy reasoning of
# docs/dev/perf-notebook.md; MLAConfig.ctas_per_sm programs per SM need that many times the shared memory within
# the SM's 228 KiB
for label, m in (
    ("64x32x8x4:c1:g1 (default)", mla_config_for(torch.bfloat16, 9)),
    ("32x64x4x3:c2:l8", ml.MLAConfig(32, 64, 4, 3, 2, 8)),
):
    for split, q_len in ((True, 1), (False, 4)):
        k = build_mla(m, "bf16", q_len, split, 90)
        # 1 KiB a block: CUDA
        assert max(1, m.ctas_per_sm) * (k.metadata.shared + 1024) <= 228 * 1024, (label, split, k.metadata.shared)
        print("mla variant", label, "split" if split else "verify", res_usage(k), "shared", k.metadata.shared)
# the Hopper kernel's narrower latents: p in a ring of its own when rope < 64 (512 + 32 is the largest such)
m = mla_config_for(torch.bfloat16, 9)
from triton.experimental.gluon._runtime import GluonASTSource
from attn_triton.kernels.mla_wgmma import mla_wgmma_kernel
for rank, rope in ((512, 32), (128, 16)):
    consts = dict(Q_LEN=4, BLOCK_H=64, BLOCK_N=m.block_n, RANK=rank, BLOCK_R=rank, ROPE=rope, BLOCK_ROPE=rope,
                  SPLIT=False, USE_MASK=True, HAS_WINDOW=False, LOGIT_CAP=False, HAS_SINK=True, STORE_LSE=True,
                  DOT_PREC="tf32", LAZY=0)
    k = build(mla_wgmma_kernel, "bf16", consts, ml.WGMMA_WARPS // 2, None, 90, source=GluonASTSource,
              descs=mla_descs(rank, rope))
    assert k.metadata.shared <= 227 * 1024 and not serialized_wgmma(sass_of(k)), (rank, rope, k.metadata.shared)
    print("mla hopper", rank, rope, "shared", k.metadata.shared)
# the Hopper extend kernel (kernels/extend_wgmma.py, with its TMA descriptors) with 64-key tiles in 4 buffers, every
# feature on: GQA 32/8 at head_dim 128 (4 heads packed), causal; head_dim 64, one head a program, non-causal (its
# 128-key tiles spill with every feature on)
from attn_triton.kernels.extend import ExtendConfig, packed_heads
from attn_triton.kernels.extend_wgmma import TMA_BOX, extend_wgmma_kernel, producer_regs
for d, group, causal, tiles in ((128, 4, True, ((64, 4, 224), (64, 4, 208))), (64, 1, False, ((64, 4, 224),))):
    # (the register splits ExtendConfig.wgmma_regs offers: the default and one other)
    for block_n, stages, regs in tiles:
        cfg = ExtendConfig(wgmma_block_n=block_n, wgmma_stages=stages, wgmma_regs=regs)
        consts = dict(GROUP=group, BLOCK_M=128, BLOCK_N=cfg.wgmma_block_n, D=d, BLOCK_D=d, DPE=0, BLOCK_DPE=0, DV=d,
                      BLOCK_DV=d, SHARE_KV=False, CAUSAL=causal, USE_MASK=False, HAS_WINDOW=True, LOGIT_CAP=True,
                      HAS_SINK=True, STORE_LSE=True, DOT_PREC="tf32", LAZY=0, STAGES=cfg.wgmma_stages,
                      HEADS=packed_heads(group, 128), BOX=TMA_BOX, CONSUMER_REGS=cfg.wgmma_regs,
                      PRODUCER_REGS=producer_regs(cfg.wgmma_regs), CLEAN=cfg.wgmma_clean_masked)
        k = build(extend_wgmma_kernel, "bf16", consts, 4, None, 90, source=GluonASTSource)
        usage, sass = res_usage(k), sass_of(k)
        shared = k.metadata.shared
        assert shared <= 227 * 1024 and not serialized_wgmma(sass) and " STACK:0 " in usage, (d, block_n, usage, shared)
        # p goes to the output update's operand two values a register in order (extend_wgmma._mma_operand): no
        # byte permutes
        assert sass.count("PRMT") == 0, (d, block_n, "p's 16-bit pairs permuted")
        print("extend hopper", d, block_n, stages, usage, "shared", k.metadata.shared)
# the SM90 default tiles over a page-major cache (PAGE 16 and 64: vLLM's HND layout, `common.tma_page_geometry`): the
# producer's page arithmetic only, the consumers as with attn's own pools (no permutes, the MMAs not serialized; no
# spills with Triton 3.6, the GPU machine's; with 3.9, up to 72 bytes of the producer's: the boxes' rows it holds whole)
sm90 = extend_config_for(128, 128, torch.bfloat16, False, True)
for page in (16, 64):
    consts = dict(GROUP=4, BLOCK_M=128, BLOCK_N=sm90.wgmma_block_n, D=128, BLOCK_D=128, DPE=0, BLOCK_DPE=0, DV=128,
                  BLOCK_DV=128, SHARE_KV=False, CAUSAL=True, USE_MASK=False, HAS_WINDOW=False, LOGIT_CAP=False,
                  HAS_SINK=False, STORE_LSE=False, DOT_PREC="tf32", LAZY=0, STAGES=sm90.wgmma_stages,
                  HEADS=packed_heads(4, 128), BOX=TMA_BOX, CONSUMER_REGS=sm90.wgmma_regs,
                  PRODUCER_REGS=producer_regs(sm90.wgmma_regs), CLEAN=False, PAGE=page)
    k = build(extend_wgmma_kernel, "bf16", consts, 4, None, 90, source=GluonASTSource)
    usage, sass = res_usage(k), sass_of(k)
    stack = int(usage.split("STACK:")[1].split()[0])
    limit = 0 if triton.__version__.startswith("3.6") else 72
    assert stack <= limit and not serialized_wgmma(sass) and sass.count("PRMT") == 0, (page, usage)
    print("extend hopper page-major", page, usage, "shared", k.metadata.shared)
# its producer cleaning the tiles with keys some rows do not see (ExtendConfig.wgmma_clean_masked), at the SM90
# default tiles: compiles within shared memory, the MMAs not serialized (the clean loop's permutes and spills are
# the producer's, on those tiles only)
sm90 = extend_config_for(128, 128, torch.bfloat16, False, True)
for causal, window in ((True, False), (True, True)):
    consts = dict(GROUP=4, BLOCK_M=128, BLOCK_N=sm90.wgmma_block_n, D=128, BLOCK_D=128, DPE=0, BLOCK_DPE=0, DV=128,
                  BLOCK_DV=128, SHARE_KV=False, CAUSAL=causal, USE_MASK=False, HAS_WINDOW=window, LOGIT_CAP=window,
                  HAS_SINK=window, STORE_LSE=True, DOT_PREC="tf32", LAZY=0, STAGES=sm90.wgmma_stages,
                  HEADS=packed_heads(4, 128), BOX=TMA_BOX, CONSUMER_REGS=sm90.wgmma_regs,
                  PRODUCER_REGS=producer_regs(sm90.wgmma_regs), CLEAN=True)
    k = build(extend_wgmma_kernel, "bf16", consts, 4, None, 90, source=GluonASTSource)
    usage, sass = res_usage(k), sass_of(k)
    assert k.metadata.shared <= 227 * 1024 and not serialized_wgmma(sass), (window, usage)
    print("extend hopper clean", causal, window, usage, "shared", k.metadata.shared)
# the ragged op's varlen kernel (kernels/ragged.py) at the ViT head dims with its SM90 default tiles: warpgroup MMAs,
# not serialized, no spills; the tiles benchmarks/ragged_vs_peers.py sweeps within the shared memory of an H100 / H200
from attn_triton.kernels import ragged as rg
default = rg.ragged_config(80, torch.bfloat16, dev)
for d in (64, 72, 80, 96, 128):
    for causal in (False, True):
        consts = dict(GROUP=1, BLOCK_M=default.block_m, BLOCK_N=default.block_n, D=d, BLOCK_D=rg.channel_block(d),
                      CAUSAL=causal, STORE_LSE=True, DOT_PREC="tf32", LAZY=default.lazy_rescale, OFF64=False)
        k = build(rg._ragged_kernel, "bf16", consts, default.num_warps, default.num_stages)
        usage, sass = res_usage(k), sass_of(k)
        assert " STACK:0 " in usage and "HGMMA." in sass and not serialized_wgmma(sass), (d, causal, usage)
        print("ragged", d, causal, usage, "shared", k.metadata.shared)
for bm, bn, w, st, lazy in (
    (128, 64, 4, 3, 4), (128, 128, 8, 3, 4), (128, 64, 8, 2, 4), (64, 64, 4, 3, 0), (128, 64, 8, 3, 0)
):
    consts = dict(GROUP=1, BLOCK_M=bm, BLOCK_N=bn, D=80, BLOCK_D=128, CAUSAL=False, STORE_LSE=False,
                  DOT_PREC="tf32", LAZY=lazy, OFF64=True)
    k = build(rg._ragged_kernel, "bf16", consts, w, st)
    assert k.metadata.shared <= 227 * 1024, (bm, bn, w, st, k.metadata.shared)
    print("ragged tiles", (bm, bn, w, st, lazy), res_usage(k), "shared", k.metadata.shared)
print("compiled")
"""


@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None, reason="Triton without its CUDA backend"
)
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
    assert (
        "fp8 decode" in out.stdout
        and out.stdout.count("mla variant") == 4
        and out.stdout.count("extend hopper") == 7
        and out.stdout.count("extend hopper clean") == 2
        and out.stdout.count("extend hopper page-major") == 2
        and out.stdout.count("ragged tiles") == 5
    )
