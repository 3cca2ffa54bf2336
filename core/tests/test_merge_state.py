"""merge_state: attention over two disjoint halves of the keys, merged, equals attention over all keys
(float64 reference per half and for the whole), for the torch path and the Triton kernel (interpreted
on CPU, compiled on a GPU)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import attn_core.ops.merge_state as ms
from attn_core.contract.errors import InvalidArgumentError
from attn_core.ops.merge_state_torch import merge_state_torch
from attn_core.testing.reference import reference_attention, relative_error, tolerance


def _case(seed: int, dtype: torch.dtype, device: str = "cpu"):
    """Random request: Lq queries, Lk keys, random visibility (some queries see nothing in one half,
    some see nothing at all); returns the halves' results (empty-side outputs poisoned) and the
    float64 attention over all keys."""
    g = torch.Generator().manual_seed(seed)
    lq = int(torch.randint(1, 7, (1,), generator=g))
    lk = int(torch.randint(2, 12, (1,), generator=g))
    hkv = int(torch.randint(1, 3, (1,), generator=g))
    hq = hkv * int(torch.randint(1, 3, (1,), generator=g))
    d = int(torch.randint(1, 20, (1,), generator=g))
    split = int(torch.randint(1, lk, (1,), generator=g))
    q = torch.randn(lq, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(lk, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(lk, hkv, d, generator=g, dtype=torch.float64)
    mask = torch.rand(lq, lk, generator=g) < 0.6
    mask[0, :split] = False  # query 0 sees nothing in half A
    if lq > 1:
        mask[1, :] = False  # query 1 sees nothing at all
    pos = torch.zeros(lq, dtype=torch.int64)
    scale = d**-0.5
    o_a, lse_a = reference_attention(q, k[:split], v[:split], q_positions=pos, scale=scale, mask=mask[:, :split])
    o_b, lse_b = reference_attention(q, k[split:], v[split:], q_positions=pos, scale=scale, mask=mask[:, split:])
    o_all, lse_all = reference_attention(q, k, v, q_positions=pos, scale=scale, mask=mask)
    o_a[torch.isinf(lse_a)] = float("nan")  # an empty side's output is garbage
    o_b[torch.isinf(lse_b)] = float("nan")
    args = [o_a.to(dtype), lse_a.float(), o_b.to(dtype), lse_b.float()]
    return [a.to(device) for a in args], o_all, lse_all


def _check(out, out_lse, o_all, lse_all, dtype):
    assert not torch.isnan(out).any() and not torch.isnan(out_lse).any()
    assert out.dtype == dtype and out_lse.dtype == torch.float32
    # float32 LSEs bound the precision of a float64 merge to float32's
    assert relative_error(out, o_all) <= tolerance(torch.float32 if dtype == torch.float64 else dtype)
    finite = torch.isfinite(lse_all)
    assert torch.equal(torch.isfinite(out_lse.cpu()), finite)
    assert torch.all(out_lse.cpu()[~finite] == float("-inf"))
    if finite.any():
        assert (out_lse.cpu().double()[finite] - lse_all[finite]).abs().max() <= 1e-5
    assert torch.all(out.cpu()[~finite] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_torch_path_merges_halves(dtype):
    for seed in range(25):
        args, o_all, lse_all = _case(seed, dtype)
        out, out_lse = ms.merge_state(*args)
        _check(out, out_lse, o_all, lse_all, dtype)


def test_torch_path_writes_into_out():
    args, o_all, lse_all = _case(3, torch.float32)
    out = torch.full_like(args[0], float("nan"))
    out_lse = torch.full_like(args[1], float("nan"))
    got, got_lse = ms.merge_state(*args, out=out, out_lse=out_lse)
    assert got is out and got_lse is out_lse
    _check(out, out_lse, o_all, lse_all, torch.float32)


def test_empty_side_passes_the_other_through():
    o = torch.randn(3, 2, 4)
    lse = torch.randn(3, 2)
    garbage = torch.full_like(o, float("nan"))
    empty = torch.full_like(lse, float("-inf"))
    for out, out_lse in (ms.merge_state(o, lse, garbage, empty), ms.merge_state(garbage, empty, o, lse)):
        assert torch.equal(out, o) and torch.equal(out_lse, lse)
    out, out_lse = ms.merge_state(garbage, empty, garbage, empty)
    assert torch.equal(out, torch.zeros_like(o)) and torch.all(out_lse == float("-inf"))


def test_bad_arguments_are_typed_errors():
    o, lse = torch.randn(3, 2, 4), torch.randn(3, 2)
    with pytest.raises(InvalidArgumentError, match="lse_b"):
        ms.merge_state(o, lse, o, lse.double())
    with pytest.raises(InvalidArgumentError, match="o_b"):
        ms.merge_state(o, lse, o[:, :1], lse)
    with pytest.raises(InvalidArgumentError, match="o_a"):
        ms.merge_state(o[0], lse, o[0], lse)
    with pytest.raises(InvalidArgumentError, match="out_lse"):
        ms.merge_state(o, lse, o, lse, out_lse=torch.empty(3, 3))


def _interpreted_triton_module(monkeypatch):
    """A private copy of the kernel module, decorated while TRITON_INTERPRET=1 (runs on CPU)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = os.path.join(os.path.dirname(ms.__file__), "merge_state_triton.py")
    spec = importlib.util.spec_from_file_location("_attn_merge_state_triton_interpreted", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernel_interpreted(monkeypatch, dtype):
    mod = _interpreted_triton_module(monkeypatch)
    for seed in range(6):
        args, o_all, lse_all = _case(100 + seed, dtype)
        out, out_lse = mod.merge_state_triton(*args)
        _check(out, out_lse, o_all, lse_all, dtype)
    # strided o (a head slice of a wider tensor) and preallocated outputs
    args, o_all, lse_all = _case(7, dtype)
    wide = torch.randn(args[0].shape[0], args[0].shape[1], args[0].shape[2] + 3).to(dtype)
    wide[..., : args[0].shape[2]] = args[0]
    out = torch.full_like(args[0], float("nan"))
    got, _ = mod.merge_state_triton(wide[..., : args[0].shape[2]], args[1], args[2], args[3], out=out)
    assert got is out
    assert relative_error(out, o_all) <= tolerance(dtype)


def test_merge_state_module_imports_no_triton():
    code = "import sys, attn_core.ops.merge_state; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_path_on_gpu(dtype):
    pytest.importorskip("triton")
    for seed in range(20):
        args, o_all, lse_all = _case(200 + seed, dtype, device="cuda")
        out, out_lse = ms.merge_state(*args)  # dispatches to Triton on CUDA
        _check(out.cpu(), out_lse.cpu(), o_all, lse_all, dtype)
        ref_out, ref_lse = merge_state_torch(*args)
        assert relative_error(out, ref_out.double()) <= tolerance(dtype)
