"""The kernels compile for sm_90 (Hopper) on a machine without a GPU: Triton's CUDA backend lowers
them to PTX and cubin ahead of time. Catches what the interpreter does not check (non-constexpr
globals, dot shapes, shared-memory limits) for the variants with every feature switched on."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import triton, torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attn_triton.config import decode_config, extend_config
from attn_triton.kernels import decode as de, extend as ex

def types_for(fn, dt):
    t = {}
    for n in fn.arg_names:
        if n in ("Q", "K", "V", "OUT"): t[n] = "*" + dt
        elif n in ("LSE", "SINKS", "PART_O", "PART_LSE"): t[n] = "*fp32"
        elif n == "MASK": t[n] = "*u8"
        elif n == "MASK_INDPTR": t[n] = "*i64"
        elif n.isupper(): t[n] = "*i32"
        elif n in ("qk_scale", "cap_scale", "v_scale"): t[n] = "fp32"
        else: t[n] = "i32"
    return t

def build(fn, dt, consts, cfg_warps, cfg_stages):
    types = types_for(fn, dt)
    sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
    runtime = [i for i, n in enumerate(fn.arg_names) if n not in consts and (types[n][0] == "*" or n.startswith("stride"))]
    attrs = {(i,): [["tt.divisibility", 16]] for i in runtime}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg_warps, "num_stages": cfg_stages})
    assert k.asm["cubin"], fn

dev = torch.device("cuda")
for dt, tdt, d, dv, dpe, mla in (("bf16", torch.bfloat16, 128, 128, 0, False), ("fp32", torch.float32, 512, 512, 64, True)):
    p2 = lambda x: max(16, triton.next_power_of_2(x))
    common = dict(D=d, BLOCK_D=p2(d), DPE=dpe, BLOCK_DPE=p2(dpe) if dpe else 0, DV=dv, BLOCK_DV=p2(dv), SHARE_KV=mla, LOGIT_CAP=True,
                  HAS_WINDOW=True, DOT_PREC="ieee" if dt == "fp32" else "tf32")
    e = extend_config(d + dpe, dv, tdt, dev, mla)
    build(ex._extend_kernel, dt, dict(GROUP=4, BLOCK_M=e.block_m, BLOCK_N=e.block_n, CAUSAL=False, USE_MASK=True, HAS_SINK=True,
                                      STORE_LSE=True, **common), e.num_warps, e.num_stages)
    c = decode_config(d + dpe, dv, tdt, dev, mla)
    build(de._decode_split_kernel, dt, dict(GROUP=4, HEAD_BLOCKS=1, BLOCK_H=16, BLOCK_N=c.block_n, **common), c.num_warps, c.num_stages)
    build(de._decode_merge_kernel, dt, dict(SPLITS_BLOCK=32, DV=dv, BLOCK_DV=p2(dv), HAS_SINK=True, STORE_LSE=True), 2, 1)
print("compiled")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None, reason="Triton without its CUDA backend")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
