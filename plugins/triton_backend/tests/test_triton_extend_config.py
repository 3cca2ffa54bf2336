"""The extend kernels' configuration on the CPU: `ExtendConfig`'s checks, which launches the Hopper
kernel (`kernels/extend_wgmma.py`) would take (`uses_wgmma`, and pools its TMA descriptors can read:
`tma_compatible`, `tma_page_geometry`), the TMA descriptors of both Hopper kernels (extend and MLA:
`gluon_gather.pool_descriptor`), how many q heads it packs into a program (`packed_heads`, against a plain
search), and that a backend refuses it where it cannot run. The kernels themselves are compiled for sm_90 by
test_triton_compile_sm90.py and run by the GPU suite."""

from __future__ import annotations

import random

import pytest
import torch
from triton_helpers import requires_interpreter

from attn_core.contract.errors import InvalidArgumentError
from attn_core.testing.harness import AttnCase, make_env
from attn_triton.kernels.common import tma_compatible, tma_page_geometry, tma_row_span
from attn_triton.kernels.extend import ExtendConfig, hopper_extend, packed_heads, uses_wgmma

HOPPER = ExtendConfig(128, 64, 4, 3, 4, wgmma_block_n=64, wgmma_stages=4)


@pytest.mark.parametrize(
    "field, value",
    [
        ("wgmma_block_n", 32),
        ("wgmma_block_n", 256),
        ("wgmma_stages", 2),
        ("wgmma_regs", 212),
        ("wgmma_regs", 160),
        ("wgmma_regs", 248),
    ],
)
def test_config_refuses_bad_hopper_tiles(field, value):
    kwargs = {"wgmma_block_n": 64, "wgmma_stages": 4, field: value}
    with pytest.raises(InvalidArgumentError) as err:
        ExtendConfig(**kwargs)
    assert err.value.argument == f"ExtendConfig.{field}" and err.value.found == value


def test_register_splits_fill_the_pool():
    """Each consumer warpgroup's registers and the producer's rest fill the 168 a thread the kernel's 384
    threads launch with, for every split ExtendConfig accepts (the default 224 / 56, then 216 / 72, 208 / 88)."""
    from attn_triton.kernels.extend_wgmma import producer_regs

    assert [producer_regs(c) for c in (224, 216, 208)] == [56, 72, 88]
    for regs in range(168, 241, 8):
        assert 128 * (2 * ExtendConfig(wgmma_regs=regs).wgmma_regs + producer_regs(regs)) == 384 * 168
        assert producer_regs(regs) % 8 == 0 and producer_regs(regs) >= 24


def test_config_defaults_to_the_portable_kernel_only():
    assert ExtendConfig().wgmma_block_n == 0
    assert not uses_wgmma(ExtendConfig(), torch.bfloat16, torch.bfloat16, 128, 128, True)
    ExtendConfig(wgmma_block_n=0, wgmma_stages=1)  # stages are not checked while the kernel is off


@pytest.mark.parametrize(
    "dtype, kv_dtype, d, dv, plain, takes",
    [
        (torch.bfloat16, torch.bfloat16, 128, 128, True, True),
        (torch.float16, torch.float16, 64, 64, True, True),
        (torch.float32, torch.float32, 128, 128, True, False),  # no 32-bit warpgroup MMA path
        (torch.bfloat16, torch.float8_e4m3fn, 128, 128, True, False),  # fp8 caches keep the portable kernel
        (torch.bfloat16, torch.float16, 128, 128, True, False),
        (torch.bfloat16, torch.bfloat16, 256, 256, True, False),
        (torch.bfloat16, torch.bfloat16, 96, 96, True, False),
        (torch.bfloat16, torch.bfloat16, 192, 128, True, False),  # DeepSeek's non-absorbed prefill shape
        (torch.bfloat16, torch.bfloat16, 128, 128, False, False),  # custom mask, rope split or absorbed MLA
    ],
)
def test_uses_wgmma(dtype, kv_dtype, d, dv, plain, takes):
    assert uses_wgmma(HOPPER, dtype, kv_dtype, d, dv, plain) is takes


def test_tma_compatible_pools():
    pool = torch.empty(64, 8, 128, dtype=torch.bfloat16)
    assert tma_compatible(pool)
    assert tma_compatible(torch.empty(64, 2, 64, dtype=torch.float16))
    assert tma_compatible(pool[8:])  # a later slot: base still 16-byte aligned
    side_by_side = torch.empty(64, 8, 256, dtype=torch.bfloat16)  # K | V side by side (vLLM's LBNHC)
    assert tma_compatible(side_by_side[:, :, :128]) and tma_compatible(side_by_side[:, :, 128:])
    assert tma_row_span(side_by_side[:, :, :128]) == 7 * 256 + 128 and tma_row_span(pool) == 1024
    assert not tma_compatible(torch.empty(64, 8, 132, dtype=torch.bfloat16)[:, :, :128])  # heads 264 bytes apart
    assert not tma_compatible(torch.empty(64, 128, 8, dtype=torch.bfloat16).transpose(1, 2))  # channels strided
    assert not tma_compatible(torch.empty(64, 8, 128, dtype=torch.bfloat16).as_strided((64, 8, 128), (1024, 64, 1)))
    assert not tma_compatible(pool.transpose(0, 1))  # slots not the outer dimension
    assert not tma_compatible(
        torch.empty(64 * 8 * 128 + 1, dtype=torch.bfloat16)[1:].view(64, 8, 128)
    )  # base 2 bytes off
    assert not tma_compatible(torch.empty(64, 1, 4, dtype=torch.bfloat16))  # rows of 8 bytes
    assert tma_compatible(torch.empty(64, 1, 576, dtype=torch.bfloat16))  # an MLA latent pool
    assert tma_compatible(torch.empty(64, 576, dtype=torch.bfloat16))
    assert not tma_compatible(torch.empty(64, dtype=torch.bfloat16))  # no rows
    assert not tma_compatible(
        torch.empty(64, 1024, dtype=torch.bfloat16)[:, :512].as_strided((64, 512), (256, 1))
    )  # rows overlap


