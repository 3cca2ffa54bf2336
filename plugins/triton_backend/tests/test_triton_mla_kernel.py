"""The absorbed-MLA kernel (`attn_triton.kernels.mla_decode`) against the float64 oracle: decode with
every split count, page sizes 1/16/64, lengths off every block, window / logit cap / sinks / LSE /
k_scale / v_scale, and multi-token verify (2/4/8 drafts) with causal and tree masks; bad indices raise
the device fault flag. Each for the kernel's variants (`MLAConfig` fields): the wave-aware split
policy's single-split launch without merge (ctas_per_sm > 0 with max_splits 1) and lazy rescaling
(lazy_rescale > 0; `test_mla_lazy_rescale_large_logits` drives the reference through many moves), alone
and together as the SM90 default sets them. The latent pool is NaN outside the slots the requests own,
slots are in random order, and outputs start as NaN."""

from __future__ import annotations

import pytest
import torch
from triton_helpers import requires_interpreter

from attn_core.ops.device_faults import DeviceFaultKind
from attn_core.testing.batch_builder import random_tree_mask
from attn_core.testing.reference import reference_attention, relative_error, tolerance

pytestmark = requires_interpreter

RANK, ROPE, HEADS = 64, 16, 16
WIDTH = RANK + ROPE


def _latent_pool(lens, dtype, gen, page_size):
    """Random latent rows `[n, 1, WIDTH]` per request in a NaN-poisoned pool `[slots, 1, WIDTH]`, pages
    in random order (page 0 unused); returns (pool, kv_indptr, kv_indices, rows per request)."""
    pages = [-(-n // page_size) for n in lens]
    num_pages = sum(pages) + 2
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    pool = torch.full((num_pages * page_size, 1, WIDTH), float("nan"), dtype=dtype)
    slots, rows = [], []
    for n, p in zip(lens, pages):
        mine, perm = perm[:p], perm[p:]
        s = (torch.tensor(mine, dtype=torch.int64)[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:n]
        x = torch.randn(n, 1, WIDTH, generator=gen).to(dtype)
        pool[s] = x
        slots.append(s)
        rows.append(x)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(lens).cumsum(0)
    return pool, indptr, torch.cat(slots).to(torch.int32), rows


def _oracle(q, latent, positions, *, scale, mask=None, **kw):
    """float64 attention of one request in absorbed MLA: K = the whole latent row, V = its first RANK
    channels."""
    return reference_attention(q, latent, latent[:, :, :RANK], q_positions=positions, scale=scale, mask=mask, **kw)


#: kernel variants by MLAConfig fields: "base" (SplitPolicy splits, exact rescaling), "direct"
#: (wave-aware policy: one split finalizes in the kernel), "lazy" / "lazy3" (lazy rescaling, slack 8 / 3),
#: "sm90" (both, as the SM90 default `config.mla_config_for` sets them)
VARIANTS = {
    "base": {},
    "direct": dict(ctas_per_sm=1),
    "lazy": dict(lazy_rescale=8),
    "lazy3": dict(lazy_rescale=3),
    "sm90": dict(ctas_per_sm=2, lazy_rescale=8),
}


def _mode_args(
    q_len: int, bs: int, heads: int, *, max_splits: int, min_split_len: int, scratch_splits: int = 0
) -> dict:
    """`mla_attention`'s mode arguments: DECODE (q_len 1) its split count, minimum split length and split
    scratch for `scratch_splits` (default max_splits) splits; verify (q_len > 1) the uniform query offsets."""
    if q_len == 1:
        n = scratch_splits or max_splits
        return dict(
            max_splits=max_splits,
            min_split_len=min_split_len,
            part_o=torch.empty(bs, heads, n, RANK),
            part_lse=torch.empty(bs, heads, n),
        )
    return dict(q_len=q_len, qo_indptr=torch.arange(0, bs * q_len + 1, q_len, dtype=torch.int32))


def _config(kernel: str = "base"):
    from attn_triton.kernels.mla_decode import MLAConfig

    return MLAConfig(block_h=16, block_n=16, num_warps=1, num_stages=1, **VARIANTS[kernel])


@pytest.mark.parametrize(
    "splits,kernel",
    [(s, "base") for s in (1, 2, 3, 5, 8)] + [(1, "direct"), (1, "sm90"), (5, "sm90")] + [(1, "lazy"), (3, "lazy3")],
)
@pytest.mark.parametrize("variant", ["plain", "window_cap_sinks_scales"])
def test_mla_decode_every_split_count(splits, kernel, variant):
    from attn_triton.kernels.mla_decode import mla_attention

    gen = torch.Generator().manual_seed(100 * splits + len(variant) + len(kernel))
    page_size = [1, 16, 64][splits % 3]
    lens = [1] + torch.randint(2, 90, (3,), generator=gen).tolist() + [64]  # one-token, random, exact-block
    bs, dtype = len(lens), torch.float32
    pool, indptr, indices, rows = _latent_pool(lens, dtype, gen, page_size)
    q = torch.randn(bs, HEADS, WIDTH, generator=gen)
    extra = variant != "plain"
    window = int(torch.randint(5, 40, (1,), generator=gen)) if extra else None
    cap = 4.0 if extra else 0.0
    sinks = torch.randn(HEADS, generator=gen) if extra else None
    k_scale, v_scale = (0.7, 1.3) if extra else (1.0, 1.0)
    o = torch.full((bs, HEADS, RANK), float("nan"))
    lse = torch.full((bs, HEADS), float("nan"))
    part_o = torch.full((bs, HEADS, 8, RANK), float("nan"))
    part_lse = torch.full((bs, HEADS, 8), float("nan"))
    fault = torch.zeros(8, dtype=torch.int32)
    mla_attention(
        q,
        pool,
        o,
        indptr,
        indices,
        fault,
        kv_lora_rank=RANK,
        sm_scale=0.15,
        config=_config(kernel),
        max_splits=splits,
        min_split_len=1,
        part_o=part_o,
        part_lse=part_lse,
        logit_cap=cap,
        window=window,
        sinks=sinks,
        lse_out=lse,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    assert not fault.any()
    for r, n in enumerate(lens):
        ref_o, ref_lse = _oracle(
            q[r : r + 1],
            rows[r],
            torch.tensor([n - 1]),
            scale=0.15 * k_scale,
            window=window,
            logit_cap=cap,
            sinks=sinks,
        )
        assert relative_error(o[r : r + 1], ref_o * v_scale) <= tolerance(dtype), (r, n)
        assert relative_error(lse[r : r + 1], ref_lse) <= 1e-5, (r, n)


@pytest.mark.parametrize("kernel,max_splits", [("base", 4), ("sm90", 1), ("lazy", 4)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_mla_decode_page_sizes_fp16(dtype, kernel, max_splits):
    """Page sizes 1/16/64 in one dtype each run, lengths straddling pages and BLOCK_N."""
    from attn_triton.kernels.mla_decode import mla_attention

    for page_size in (1, 16, 64):
        gen = torch.Generator().manual_seed(page_size + len(kernel))
        lens = torch.randint(1, 150, (3,), generator=gen).tolist()
        bs = len(lens)
        pool, indptr, indices, rows = _latent_pool(lens, dtype, gen, page_size)
        q = torch.randn(bs, HEADS, WIDTH, generator=gen).to(dtype)
        o = torch.full((bs, HEADS, RANK), float("nan"), dtype=dtype)
        part_o, part_lse = torch.full((bs, HEADS, 4, RANK), float("nan")), torch.full((bs, HEADS, 4), float("nan"))
        fault = torch.zeros(8, dtype=torch.int32)
        mla_attention(
            q,
            pool,
            o,
            indptr,
            indices,
            fault,
            kv_lora_rank=RANK,
            sm_scale=0.1,
            config=_config(kernel),
            max_splits=max_splits,
            min_split_len=32,
            part_o=part_o,
            part_lse=part_lse,
        )
        assert not fault.any()
        for r, n in enumerate(lens):
            ref_o, _ = _oracle(q[r : r + 1], rows[r], torch.tensor([n - 1]), scale=0.1)
            assert relative_error(o[r : r + 1], ref_o) <= tolerance(dtype), (page_size, r, n)


@pytest.mark.parametrize("q_len", [2, 4, 8])
@pytest.mark.parametrize("masking", ["causal", "tree", "causal_window_cap_sinks"])
@pytest.mark.parametrize(
    "dtype,kernel",
    [(torch.float16, "base"), (torch.float32, "base"), (torch.float16, "sm90"), (torch.float16, "lazy3")],
)
def test_mla_verify_folded_tokens(q_len, masking, dtype, kernel):
    from attn_triton.kernels.mla_decode import mla_attention

    gen = torch.Generator().manual_seed(10 * q_len + len(masking) + (dtype == torch.float16) + 100 * len(kernel))
    page_size = [1, 16, 64][q_len % 3]
    bs = int(torch.randint(1, 4, (1,), generator=gen))
    prefixes = torch.randint(0, 70, (bs,), generator=gen).tolist()
    lens = [p + q_len for p in prefixes]
    pool, indptr, indices, rows = _latent_pool(lens, dtype, gen, page_size)
    T = bs * q_len
    q = torch.randn(T, HEADS, WIDTH, generator=gen).to(dtype)
    qo = torch.arange(0, T + 1, q_len, dtype=torch.int32)
    masks = [random_tree_mask(p, q_len, gen) for p in prefixes] if masking == "tree" else None
    custom_mask = mask_indptr = None
    if masks is not None:
        custom_mask = torch.cat([m.reshape(-1) for m in masks]).view(torch.uint8)
        mask_indptr = torch.zeros(bs + 1, dtype=torch.int64)
        mask_indptr[1:] = torch.tensor([m.numel() for m in masks]).cumsum(0)
    extra = masking.endswith("sinks")
    window = int(torch.randint(3, 30, (1,), generator=gen)) if extra else None
    cap = 5.0 if extra else 0.0
    sinks = torch.randn(HEADS, generator=gen) if extra else None
    o = torch.full((T, HEADS, RANK), float("nan"), dtype=dtype)
    lse = torch.full((T, HEADS), float("nan"))
    fault = torch.zeros(8, dtype=torch.int32)
    mla_attention(
        q,
        pool,
        o,
        indptr,
        indices,
        fault,
        kv_lora_rank=RANK,
        sm_scale=0.12,
        config=_config(kernel),
        q_len=q_len,
        qo_indptr=qo,
        custom_mask=custom_mask,
        mask_indptr=mask_indptr,
        logit_cap=cap,
        window=window,
        sinks=sinks,
        lse_out=lse,
        v_scale=0.5,
    )
    assert not fault.any()
    for r, p in enumerate(prefixes):
        sl = slice(r * q_len, (r + 1) * q_len)
        ref_o, ref_lse = _oracle(
            q[sl],
            rows[r],
            torch.arange(p, p + q_len),
            scale=0.12,
            mask=None if masks is None else masks[r],
            window=window,
            logit_cap=cap,
            sinks=sinks,
        )
        assert relative_error(o[sl], ref_o * 0.5) <= tolerance(dtype), (r, p)
        assert relative_error(lse[sl], ref_lse) <= (1e-5 if dtype == torch.float32 else 2e-3), (r, p)


@pytest.mark.parametrize("q_len,kernel", [(1, "base"), (4, "base"), (1, "sm90"), (4, "lazy")])
def test_mla_bad_indices_raise_the_fault_flag(q_len, kernel):
    """Slots outside the pool and key offsets past kv_indices are never read (the pool's NaN stays out
    of every output row) and set the SLOT / KEY_OFFSETS flags."""
    from attn_triton.kernels.mla_decode import mla_attention

    gen = torch.Generator().manual_seed(q_len)
    lens = [20, 9]
    pool, indptr, indices, _ = _latent_pool(lens, torch.float32, gen, 16)
    bs, T = len(lens), len(lens) * q_len
    good = indices.clone()
    indices[3] = pool.shape[0] + 5  # past the pool
    indices[4] = -2
    q = torch.randn(T, HEADS, WIDTH, generator=gen)
    o = torch.full((T, HEADS, RANK), float("nan"))
    fault = torch.zeros(8, dtype=torch.int32)
    kw = _mode_args(
        q_len, bs, HEADS, max_splits=1 if kernel.endswith("direct") else 2, min_split_len=1, scratch_splits=2
    )
    mla_attention(q, pool, o, indptr, indices, fault, kv_lora_rank=RANK, sm_scale=0.1, config=_config(kernel), **kw)
    assert fault[int(DeviceFaultKind.SLOT)] == 1 and fault[int(DeviceFaultKind.KEY_OFFSETS)] == 0
    assert torch.isfinite(o).all()
    fault.zero_()
    bad_indptr = indptr.clone()
    bad_indptr[-1] = indices.shape[0] + 100  # past kv_indices: clamped
    indices = good
    mla_attention(q, pool, o, bad_indptr, indices, fault, kv_lora_rank=RANK, sm_scale=0.1, config=_config(kernel), **kw)
    assert fault[int(DeviceFaultKind.KEY_OFFSETS)] == 1
    assert torch.isfinite(o).all()


ROW_BLOCK_CASES = [
    (1, 16, "base"),
    (3, 32, "base"),
    (5, 16, "base"),
    (1, 64, "base"),
    (4, 64, "base"),
    (3, 32, "lazy"),
    (1, 64, "sm90"),
]


@pytest.mark.parametrize("q_len,block_h,kernel", ROW_BLOCK_CASES)
def test_mla_row_blocks_straddle_tokens(q_len, block_h, kernel):
    """12 heads: a block of (token, head) rows holds parts of several tokens and padding rows past the
    last one (decode: 12 of 16 rows used); 64-row blocks with 32-key tiles are the SM90 tiles."""
    from attn_triton.kernels.mla_decode import MLAConfig, mla_attention

    hq = 12
    gen = torch.Generator().manual_seed(7 * q_len + block_h)
    prefixes = [0, 37, 16]
    lens = [p + q_len for p in prefixes]
    bs, T = len(lens), len(lens) * q_len
    pool, indptr, indices, rows = _latent_pool(lens, torch.float32, gen, 16)
    q = torch.randn(T, hq, WIDTH, generator=gen)
    o = torch.full((T, hq, RANK), float("nan"))
    lse = torch.full((T, hq), float("nan"))
    fault = torch.zeros(8, dtype=torch.int32)
    kw = _mode_args(q_len, bs, hq, max_splits=3, min_split_len=4)
    cfg = MLAConfig(block_h=block_h, block_n=32 if block_h == 64 else 16, num_warps=1, num_stages=1, **VARIANTS[kernel])
    mla_attention(q, pool, o, indptr, indices, fault, kv_lora_rank=RANK, sm_scale=0.2, config=cfg, lse_out=lse, **kw)
    assert not fault.any()
    for r, p in enumerate(prefixes):
        sl = slice(r * q_len, (r + 1) * q_len)
        ref_o, ref_lse = _oracle(q[sl], rows[r], torch.arange(p, p + q_len), scale=0.2)
        assert relative_error(o[sl], ref_o) <= tolerance(torch.float32), (r, p)
        assert relative_error(lse[sl], ref_lse) <= 1e-5, (r, p)


def test_mla_verify_bad_query_and_mask_offsets_raise_the_fault_flag():
    """qo_indptr past the step's rows is clamped (QUERY_ROWS) and a request's mask block past the mask is
    not read (MASK): nothing outside q, o or the mask is touched."""
    from attn_triton.kernels.mla_decode import mla_attention

    gen = torch.Generator().manual_seed(3)
    q_len, lens = 4, [12, 30]
    pool, indptr, indices, _ = _latent_pool(lens, torch.float32, gen, 16)
    T = len(lens) * q_len
    q = torch.randn(T, HEADS, WIDTH, generator=gen)
    o = torch.full((T, HEADS, RANK), float("nan"))
    qo = torch.arange(0, T + 1, q_len, dtype=torch.int32)
    mask = torch.ones(sum(q_len * n for n in lens), dtype=torch.uint8)
    mask_indptr = torch.tensor([0, q_len * lens[0], mask.numel()], dtype=torch.int64)
    kw = dict(kv_lora_rank=RANK, sm_scale=0.1, config=_config(), q_len=q_len, custom_mask=mask)
    fault = torch.zeros(8, dtype=torch.int32)
    bad_mask = mask_indptr.clone()
    bad_mask[1] = mask.numel() - 5  # request 1's block runs past the mask
    mla_attention(q, pool, o, indptr, indices, fault, qo_indptr=qo, mask_indptr=bad_mask, **kw)
    assert fault[int(DeviceFaultKind.MASK)] == 1 and fault[int(DeviceFaultKind.QUERY_ROWS)] == 0
    fault.zero_()
    bad_qo = qo.clone()
    bad_qo[-1] = T + 50
    mla_attention(q, pool, o, indptr, indices, fault, qo_indptr=bad_qo, mask_indptr=mask_indptr, **kw)
    assert fault[int(DeviceFaultKind.QUERY_ROWS)] == 1 and fault[int(DeviceFaultKind.MASK)] == 0
    assert torch.isfinite(o).all()


def test_mla_config_variants_are_checked():
    """An MLAConfig outside the kernel's variants is refused when it is made, before any launch."""
    from attn_core.contract.errors import InvalidArgumentError
    from attn_triton.kernels.mla_decode import MLAConfig

    with pytest.raises(InvalidArgumentError, match="ctas_per_sm"):
        MLAConfig(ctas_per_sm=-1)
    with pytest.raises(InvalidArgumentError, match="lazy_rescale"):
        MLAConfig(lazy_rescale=9)
    # the Hopper kernel: 64 rows, 32-key tiles, 8 warps, four buffers, no lazy rescaling
    for tiles, lazy in (
        ((32, 32, 8, 4), 0),
        ((64, 64, 8, 4), 0),
        ((64, 32, 4, 4), 0),
        ((64, 32, 8, 2), 0),
        ((64, 32, 8, 4), 8),
    ):
        with pytest.raises(InvalidArgumentError, match="MLAConfig.wgmma"):
            MLAConfig(*tiles, lazy_rescale=lazy, wgmma=True)
    assert MLAConfig(64, 32, 8, 4, wgmma=True).wgmma


@pytest.mark.parametrize("kernel", ["lazy", "lazy3"])
@pytest.mark.parametrize("q_len", [1, 4])
def test_mla_lazy_rescale_large_logits(kernel, q_len):
    """Scores with a trend (later keys score up to ~40 log2 units higher, per head at a different
    rate) move every row's max many times by more than the slack, and by less in between: the lazy
    reference must still give the exact softmax and LSE (fp16, where p is rounded to the dot's type)."""
    from attn_triton.kernels.mla_decode import mla_attention

    gen = torch.Generator().manual_seed(11 * q_len + len(kernel))
    prefixes = [70, 33]
    lens = [p + q_len for p in prefixes]
    bs, T, dtype = len(lens), len(lens) * q_len, torch.float16
    pool, indptr, indices, rows = _latent_pool(lens, dtype, gen, 16)
    for r, n in enumerate(lens):  # channel 0 grows along the sequence; q's channel 0 picks it up per head
        rows[r][:, 0, 0] = torch.linspace(-4, 4, n).to(dtype)
        pool[indices[indptr[r] : indptr[r + 1]].long(), 0, 0] = rows[r][:, 0, 0]
    q = torch.randn(T, HEADS, WIDTH, generator=gen).to(dtype)
    q[:, :, 0] = torch.linspace(0, 8, HEADS).to(dtype)
    o = torch.full((T, HEADS, RANK), float("nan"), dtype=dtype)
    lse = torch.full((T, HEADS), float("nan"))
    fault = torch.zeros(8, dtype=torch.int32)
    kw = _mode_args(q_len, bs, HEADS, max_splits=2, min_split_len=16)
    mla_attention(
        q, pool, o, indptr, indices, fault, kv_lora_rank=RANK, sm_scale=0.6, config=_config(kernel), lse_out=lse, **kw
    )
    assert not fault.any()
    for r, p in enumerate(prefixes):
        sl = slice(r * q_len, (r + 1) * q_len)
        ref_o, ref_lse = _oracle(q[sl], rows[r], torch.arange(p, p + q_len), scale=0.6)
        assert relative_error(o[sl], ref_o) <= tolerance(dtype), (r, p)
        assert relative_error(lse[sl], ref_lse) <= 2e-3, (r, p)


@pytest.mark.parametrize("sinks_on", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mla_one_split_launch_equals_merged(dtype, sinks_on):
    """A DECODE launch of one split finishing its rows in the kernel (ctas_per_sm 1, max_splits 1) and a
    launch of 4 splits through the merge, where every request takes one split (min_split_len 128): the same
    bits in o and the LSE (batch invariance), and the oracle."""
    from attn_triton.kernels.mla_decode import mla_attention

    gen = torch.Generator().manual_seed(31 + sinks_on)
    lens = [1, 37, 64, 100]
    bs = len(lens)
    pool, indptr, indices, rows = _latent_pool(lens, dtype, gen, 16)
    q = torch.randn(bs, HEADS, WIDTH, generator=gen).to(dtype)
    sinks = torch.randn(HEADS, generator=gen) if sinks_on else None
    outs = []
    for kernel, max_splits in (("direct", 1), ("base", 4)):
        o = torch.full((bs, HEADS, RANK), float("nan"), dtype=dtype)
        lse = torch.full((bs, HEADS), float("nan"))
        fault = torch.zeros(8, dtype=torch.int32)
        mla_attention(
            q,
            pool,
            o,
            indptr,
            indices,
            fault,
            kv_lora_rank=RANK,
            sm_scale=0.2,
            config=_config(kernel),
            sinks=sinks,
            lse_out=lse,
            v_scale=0.5,
            **_mode_args(1, bs, HEADS, max_splits=max_splits, min_split_len=128),
        )
        assert not fault.any()
        outs.append((o, lse))
    (o1, lse1), (o4, lse4) = outs
    assert torch.equal(o1, o4) and torch.equal(lse1, lse4)
    for r, n in enumerate(lens):
        ref_o, ref_lse = _oracle(q[r : r + 1], rows[r], torch.tensor([n - 1]), scale=0.2, sinks=sinks)
        assert relative_error(o1[r : r + 1], 0.5 * ref_o) <= tolerance(dtype), (r, n)
        assert relative_error(lse1[r : r + 1], ref_lse) <= 1e-5, (r, n)
