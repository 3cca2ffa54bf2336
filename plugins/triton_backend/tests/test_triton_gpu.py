"""GPU suite (`pytest -m gpu`): the interpreter checks at realistic sizes on CUDA, bf16 included,
real CUDA-graph capture/replay against eager, and batch invariance in deterministic mode."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from triton_determinism_checks import target_rows
from triton_graph_checks import check_graph_matches_eager
from triton_helpers import factory

from attn_core.contract.forward_mode import ForwardMode
from attn_core.testing.harness import AttnCase, assert_case
from attn_triton.config import extend_config_for, hopper_kernels_available
from attn_triton.kernels.extend import ExtendConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GQA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, device="cuda", num_layers=1)
MLA = dict(arch="mla", kv_lora_rank=512, qk_rope_head_dim=64, num_q_heads=16, device="cuda", num_layers=1)
#: DeepSeek-V3's per-GPU MLA shape at TP 1: 128 heads over one 512 + 64 latent (the MLA kernel's target)
MLA128 = {**MLA, "num_q_heads": 128}
MLA_256 = {**MLA, "kv_lora_rank": 256, "qk_rope_head_dim": 32, "num_q_heads": 32}
MLA_128 = {**MLA, "kv_lora_rank": 128, "qk_rope_head_dim": 16, "num_q_heads": 16}
GQA2 = {**GQA, "num_layers": 2}
FP8 = "float8_e4m3fn"

CASES = [
    AttnCase("DECODE", [(4095, 1), (0, 1), (1000, 1), (8191, 1)], dtype="bfloat16", page_size=16, **GQA),
    AttnCase("DECODE", [(300, 1), (2047, 1)], dtype="float16", page_size=64, **GQA),
    AttnCase("DECODE", [(3000, 1), (17, 1)], dtype="float32", page_size=1, return_lse=True, **GQA),
    AttnCase(
        "DECODE",
        [(5000, 1), (60, 1)],
        dtype="bfloat16",
        sliding_window=1024,
        logit_cap=30.0,
        sinks=True,
        return_lse=True,
        **GQA,
    ),
    AttnCase("EXTEND", [(0, 1000), (1500, 513), (64, 1), (700, 0)], dtype="bfloat16", page_size=16, **GQA),
    AttnCase("EXTEND", [(2000, 300), (0, 129)], dtype="float32", return_lse=True, **GQA),
    AttnCase(
        "EXTEND", [(900, 700)], dtype="float16", sliding_window=256, logit_cap=20.0, sinks=True, page_size=64, **GQA
    ),
    AttnCase("MIXED", [(1200, 1), (300, 400), (0, 77)], dtype="bfloat16", page_size=16, return_lse=True, **GQA),
    AttnCase("TARGET_VERIFY", [(1500, 8), (40, 8), (3000, 8)], dtype="bfloat16", page_size=16, return_lse=True, **GQA),
    AttnCase("TARGET_VERIFY", [(800, 6), (1, 6)], dtype="float32", **GQA),
    AttnCase("DRAFT_EXTEND", [(1000, 4), (200, 3)], dtype="bfloat16", **GQA),
    AttnCase("EXTEND", [(0, 30, 1500), (20, 10, 700)], dtype="bfloat16", cross_attention=True, return_lse=True, **GQA),
    AttnCase("DECODE", [(10, 1, 1500), (40, 1, 700)], dtype="bfloat16", cross_attention=True, **GQA),
    # chunked local attention (virtual batches in extend-like modes, chunk starts in DECODE), chunk
    # sizes off the page size, chunked and full layers interleaved over one metadata
    AttnCase(
        "EXTEND", [(0, 1000), (1500, 513), (700, 0)], dtype="bfloat16", page_size=16, attention_chunk_size=200, **GQA
    ),
    AttnCase(
        "DECODE", [(4095, 1), (0, 1), (8191, 1)], dtype="bfloat16", page_size=16, attention_chunk_size=1000, **GQA
    ),
    AttnCase(
        "MIXED",
        [(1200, 1), (300, 400), (0, 77)],
        dtype="bfloat16",
        attention_chunk_size=256,
        chunk_even_layers_only=True,
        return_lse=True,
        **{**GQA, "num_layers": 2},
    ),
    # sliding-window KV pool: window layers (even) in the window pool, full layers (odd) in the full pool
    AttnCase(
        "DECODE",
        [(4095, 1), (0, 1), (1000, 1)],
        dtype="bfloat16",
        page_size=16,
        sliding_window=512,
        window_even_layers_only=True,
        window_pool=True,
        **{**GQA, "num_layers": 2},
    ),
    AttnCase(
        "EXTEND",
        [(3000, 500), (0, 700), (64, 1)],
        dtype="bfloat16",
        page_size=16,
        sliding_window=256,
        window_even_layers_only=True,
        window_pool=True,
        return_lse=True,
        **{**GQA, "num_layers": 2},
    ),
    # cascade attention: 16 requests over a shared 2048-token prefix (their own copies poisoned)
    AttnCase(
        "DECODE", [(2048 + 256, 1)] * 16, dtype="bfloat16", page_size=16, cascade_prefix=2048, return_lse=True, **GQA
    ),
    AttnCase(
        "EXTEND", [(2048, 256), (2100, 77), (2048, 1)] * 4, dtype="bfloat16", page_size=16, cascade_prefix=2048, **GQA
    ),
    # head dims 64 / 256, MHA and MQA layouts
    AttnCase(
        "DECODE",
        [(2000, 1), (33, 1)],
        dtype="bfloat16",
        num_q_heads=16,
        num_kv_heads=16,
        head_dim=64,
        device="cuda",
        num_layers=1,
    ),
    AttnCase(
        "EXTEND",
        [(500, 300)],
        dtype="bfloat16",
        num_q_heads=8,
        num_kv_heads=1,
        head_dim=256,
        device="cuda",
        num_layers=1,
    ),
    AttnCase(
        "DECODE",
        [(1500, 1), (9, 1)],
        dtype="float16",
        num_q_heads=8,
        num_kv_heads=1,
        head_dim=256,
        device="cuda",
        num_layers=1,
    ),
    # absorbed MLA, kv_lora_rank 512 + rope 64
    AttnCase("DECODE", [(2000, 1), (100, 1), (1, 1)], dtype="bfloat16", page_size=64, return_lse=True, **MLA),
    AttnCase("EXTEND", [(600, 200), (0, 90)], dtype="bfloat16", **MLA),
    AttnCase("TARGET_VERIFY", [(700, 4), (30, 4)], dtype="float32", **MLA),
    # the MLA kernel (kernels/mla_decode.py) at 128 heads: decode with splits, verify with tree masks
    AttnCase(
        "DECODE", [(4095, 1), (1, 1), (2000, 1), (8191, 1)], dtype="bfloat16", page_size=64, return_lse=True, **MLA128
    ),
    AttnCase(
        "DECODE",
        [(3000, 1), (77, 1)],
        dtype="float16",
        page_size=1,
        sliding_window=700,
        logit_cap=30.0,
        sinks=True,
        **MLA128,
    ),
    AttnCase("DECODE", [(1500, 1), (33, 1)], dtype="float32", page_size=16, return_lse=True, **MLA128),
    AttnCase(
        "TARGET_VERIFY", [(4000, 4), (30, 4), (1000, 4)], dtype="bfloat16", page_size=64, return_lse=True, **MLA128
    ),
    AttnCase("TARGET_VERIFY", [(2500, 8), (9, 8)], dtype="bfloat16", page_size=16, custom_mask=False, **MLA128),
    AttnCase(
        "TARGET_VERIFY", [(1200, 16), (64, 16)], dtype="float16", page_size=1, sinks=True, logit_cap=25.0, **MLA128
    ),
    AttnCase("DRAFT_EXTEND", [(1000, 3), (200, 3)], dtype="bfloat16", page_size=64, **MLA128),
    # smaller latents, on the Hopper MLA kernel too (`mla_decode.uses_wgmma`): 256 + 32 and 128 + 16
    AttnCase(
        "DECODE", [(3000, 1), (64, 1), (1, 1)], dtype="bfloat16", page_size=16, return_lse=True, sinks=True, **MLA_256
    ),
    AttnCase("TARGET_VERIFY", [(1500, 4), (20, 4)], dtype="float16", page_size=64, **MLA_128),
    # fp8 (e4m3) KV caches, per-layer k_scale / v_scale (the harness's FP8_SCALES): decode with many
    # splits, extend with a prefix, verify, windowed decode, two layers (both scale pairs), MLA decode
    AttnCase("DECODE", [(4095, 1), (0, 1), (1000, 1), (8191, 1)], dtype="bfloat16", kv_dtype=FP8, page_size=16, **GQA2),
    AttnCase(
        "EXTEND", [(0, 1000), (1500, 513), (64, 1), (700, 0)], dtype="bfloat16", kv_dtype=FP8, page_size=16, **GQA2
    ),
    AttnCase(
        "TARGET_VERIFY",
        [(1500, 8), (40, 8), (3000, 8)],
        dtype="float16",
        kv_dtype=FP8,
        page_size=16,
        return_lse=True,
        **GQA2,
    ),
    AttnCase(
        "DECODE",
        [(5000, 1), (60, 1)],
        dtype="bfloat16",
        kv_dtype=FP8,
        sliding_window=1024,
        sinks=True,
        return_lse=True,
        **GQA2,
    ),
    AttnCase("MIXED", [(1200, 1), (300, 400), (0, 77)], dtype="float32", kv_dtype=FP8, page_size=16, **GQA2),
    AttnCase(
        "DECODE", [(2000, 1), (100, 1), (1, 1)], dtype="bfloat16", kv_dtype=FP8, page_size=64, return_lse=True, **MLA
    ),
    AttnCase("EXTEND", [(600, 200), (0, 90)], dtype="bfloat16", kv_dtype=FP8, **MLA),
]


@pytest.mark.parametrize("case", CASES, ids=[c.describe() for c in CASES])
def test_case_on_cuda(case):
    assert_case(factory(), case)


#: the Hopper extend kernel (kernels/extend_wgmma.py, the SM90 default) under both tile choices on every case above
#: whose extend launches it takes (16-bit, head_dim 128, not MLA, no fp8 cache: `extend.uses_wgmma`; the rest of a
#: step, its decode rows and tree masks, keeps the other kernels), and an MHA case at head_dim 64 (one head a program)
# its tiles: 64 keys in 4 buffers (consumers at 224 registers a thread), 128 keys in 3 at 208 (the default)
# and the default with its producer cleaning the tiles of keys some rows do not see (`wgmma_clean_masked`)
HOPPER_EXTENDS = [
    ExtendConfig(128, 64, 4, 3, 4, wgmma_block_n=64, wgmma_stages=4),
    extend_config_for(128, 128, torch.bfloat16, False, True),
    dataclasses.replace(extend_config_for(128, 128, torch.bfloat16, False, True), wgmma_clean_masked=True),
]
HOPPER_CASES = [
    c
    for c in CASES
    if c.mode in (ForwardMode.EXTEND, ForwardMode.MIXED)
    and c.dtype != "float32"
    and c.arch != "mla"
    and not c.kv_dtype
    and c.head_dim == 128
] + [
    AttnCase(
        "EXTEND",
        [(700, 300), (0, 77), (5, 1)],
        dtype="float16",
        num_q_heads=16,
        num_kv_heads=16,
        head_dim=64,
        device="cuda",
    ),
    # pages of 64: whole tiles by TMA, each range's last tile gathered
    AttnCase(
        "EXTEND",
        [(1000, 300), (2047, 513), (64, 64)],
        dtype="bfloat16",
        page_size=64,
        sliding_window=700,
        return_lse=True,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        device="cuda",
    ),
    # page-major (HND) pools, as vLLM's HND caches: whole boxes of a page by TMA at the page's rows
    # (`common.tma_page_geometry`), the rest gathered page by page
    AttnCase(
        "EXTEND",
        [(1000, 300), (37, 200), (0, 129)],
        dtype="bfloat16",
        page_size=16,
        kv_layout="HND",
        return_lse=True,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        device="cuda",
    ),
    AttnCase(
        "MIXED",
        [(2047, 513), (700, 1), (64, 64)],
        dtype="float16",
        page_size=64,
        kv_layout="HND",
        sliding_window=700,
        num_q_heads=16,
        num_kv_heads=4,
        head_dim=128,
        device="cuda",
    ),
]


HOPPER = torch.cuda.is_available() and hopper_kernels_available(torch.device("cuda"))


@pytest.mark.skipif(not HOPPER, reason="needs compute capability 9.x")
@pytest.mark.parametrize(
    "config",
    HOPPER_EXTENDS,
    ids=lambda c: f"g{c.wgmma_block_n}x{c.wgmma_stages}r{c.wgmma_regs}" + ("-clean" if c.wgmma_clean_masked else ""),
)
@pytest.mark.parametrize("case", HOPPER_CASES, ids=[c.describe() for c in HOPPER_CASES])
def test_hopper_extend_kernel_case_on_cuda(case, config):
    assert_case(factory(extend_config=config), case)


#: the kit's masked-values check (`attn_core.testing.masked`: an Inf / NaN in a key some rows do not see must not
#: reach them) on the Hopper extend kernel with `wgmma_clean_masked`: the kit's case that failed on the default
#: (2026-11-29), GQA at pages of 16 with long prefixes, MIXED, and a window (old keys poisoned too)
MASKED_CASES = [
    AttnCase(
        "EXTEND",
        [(0, 64), (512, 33), (257, 1), (172, 0)],
        dtype="float16",
        num_q_heads=16,
        num_kv_heads=4,
        head_dim=128,
        device="cuda",
        num_layers=3,
    ),
    AttnCase("EXTEND", [(0, 300), (1000, 129), (5, 2), (64, 64)], dtype="bfloat16", page_size=16, **GQA2),
    AttnCase("MIXED", [(1200, 1), (300, 400), (0, 77)], dtype="bfloat16", page_size=16, return_lse=True, **GQA2),
    AttnCase("EXTEND", [(1000, 300), (2047, 513)], dtype="bfloat16", page_size=64, sliding_window=700, **GQA2),
]


@pytest.mark.skipif(not HOPPER, reason="needs compute capability 9.x")
@pytest.mark.parametrize("case", MASKED_CASES[:3], ids=[c.describe() for c in MASKED_CASES[:3]])
def test_hopper_extend_default_keeps_masked_values_out(case):
    """The default Hopper kernel (no clean): the new tokens' Inf / NaN go through attn's K/V write, which stores
    a non-finite value as K = NaN, V = 0 (`attn_core.ops.kv_write.clean_nonfinite`), so nothing leaks."""
    from attn_core.testing.masked import masked_nonfinite_check
    from attn_core.testing.target import resolve_target

    target = resolve_target("triton", {"extend_config": extend_config_for(128, 128, torch.bfloat16, False, True)})
    print(masked_nonfinite_check(target, case)())


@pytest.mark.skipif(not HOPPER, reason="needs compute capability 9.x")
@pytest.mark.parametrize("case", MASKED_CASES, ids=[c.describe() for c in MASKED_CASES])
def test_hopper_extend_clean_keeps_masked_values_out(case):
    from attn_core.testing.masked import masked_nonfinite_check
    from attn_core.testing.target import resolve_target

    clean = dataclasses.replace(extend_config_for(128, 128, torch.bfloat16, False, True), wgmma_clean_masked=True)
    target = resolve_target("triton", {"extend_config": clean})
    print(masked_nonfinite_check(target, case, window_keys=case.sliding_window is not None)())


def _cuda_graph_run(fn, replay):
    """Capture `fn` with the capture-time (dummy) metadata, then refresh it (replay) and replay the graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    replay()
    graph.replay()
    torch.cuda.synchronize()
    return out