def _page_major_buffers():
    """Page-major K/V buffers `[pages, Hkv, page_size, D]` as engines allocate them: attn's HND pool, vLLM's
    HND cache `[pages, 2, H, P, D]` (K and V views), FlashInfer's / FlashAttention's `[pages, 2, P, H, D]` seen
    head-major, one KV head, pages of 16 and 32."""
    for page, heads, d in ((16, 4, 128), (32, 2, 64), (16, 1, 128)):
        yield "hnd", torch.empty(5, heads, page, d, dtype=torch.bfloat16)
        fused = torch.empty(5, 2, heads, page, d, dtype=torch.float16)
        yield "vllm K", fused[:, 0]
        yield "vllm V", fused[:, 1]
        paged = torch.empty(5, 2, page, heads, d, dtype=torch.bfloat16)
        yield "flashinfer K", paged[:, 0].transpose(1, 2)
        yield "flashinfer V", paged[:, 1].transpose(1, 2)


@pytest.mark.parametrize("what, buf", list(_page_major_buffers()), ids=lambda x: x if isinstance(x, str) else "")
def test_page_geometry_addresses_every_key(what, buf):
    """The Hopper kernel's TMA coordinates of every key (slot s, KV head h) and 64-channel half of a
    page-major buffer (`common.tma_page_geometry`, as `extend_wgmma._tma_tile` computes them) land on that key's
    channels, read from the buffer's own element addresses; every box of 16 rows stays inside the
    descriptor, and the kernel takes such buffers (`hopper_extend`)."""
    g = tma_page_geometry(buf)
    assert g is not None, what
    pages, heads, page, d = buf.shape
    esz, s_tok = buf.element_size(), buf.stride(2)
    for s in range(pages * page):
        for h in range(heads):
            row = (s // page) * g.rows_page + h * g.rows_head + s % page
            col = h * g.cols_head
            assert 0 <= row < g.rows and col + d <= g.width
            for c in range(0, d, 64):
                want = (buf[s // page, h, s % page, c].data_ptr() - buf.data_ptr()) // esz
                assert row * s_tok + col + c == want, (what, s, h, c)
    assert (g.rows - 1) * s_tok + g.width <= buf.untyped_storage().nbytes() // esz  # the last row in memory
    assert hopper_extend(HOPPER, buf.dtype, buf, buf, d, d, True) == (d in (64, 128))


def test_page_geometry_refusals():
    bf16 = dict(dtype=torch.bfloat16)
    assert tma_page_geometry(torch.empty(5, 4, 8, 128, **bf16)) is None  # pages of 8 keys: a box would cross pages
    assert tma_page_geometry(torch.empty(5, 4, 128, 16, **bf16).transpose(2, 3)) is None  # channels strided
    flat = torch.empty(5 * 4 * 16 * 128, **bf16)
    assert tma_page_geometry(flat.as_strided((5, 4, 16, 128), (8192, 1024, 128, 1))) is None  # heads overlap
    assert tma_page_geometry(flat.as_strided((5, 4, 16, 128), (4096, 2048, 128, 1))) is None  # pages overlap
    odd = torch.empty(5, 16, 4, 100, **bf16)[..., :64].transpose(1, 2)  # heads 200 bytes apart in a row
    assert tma_page_geometry(odd) is None
    even = torch.empty(5, 16, 4, 96, **bf16)[..., :64].transpose(1, 2)  # heads 192 bytes apart: readable
    assert tma_page_geometry(even) == (4 * 16 + 16, 3 * 96 + 64, 16, 0, 96)
    assert tma_page_geometry(torch.empty(64, 8, 128, **bf16)) is None  # NHD pools: `tma_row_span`
    eights = torch.empty(5, 4, 8, 128, **bf16)
    assert not hopper_extend(HOPPER, torch.bfloat16, eights, eights, 128, 128, True)


@pytest.mark.parametrize(
    "rank, rope, dtype", [(512, 64, torch.bfloat16), (256, 32, torch.float16), (128, 16, torch.bfloat16)]
)
def test_pool_descriptors(rank, rope, dtype):
    """The pools as the Hopper kernels' TMA sees them, `[slots, row]`, and the boxes each copies: extend a 16-key
    box of 64 channels, MLA a 32-key tile's nope and rope columns; each box's layout is the one of the
    shared-memory buffer it fills (16-bit: bf16 and fp16 alike)."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon import language as gl

    from attn_triton.kernels.extend_wgmma import kv_descriptors
    from attn_triton.kernels.mla_wgmma import TILE_KEYS, latent_descriptors

    k, v = torch.empty(4096, 8, 128, dtype=dtype), torch.empty(4096, 8, 128, dtype=dtype)
    kd, vd, rows = kv_descriptors(k, v)
    assert (kd.shape, kd.strides, kd.block_shape, kd.base is k, vd.base is v) == (
        [4096, 1024],
        [1024, 1],
        [16, 64],
        True,
        True,
    )
    assert set(rows.values()) == {0}  # rows are slots: no page / head row arguments
    # K and V side by side, one cache `[slots, Hkv, 2 D]`: each a descriptor of rows from its first head's channels
    # to its last head's, heads 2 D apart
    kv = torch.empty(4096, 8, 256, dtype=dtype)
    kd, vd, _ = kv_descriptors(kv[:, :, :128], kv[:, :, 128:])
    assert (kd.shape, kd.strides, vd.shape, vd.strides) == ([4096, 1920], [2048, 1], [4096, 1920], [2048, 1])
    assert vd.base.data_ptr() == kv.data_ptr() + 128 * kv.element_size()
    # page-major: vLLM's HND cache `[pages, 2, Hkv, 16, D]` (K and V views), rows of D channels a token apart, K's
    # head h page p from row 256 p + 16 h, V's the same from its own base
    hnd = torch.empty(64, 2, 8, 16, 128, dtype=dtype)
    kd, vd, rows = kv_descriptors(hnd[:, 0], hnd[:, 1])
    assert (kd.shape, kd.strides, kd.block_shape, vd.shape) == (
        [63 * 256 + 7 * 16 + 16, 128],
        [128, 1],
        [16, 64],
        kd.shape,
    )
    assert rows == dict(rows_kp=256, rows_kh=16, cols_kh=0, rows_vp=256, rows_vh=16, cols_vh=0)
    assert vd.base.data_ptr() == hnd[:, 1].data_ptr()
    latent = torch.empty(300, 1, rank + rope + 64, dtype=dtype)[:, :, : rank + rope]  # rows padded: stride past the row
    assert tma_compatible(latent)
    nope, rope_d = latent_descriptors(latent, rank)
    assert (nope.shape, nope.strides, nope.base is latent) == ([300, rank + rope], [rank + rope + 64, 1], True)
    assert (nope.block_shape, rope_d.block_shape) == ([TILE_KEYS, rank], [TILE_KEYS, rope])
    for desc, cols in ((nope, rank), (rope_d, rope)):
        assert desc.layout == gl.NVMMASharedLayout.get_default_for([TILE_KEYS, cols], gl.bfloat16)


def test_packed_heads_worked_examples():
    assert [packed_heads(g, 128) for g in (1, 2, 4, 8, 6, 12, 7, 256)] == [1, 2, 4, 8, 2, 4, 1, 128]
    assert packed_heads(8, 4) == 4


def test_packed_heads_random_against_a_plain_search():
    rng = random.Random(0)
    for _ in range(300):
        group, rows = rng.randint(1, 300), rng.choice([1, 2, 4, 8, 16, 32, 64, 128])
        want = max(h for h in range(1, rows + 1) if group % h == 0 and h & (h - 1) == 0)
        assert packed_heads(group, rows) == want, (group, rows)


@requires_interpreter
def test_backend_refuses_the_hopper_kernel_where_it_cannot_run():
    from attn_triton.backend import TritonAttnBackend

    env = make_env(AttnCase("EXTEND", [(3, 4)], dtype="bfloat16", num_q_heads=8, num_kv_heads=2, head_dim=128))
    with pytest.raises(InvalidArgumentError) as err:
        TritonAttnBackend(env.ctx, extend_config=HOPPER)
    assert err.value.argument == "extend_config.wgmma_block_n" and "compute capability 9.x" in err.value.expected


@pytest.mark.parametrize("layout, page", [("HND", 16), ("HND", 64), ("NHD", 16), ("HND", 8)])
def test_hopper_extend_takes_attns_pools(layout, page):
    """attn's own pools, NHD and page-major HND (pages of 16 keys or a multiple), are read by the Hopper kernel at
    the SM90 default; HND pools of 8-key pages keep the portable kernel."""
    from attn_core import MHATokenToKVPool
    from attn_triton.config import extend_config_for

    pool = MHATokenToKVPool(32 * page, page, torch.bfloat16, 8, 128, 1, "cpu", 128, layout)
    k, v = pool.get_key_buffer(0), pool.get_value_buffer(0)
    sm90 = extend_config_for(128, 128, torch.bfloat16, False, True)
    assert hopper_extend(sm90, torch.bfloat16, k, v, 128, 128, True) == (page % 16 == 0)
