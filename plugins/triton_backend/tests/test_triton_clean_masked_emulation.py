"""The arithmetic of the Hopper extend kernel's clean path (`kernels/extend_wgmma.py`, `_clean_and_release`, with
`ExtendConfig.wgmma_clean_masked`), emulated in float64 torch on the CPU: the GPU kernel itself has not run yet.

The kernel's producer gives every key whose V holds an Inf or NaN, in a tile with keys some rows do not see,
V = 0 and K = NaN; its consumers mask scores by selection (`where(visible, s, -inf)`), run the online softmax
tile by tile (a PTX max, which ignores a NaN operand, or one that propagates it: both emulated), multiply p by V
and, in the epilogue, treat a NaN row sum as a row with keys (NaN output and LSE, not "no keys"). The claim
checked here, on random causal and windowed requests with Inf / NaN values in keys some rows do not see: a row
that does not see a bad key gets the float64 reference of its visible keys; a row that sees one gets a
non-finite output and a non-finite LSE that is not -inf (a merge never takes it for an empty part); and without
the clean step the same arithmetic leaks NaN into rows that must not see it (the bug it fixes)."""

from __future__ import annotations

import math

import pytest
import torch

BLOCK_N = 8


def _visible(q_pos: torch.Tensor, n_keys: int, window: int) -> torch.Tensor:
    keys = torch.arange(n_keys)
    vis = keys[None, :] <= q_pos[:, None]
    if window:
        vis &= keys[None, :] > q_pos[:, None] - window
    return vis


def _clean(k, v, vis):
    """The producer's step: tiles with a key some row does not see; in them, keys whose V is not finite."""
    k, v = k.clone(), v.clone()
    for start in range(0, k.shape[0], BLOCK_N):
        cols = vis[:, start : start + BLOCK_N]
        if cols.all():
            continue
        bad = ~torch.isfinite(v[start : start + BLOCK_N]).all(-1)
        k[start : start + BLOCK_N][bad] = float("nan")
        v[start : start + BLOCK_N][bad] = 0.0
    return k, v


def _kernel_math(q, k, v, vis, nan_max: str):
    """Consumer arithmetic: selection masks, online softmax by tiles of BLOCK_N, the CLEAN epilogue."""
    rows = q.shape[0]
    m = torch.full((rows,), float("-inf"), dtype=torch.float64)
    row_sum = torch.zeros(rows, dtype=torch.float64)
    acc = torch.zeros(rows, v.shape[1], dtype=torch.float64)
    for start in range(0, k.shape[0], BLOCK_N):
        s = (q @ k[start : start + BLOCK_N].T) * math.log2(math.e)
        s = torch.where(vis[:, start : start + BLOCK_N], s, torch.tensor(float("-inf"), dtype=torch.float64))
        tile_max = s.nan_to_num(nan=float("-inf")).amax(-1) if nan_max == "ignore" else s.amax(-1)
        m_new = torch.fmax(m, tile_max) if nan_max == "ignore" else torch.maximum(m, tile_max)
        safe = torch.where(torch.isinf(m_new) & (m_new < 0), torch.zeros_like(m_new), m_new)
        alpha = torch.exp2(m - safe)
        p = torch.exp2(s - safe[:, None])
        # p times V as the MMA does it: every key's product summed, a masked key's p = 0 included
        acc = acc * alpha[:, None] + torch.einsum("rn,nd->rd", p, v[start : start + BLOCK_N])
        row_sum = row_sum * alpha + p.sum(-1)
        m = m_new
    has = (row_sum > 0) | torch.isnan(row_sum)
    denom = torch.where(has, row_sum, torch.ones_like(row_sum))
    inv = torch.where(has, 1.0 / denom, torch.zeros_like(row_sum))
    lse2 = torch.where(has, m + torch.log2(denom), torch.full_like(row_sum, -math.inf))
    return acc * inv[:, None], lse2


def _reference(q, k, v, vis):
    out = torch.empty(q.shape[0], v.shape[1], dtype=torch.float64)
    for i in range(q.shape[0]):
        keys = vis[i].nonzero().flatten()
        w = torch.softmax(q[i] @ k[keys].T, -1)
        out[i] = w @ v[keys]
    return out


@pytest.mark.parametrize("nan_max", ["ignore", "propagate"])
@pytest.mark.parametrize("seed", range(6))
def test_clean_tiles_keep_masked_values_out(nan_max, seed):
    gen = torch.Generator().manual_seed(seed)
    prefix = int(torch.randint(0, 30, (1,), generator=gen))
    new = int(torch.randint(4, 40, (1,), generator=gen))
    window = [0, 7, 20][seed % 3]
    d = 16
    n = prefix + new
    q = torch.randn(new, d, generator=gen, dtype=torch.float64) / 4
    k = torch.randn(n, d, generator=gen, dtype=torch.float64)
    v = torch.randn(n, d, generator=gen, dtype=torch.float64)
    vis = _visible(prefix + torch.arange(new), n, window)
    # poison: a few new tokens' V (Inf or NaN, as the kit's masked check writes them) and, with a window, old keys
    bad = torch.randperm(new, generator=gen)[: max(1, new // 6)] + prefix
    v[bad[0::2]] = float("inf")
    v[bad[1::2]] = float("nan")
    if window:
        old = ~vis.any(0)
        v[old] = float("inf")
    ref = _reference(q, k, v, vis)
    ref_ok = torch.isfinite(ref).all(-1)
    assert ref_ok.any() and not ref_ok.all()

    ck, cv = _clean(k, v, vis)
    out, lse = _kernel_math(q, ck, cv, vis, nan_max)
    out_ok = torch.isfinite(out).all(-1)
    torch.testing.assert_close(out[ref_ok], ref[ref_ok], rtol=1e-9, atol=1e-9)
    assert not out_ok[~ref_ok].any()  # rows that see a bad value: non-finite
    assert not (lse[~ref_ok] == -math.inf).any()  # ... and never taken for an empty part by a merge

    # the same arithmetic without the clean step: 0 * Inf reaches rows that do not see the bad key
    leaked, _ = _kernel_math(q, k, v, vis, nan_max)
    assert (ref_ok & ~torch.isfinite(leaked).all(-1)).any()
