"""SplitScratch: the decode split scratch hands out the same views per (bs, max_splits) until it grows,
and views handed out before a growth keep their own memory."""

import torch

from attn_triton.metadata import SplitScratch


def test_views_shape_reuse_and_growth():
    hq, dv = 3, 5
    s = SplitScratch(hq, dv, torch.device("cpu"))
    o, lse = s.views(4, 2)
    assert o.shape == (4, hq, 2, dv) and lse.shape == (4, hq, 2)
    assert o.is_contiguous() and lse.is_contiguous()
    again = s.views(4, 2)
    assert again[0] is o and again[1] is lse  # no per-step view construction
    o.fill_(7.0)
    small = s.views(2, 2)  # fits: the same memory, a different shape
    assert small[0].data_ptr() == o.data_ptr() and small[0].shape == (2, hq, 2, dv)
    big_o, big_lse = s.views(64, 4)  # grows: new buffers, fresh views
    assert big_o.shape == (64, hq, 4, dv) and big_lse.shape == (64, hq, 4)
    assert big_o.data_ptr() != o.data_ptr()
    big_o.fill_(-1.0)
    assert bool((o == 7.0).all())  # an earlier step's views still own the old buffer
    after = s.views(4, 2)
    assert after[0] is not o and after[0].data_ptr() == big_o.data_ptr()  # views of the grown buffer
