"""The verify kernel (`attn_triton.kernels.verify`): q heads of one KV head x draft tokens on the tile's M
dimension. Random batches (requests with random prefixes, block-unaligned), K/V in a NaN-poisoned
pool with pages in random order (page size 1 and 16), NaN-poisoned outputs, causal and tree masks,
window / logit cap / sinks / LSE / k_scale / v_scale, GQA groups 1..8 and 2..8 drafts, against the
float64 oracle; out-of-range slots and mask offsets set the fault flag without reading out of bounds."""

from __future__ import annotations

import pytest
import torch
from triton_determinism_checks import target_rows
from triton_helpers import factory, paged_setup, requires_interpreter

from attn_core.contract.forward_mode import ForwardMode
from attn_core.ops.device_faults import DeviceFaultKind
from attn_core.testing.batch_builder import random_tree_mask
from attn_core.testing.reference import reference_attention, relative_error, tolerance

pytestmark = requires_interpreter

HKV, D = 2, 40  # D not a power of two: the tile pads it to 64


def _case(
    seed,
    group,
    q_len,
    dtype,
    page_size,
    *,
    tree=False,
    window=None,
    cap=0.0,
    sinks=False,
    lse=False,
    scales=(1.0, 1.0),
    block_m_max=16,
    block_n=16,
    max_prefix=70,
    prefixes=None,
):
    from attn_triton.kernels.verify import VerifyConfig, verify_attention

    gen = torch.Generator().manual_seed(seed)
    if prefixes is None:
        bs = int(torch.randint(2, 5, (1,), generator=gen))
        prefixes = torch.randint(0, max_prefix, (bs,), generator=gen).tolist()
        prefixes[0] = 0  # a request whose keys are only its drafts
    bs = len(prefixes)
    lens = [p + q_len for p in prefixes]
    hq = group * HKV
    k_buf, v_buf, indptr, indices, ks, vs = paged_setup(lens, HKV, D, D, dtype, gen, page_size)
    T = bs * q_len
    q = torch.randn(T, hq, D, generator=gen).to(dtype)
    o = torch.full((T, hq, D), float("nan"), dtype=dtype)
    lse_out = torch.full((T, hq), float("nan")) if lse else None
    sink = torch.randn(hq, generator=gen) if sinks else None
    masks = mask = mask_indptr = None
    if tree:  # blocks with a gap between them (offsets, not concatenation, locate each request's block)
        masks = [random_tree_mask(p, q_len, gen) for p in prefixes]
        mask_indptr = torch.zeros(bs + 1, dtype=torch.int64)
        for r, m in enumerate(masks):
            mask_indptr[r + 1] = mask_indptr[r] + m.numel() + 5
        mask = torch.ones(int(mask_indptr[-1]), dtype=torch.uint8)
        for r, m in enumerate(masks):
            mask[int(mask_indptr[r]) : int(mask_indptr[r]) + m.numel()] = m.reshape(-1).to(torch.uint8)
    fault = torch.zeros(8, dtype=torch.int32)
    cfg = VerifyConfig(block_m_max=block_m_max, block_n=block_n, num_warps=1, num_stages=1)
    verify_attention(
        q,
        k_buf,
        v_buf,
        o,
        indptr,
        indices,
        q_len,
        fault,
        sm_scale=0.25,
        config=cfg,
        custom_mask=mask,
        mask_indptr=mask_indptr,
        logit_cap=cap,
        window=window,
        sinks=sink,
        lse_out=lse_out,
        k_scale=scales[0],
        v_scale=scales[1],
    )
    assert not fault.any(), fault
    for r, p in enumerate(prefixes):
        rows = slice(r * q_len, (r + 1) * q_len)
        ref_o, ref_lse = reference_attention(
            q[rows],
            ks[r],
            vs[r],
            q_positions=torch.arange(p, p + q_len),
            scale=0.25 * scales[0],
            window=window,
            logit_cap=cap,
            sinks=sink,
            mask=None if masks is None else masks[r],
        )
        assert relative_error(o[rows], ref_o * scales[1]) <= tolerance(dtype), (r, p)
        if lse:
            assert relative_error(lse_out[rows], ref_lse) <= 1e-5 if dtype == torch.float32 else 2e-3, (r, p)