GRAPH_CASES = [
    AttnCase("DECODE", [(4000, 1), (10, 1), (700, 1)], dtype="bfloat16", page_size=16, return_lse=True, **GQA),
    AttnCase("DECODE", [(1000, 1), (3, 1)], dtype="bfloat16", sinks=True, sliding_window=128, **GQA),
    AttnCase("DECODE", [(1500, 1), (20, 1)], dtype="bfloat16", **MLA),
    AttnCase("DECODE", [(4095, 1), (20, 1), (8000, 1)], dtype="bfloat16", page_size=64, return_lse=True, **MLA128),
    AttnCase("TARGET_VERIFY", [(4000, 4), (40, 4)], dtype="bfloat16", page_size=64, return_lse=True, **MLA128),
    AttnCase("TARGET_VERIFY", [(1500, 8), (40, 8)], dtype="bfloat16", page_size=16, return_lse=True, **GQA),
    # the verify kernel (issue 15): 4 drafts, chain (causal, no mask) and tree masks
    AttnCase("TARGET_VERIFY", [(4000, 4), (0, 4), (700, 4)], dtype="bfloat16", page_size=16, custom_mask=False, **GQA),
    AttnCase("TARGET_VERIFY", [(4000, 4), (33, 4)], dtype="bfloat16", page_size=16, sinks=True, return_lse=True, **GQA),
    AttnCase(
        "DECODE", [(4000, 1), (10, 1), (700, 1)], dtype="bfloat16", kv_dtype=FP8, page_size=16, return_lse=True, **GQA2
    ),
    AttnCase("TARGET_VERIFY", [(1500, 8), (40, 8)], dtype="bfloat16", kv_dtype=FP8, page_size=16, **GQA2),
    AttnCase("DECODE", [(1500, 1), (20, 1)], dtype="bfloat16", kv_dtype=FP8, **MLA),
]


