"""attn_core.ops.masked_values.masked_pv against a plain float64 loop over (head, row, key)."""

import pytest
import torch

from attn_core.ops.masked_values import masked_pv


def _reference(p, v, visible):
    h, sq, sk = p.shape
    out = torch.zeros(h, sq, v.shape[-1], dtype=torch.float64)
    for a in range(h):
        for i in range(sq):
            for d in range(v.shape[-1]):
                acc = 0.0
                for j in range(sk):
                    if visible[i, j]:
                        acc += float(p[a, i, j]) * float(v[a, j, d])
                out[a, i, d] = acc
    return out


@pytest.mark.parametrize("seed", range(4))
def test_masked_keys_add_nothing_whatever_their_values(seed):
    g = torch.Generator().manual_seed(seed)
    h, sq, sk, dv = 2, int(torch.randint(2, 6, (1,), generator=g)), int(torch.randint(2, 7, (1,), generator=g)), 3
    visible = torch.rand(sq, sk, generator=g) < 0.6
    p = torch.rand(h, sq, sk, generator=g, dtype=torch.float64) * visible
    v = torch.randn(h, sk, dv, generator=g, dtype=torch.float64)
    bad = int(torch.randint(0, sk, (1,), generator=g))
    visible[0, bad], visible[-1, bad] = True, False  # one row sees the bad key, one does not
    p = torch.rand(h, sq, sk, generator=g, dtype=torch.float64).clamp_min(0.01) * visible
    v[:, bad, 1] = float("inf") if seed % 2 else float("nan")
    out = masked_pv(p, v, visible)
    ref = _reference(p, v, visible)
    for i in range(sq):
        if visible[i, bad]:
            assert torch.isnan(out[:, i]).all()
        else:
            assert torch.isfinite(out[:, i]).all()
            assert torch.allclose(out[:, i], ref[:, i], rtol=1e-12, atol=1e-12)


def test_a_row_that_sees_no_key_is_zero_even_when_p_is_nan():
    visible = torch.tensor([[True, False], [False, False]])
    s = torch.tensor([[[0.5, 1.0], [2.0, 3.0]]], dtype=torch.float64).masked_fill(~visible[None], float("-inf"))
    p = torch.softmax(s, -1)  # row 1: softmax over nothing but -inf is NaN
    assert torch.isnan(p[0, 1]).all()
    v = torch.tensor([[[1.0, 2.0], [float("inf"), 4.0]]], dtype=torch.float64)
    out = masked_pv(p, v, visible)
    assert out[0, 0].tolist() == [1.0, 2.0] and out[0, 1].tolist() == [0.0, 0.0]