@pytest.mark.parametrize(
    "group,q_len,page_size,tree",
    [
        (1, 2, 1, False),
        (2, 4, 16, True),
        (4, 4, 1, True),
        (4, 8, 16, False),
        (8, 8, 1, True),
        (8, 2, 16, False),
        (1, 16, 16, True),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_verify_matches_oracle(group, q_len, page_size, tree, dtype):
    _case(group * 100 + q_len, group, q_len, dtype, page_size, tree=tree)


@pytest.mark.parametrize("tree,window", [(False, 9), (False, 40), (True, 9)])
def test_verify_window_cap_sinks_lse_scales(tree, window):
    """Windows narrower than a tile and wider than two (tiles every row sees inside the window)."""
    _case(
        7,
        4,
        4,
        torch.float32,
        16,
        tree=tree,
        window=window,
        cap=2.5,
        sinks=True,
        lse=True,
        scales=(0.7, 1.3),
        max_prefix=120,
    )


def test_verify_wide_tile_and_odd_q_len():
    """One program for a whole group of 8 heads x 3 tokens (a 32-row tile), q_len not a power of two."""
    _case(11, 8, 3, torch.float16, 16, tree=True, lse=True, block_m_max=64)


@pytest.mark.parametrize("window", [None, 9, 40])
def test_verify_every_offset_within_a_tile(window):
    """Prefixes 12..40 put the first draft token and the window's lower edge at every offset inside a
    16-key tile: the tiles every row sees (no masks) start and end exactly where they may."""
    _case(17, 2, 4, torch.float32, 16, window=window, prefixes=list(range(12, 41)))


@pytest.mark.parametrize("tree", [False, True])
def test_verify_gpu_tiles(tree):
    """The SM90 tile shape (64 rows, 128 keys): GQA 4 x 8 drafts in one program, prefixes past a tile."""
    _case(
        13,
        4,
        8,
        torch.float16,
        16,
        tree=tree,
        window=150 if tree else None,
        lse=True,
        block_m_max=64,
        block_n=128,
        max_prefix=300,
    )


def test_verify_faults_bad_slot_and_mask_offset():
    """A slot past the pool and a mask block past the mask's end are refused and recorded."""
    from attn_triton.kernels.verify import VerifyConfig, verify_attention

    gen = torch.Generator().manual_seed(3)
    q_len, lens = 4, [20, 37]
    k_buf, v_buf, indptr, indices, ks, vs = paged_setup(lens, HKV, D, D, torch.float32, gen, 16)
    bad = indices.clone()
    bad[20 + 34] = k_buf.shape[0] + 1000  # request 1's key 34 (a masked tile: the causal diagonal): outside the pool
    T = 2 * q_len
    q = torch.randn(T, 2 * HKV, D, generator=gen)
    o = torch.full((T, 2 * HKV, D), float("nan"))
    cfg = VerifyConfig(block_m_max=16, block_n=16, num_warps=1, num_stages=1)
    fault = torch.zeros(8, dtype=torch.int32)
    verify_attention(q, k_buf, v_buf, o, indptr, bad, q_len, fault, sm_scale=0.3, config=cfg)
    assert fault[DeviceFaultKind.SLOT] == 1 and fault.sum() == 1
    ref_o, _ = reference_attention(q[:q_len], ks[0], vs[0], q_positions=torch.arange(16, 20), scale=0.3)
    assert relative_error(o[:q_len], ref_o) <= tolerance(torch.float32)
    keep = [j for j in range(37) if j != 34]
    ref_o, _ = reference_attention(
        q[q_len:],
        ks[1][keep],
        vs[1][keep],
        q_positions=torch.arange(33, 37),
        scale=0.3,
        mask=torch.arange(37)[keep][None, :] <= torch.arange(33, 37)[:, None],
    )
    assert relative_error(o[q_len:], ref_o) <= tolerance(torch.float32)

    mask = torch.ones(q_len * lens[0] + q_len * lens[1] - 1, dtype=torch.uint8)  # one entry short of request 1's block
    mask_indptr = torch.tensor([0, q_len * lens[0], q_len * (lens[0] + lens[1])], dtype=torch.int64)
    fault.zero_()
    o.fill_(float("nan"))
    verify_attention(
        q,
        k_buf,
        v_buf,
        o,
        indptr,
        indices,
        q_len,
        fault,
        sm_scale=0.3,
        config=cfg,
        custom_mask=mask,
        mask_indptr=mask_indptr,
    )
    assert fault[DeviceFaultKind.MASK] == 1 and fault.sum() == 1
    assert not o.isnan().any()


def test_verify_q_len_dispatch_rule():
    from attn_triton.kernels.verify import verify_q_len

    assert verify_q_len(ForwardMode.TARGET_VERIFY, 4, 32, 8) == 8
    assert verify_q_len(ForwardMode.DRAFT_EXTEND, 4, 8, 2) == 2
    assert verify_q_len(ForwardMode.DRAFT_EXTEND, 4, 7, 2) is None
    assert verify_q_len(ForwardMode.MIXED, 4, 8, 2) is None
    assert verify_q_len(ForwardMode.TARGET_VERIFY, 1, 17, 17) is None
    assert verify_q_len(ForwardMode.TARGET_VERIFY, 0, 0, 0) is None


def test_verify_request_batch_invariant():
    """The verify kernel has no key splits: one request's rows are bitwise equal in three batches
    (other companions, other positions), also outside deterministic mode."""
    batches = [([(37, 4)], 0), ([(5, 4), (37, 4), (90, 4)], 1), ([(37, 4), (0, 4)], 0)]
    outs = [
        target_rows(factory(), "TARGET_VERIFY", reqs, t, deterministic=False, page_size=16, custom_mask=False)
        for reqs, t in batches
    ]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