@pytest.mark.parametrize("case", GRAPH_CASES, ids=[c.describe() for c in GRAPH_CASES])
@pytest.mark.parametrize("pad", [0, 3])
def test_cuda_graph_replay_equals_eager(case, pad):
    check_graph_matches_eager(factory(), case, pad=pad, run_graph=_cuda_graph_run)


#: the MLA kernel's paths against the torch_native backend on the same batch, pool and inputs
MLA_PEER_CASES = [
    AttnCase("DECODE", [(4095, 1), (100, 1), (1, 1)], dtype="bfloat16", page_size=64, **MLA128),
    AttnCase("TARGET_VERIFY", [(4000, 4), (500, 4)], dtype="bfloat16", page_size=64, **MLA128),
]


@pytest.mark.parametrize("case", MLA_PEER_CASES, ids=[c.describe() for c in MLA_PEER_CASES])
def test_mla_kernel_matches_torch_native(case):
    from attn_core.discovery.registry import create_backend
    from attn_core.testing.harness import forward_extras, layer_inputs, make_env, make_layer
    from attn_core.testing.reference import relative_error, tolerance

    env = make_env(case)
    layer = make_layer(case, 0)
    inputs = layer_inputs(env, 0, torch.Generator().manual_seed(5))
    outs = []
    for name in ("triton", "torch_native"):  # both write the same new K/V, then read the same pool
        backend = create_backend(name, env.ctx)
        env.batch.attn_backend = backend
        backend.init_forward_metadata(env.batch)
        outs.append(
            backend.forward(inputs["q"], inputs["k"], inputs["v"], layer, env.batch, **forward_extras(case, inputs))
        )
    assert relative_error(outs[0], outs[1]) <= tolerance(torch.bfloat16)


