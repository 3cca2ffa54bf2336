"""On an AMD GPU with wave-lang (ROCm torch, `pip install 'attn-wave[rocm]'`): Wave's compiled decode and
extend kernels against the emulation they were written from, on the same inputs, then attn-core's
conformance kit on the real backend. Marked `gpu`; everywhere else every test skips with the probe's
reason. None of this has run yet: no AMD GPU was available to this project."""

from __future__ import annotations

import pytest
import torch
from attn_wave.spec import SPEC

from attn_core.testing import ConformanceSuite

REASON = SPEC.probe()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"wave: {REASON}")]


def _close(a, b, tol=2e-2):
    return float((a.double() - b.double()).norm() / b.double().norm()) < tol


def _emulated(decode_form):
    """The emulated module tree, without touching sys.modules (the real wave_lang stays installed)."""
    from types import SimpleNamespace

    from attn_wave.testing.emulated_wave_lang import emulated_wave_lang
    from attn_wave.wave_kernels import MODULES

    tree = emulated_wave_lang(decode_form)
    return SimpleNamespace(**{alias: tree[name] for alias, name in MODULES.items()})


def test_decode_kernels_match_the_emulation():
    from attn_wave.wave_kernels import WaveKernels, load_wave

    real = WaveKernels(load_wave("wave"), 8)
    form = "full" if "layer_scaling" in real.decode_keywords and "output_dtype" in real.decode_keywords else "minimal"
    emul = WaveKernels(_emulated(form), 8)
    gen, dev = torch.Generator().manual_seed(0), "cuda"
    lens, hq, hkv, d = [9, 300, 1, 77], 32, 8, 128
    slots = sum(lens) + 8
    kb = torch.randn(slots, hkv, d, generator=gen).half().to(dev)
    vb = torch.randn(slots, hkv, d, generator=gen).half().to(dev)
    ids = (torch.randperm(slots - 1, generator=gen)[: sum(lens)] + 1).to(torch.int32).to(dev)
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q = torch.randn(len(lens), hq, d, generator=gen).half().to(dev)
    outs = []
    for kernels in (real, emul):
        ls, ms = kernels.decode_buffer_shapes(len(lens), hq, d)
        logits = torch.zeros(ls, device=dev)
        logits_max = torch.full(ms, float("-inf"), device=dev)
        out = torch.full((len(lens), hq, d), float("nan"), dtype=torch.float16, device=dev)
        kernels.decode(q, kb, vb, out, indptr, ids, logits, logits_max, scale=0.07)
        outs.append(out)
    assert _close(outs[0], outs[1])


@pytest.mark.parametrize("masked", [False, True])
def test_extend_kernel_matches_the_emulation(masked):
    from attn_wave.wave_kernels import WaveKernels, load_wave

    gen, dev = torch.Generator().manual_seed(1), "cuda"
    qlens, prefixes, hq, hkv, d = [5, 40, 3], [100, 0, 7], 32, 8, 128
    slots = sum(prefixes) + 8
    kc = torch.randn(slots, hkv, d, generator=gen).half().to(dev)
    vc = torch.randn(slots, hkv, d, generator=gen).half().to(dev)
    ids = (torch.randperm(slots - 1, generator=gen)[: sum(prefixes)] + 1).to(torch.int32).to(dev)
    q, k, v = (torch.randn(sum(qlens), h, d, generator=gen).half().to(dev) for h in (hq, hkv, hkv))
    qo = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    kv = torch.tensor([0, *torch.tensor(prefixes).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    mask = offs = None
    if masked:
        rows = [torch.rand(n, p + n, generator=gen) < 0.7 for n, p in zip(qlens, prefixes)]
        for r in rows:
            r[:, 0] = True
        mask = torch.cat([r.reshape(-1) for r in rows]).to(torch.int8).to(dev)
        offs = torch.tensor(
            [0, *torch.tensor([r.numel() for r in rows]).cumsum(0).tolist()[:-1]], dtype=torch.int32, device=dev
        )
    outs = []
    for kernels in (WaveKernels(load_wave("wave"), 8), WaveKernels(_emulated("full"), 8)):
        out = torch.full_like(q, float("nan"))
        kernels.extend(
            q,
            k,
            v,
            kc,
            vc,
            out,
            qo_indptr=qo,
            kv_indptr=kv,
            kv_indices=ids,
            max_extend_len=40,
            scale=0.07,
            custom_mask=mask,
            mask_offsets=offs,
        )
        outs.append(out)
    assert _close(outs[0], outs[1])


class TestConformanceOnAMD(ConformanceSuite):
    backend = "wave"
    device = "cuda"
    quick = True