def _mla_variants():
    """The MLA kernels' variants besides the SM90 default (the Hopper kernel `kernels/mla_wgmma.py`,
    64x32x8x4:c1:g1, which the other MLA tests run; docs/dev/perf-notebook.md "MLA kernel variants"): the portable
    kernel at the former SM90 default and at the 64-row tile, the Hopper kernel with SplitPolicy splits
    (merged), and, with a split policy capped at one split, the decode that finalizes in the kernel (no
    merge launch) at every batch size, on both kernels."""
    from attn_triton.config import SplitPolicy
    from attn_triton.kernels.mla_decode import MLAConfig

    one_split = SplitPolicy(cap=1)
    return {
        "32x64x4x3:c2:l8": dict(mla_config=MLAConfig(32, 64, 4, 3, ctas_per_sm=2, lazy_rescale=8)),
        "64x32x8x2:c1:l8": dict(mla_config=MLAConfig(64, 32, 8, 2, ctas_per_sm=1, lazy_rescale=8)),
        "32x64x4x3:c2:l8 one split": dict(
            mla_config=MLAConfig(32, 64, 4, 3, ctas_per_sm=2, lazy_rescale=8), split_policy=one_split
        ),
        "64x32x8x4:g1 splits": dict(mla_config=MLAConfig(64, 32, 8, 4, wgmma=True)),
        "64x32x8x4:c1:g1 one split": dict(
            mla_config=MLAConfig(64, 32, 8, 4, ctas_per_sm=1, wgmma=True), split_policy=one_split
        ),
    }


MLA_VARIANT_CASES = [
    AttnCase(
        "DECODE", [(4095, 1), (1, 1), (2000, 1), (8191, 1)], dtype="bfloat16", page_size=64, return_lse=True, **MLA128
    ),
    AttnCase(
        "DECODE",
        [(3000, 1), (77, 1)],
        dtype="float16",
        page_size=1,
        sliding_window=700,
        logit_cap=30.0,
        sinks=True,
        **MLA128,
    ),
    AttnCase(
        "TARGET_VERIFY", [(4000, 4), (30, 4), (1000, 4)], dtype="bfloat16", page_size=64, return_lse=True, **MLA128
    ),
    AttnCase("TARGET_VERIFY", [(2500, 8), (9, 8)], dtype="bfloat16", page_size=16, custom_mask=False, **MLA128),
]


@pytest.mark.parametrize("variant", list(_mla_variants()))
@pytest.mark.parametrize("case", MLA_VARIANT_CASES, ids=[c.describe() for c in MLA_VARIANT_CASES])
def test_mla_kernel_variants_on_cuda(case, variant):
    assert_case(factory(**_mla_variants()[variant]), case)


@pytest.mark.parametrize(
    "variant", ["32x64x4x3:c2:l8", "32x64x4x3:c2:l8 one split", "64x32x8x4:g1 splits", "64x32x8x4:c1:g1 one split"]
)
def test_mla_kernel_variants_graph_equals_eager(variant):
    case = AttnCase(
        "DECODE", [(4095, 1), (20, 1), (8000, 1)], dtype="bfloat16", page_size=64, return_lse=True, **MLA128
    )
    check_graph_matches_eager(factory(**_mla_variants()[variant]), case, pad=3, run_graph=_cuda_graph_run)


@pytest.mark.parametrize("wgmma", [True, False])
def test_mla_one_split_launch_equals_merged_on_cuda(wgmma):
    """Both MLA kernels at 128 heads, 512 + 64, bf16: a DECODE launch of one split finishing its rows in the
    kernel and a merged launch of 4 splits in which every request takes one split write the same bits
    (batch invariance; `test_mla_one_split_launch_equals_merged` checks the portable kernel on the CPU)."""
    from attn_triton.kernels.mla_decode import MLAConfig, mla_attention

    gen = torch.Generator(device="cuda").manual_seed(3)
    lens, heads, page = [1, 700, 4096, 2500], 128, 64
    bs = len(lens)
    pages = [-(-n // page) for n in lens]
    perm = torch.randperm(sum(pages), generator=gen, device="cuda")
    slots, start = [], 0
    for n, p in zip(lens, pages):
        slots.append((perm[start : start + p, None] * page + torch.arange(page, device="cuda")).reshape(-1)[:n])
        start += p
    indices = torch.cat(slots).to(torch.int32)
    indptr = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    kv = torch.randn(sum(pages) * page, 1, 576, generator=gen, device="cuda").to(torch.bfloat16)
    q = torch.randn(bs, heads, 576, generator=gen, device="cuda").to(torch.bfloat16)
    sinks = torch.randn(heads, generator=gen, device="cuda")
    outs = []
    for ctas, max_splits in ((1, 1), (0, 4)):
        tiles = (64, 32, 8, 4) if wgmma else (32, 64, 4, 3)
        o = torch.full((bs, heads, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
        lse = torch.full((bs, heads), float("nan"), device="cuda")
        part_o = torch.empty(bs, heads, max_splits, 512, device="cuda")
        part_lse = torch.empty(bs, heads, max_splits, device="cuda")
        fault = torch.zeros(8, device="cuda", dtype=torch.int32)
        mla_attention(
            q,
            kv,
            o,
            indptr,
            indices,
            fault,
            kv_lora_rank=512,
            sm_scale=0.07,
            config=MLAConfig(*tiles, ctas_per_sm=ctas, wgmma=wgmma),
            max_splits=max_splits,
            min_split_len=8192,
            part_o=part_o,
            part_lse=part_lse,
            sinks=sinks,
            lse_out=lse,
            v_scale=0.5,
        )
        assert not fault.any()
        outs.append((o, lse))
    (o1, lse1), (o4, lse4) = outs
    assert not o1.isnan().any() and torch.equal(o1, o4) and torch.equal(lse1, lse4)


DET_DECODE = [([(6000, 1)], 0), ([(100, 1), (6000, 1), (30000, 1)], 1), ([(5, 1)] * 40 + [(6000, 1)], 40)]
DET_EXTEND = [([(3000, 700)], 0), ([(0, 2000), (3000, 700)], 1), ([(3000, 700), (10, 1), (5000, 60)], 0)]


@pytest.mark.parametrize("mode,batches", [("DECODE", DET_DECODE), ("EXTEND", DET_EXTEND)])
def test_deterministic_batch_invariance_on_cuda(mode, batches):
    f = factory()
    kw = dict(
        deterministic=True,
        device="cuda",
        dtype="bfloat16",
        page_size=16,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        num_layers=1,
    )
    outs = [target_rows(f, mode, reqs, t, **kw) for reqs, t in batches]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
