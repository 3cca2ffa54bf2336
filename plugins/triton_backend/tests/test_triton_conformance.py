"""Every declared capability and mode of the Triton backend against the float64 oracle (harness).

Tiny shapes under the Triton interpreter (fp16/fp32: bf16 dots are not emulated faithfully there);
the GPU file repeats the same checks at realistic sizes with bf16.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from triton_helpers import requires_interpreter, small_split_factory

from attn_core.testing.batch_builder import RequestShape
from attn_core.testing.compose import compose_requests
from attn_core.testing.harness import AttnCase, assert_case
from attn_core.testing.profile import profile_for

pytestmark = requires_interpreter

MLA = dict(arch="mla", kv_lora_rank=32, qk_rope_head_dim=8, num_q_heads=4)
FP8 = "float8_e4m3fn"

CASES = [
    # plain modes, GQA 4/2, fp32 and fp16, page sizes 1/16/64
    AttnCase("EXTEND", [(0, 5), (3, 4), (17, 1), (40, 0)]),
    AttnCase("EXTEND", [(0, 33), (21, 19)], dtype="float16", page_size=16),
    AttnCase("EXTEND", [(63, 2), (0, 70)], page_size=64),
    AttnCase("DECODE", [(7, 1), (2, 1), (0, 1), (90, 1)]),
    AttnCase("DECODE", [(100, 1), (15, 1), (33, 1)], page_size=16, dtype="float16"),
    AttnCase("DECODE", [(129, 1), (64, 1)], page_size=64),
    AttnCase("MIXED", [(7, 1), (2, 6), (0, 3), (30, 1)], page_size=16),
    AttnCase("DRAFT_EXTEND", [(7, 2), (2, 3), (45, 4)], dtype="float16"),
    AttnCase("TARGET_VERIFY", [(7, 4), (2, 4), (50, 4)], return_lse=True),
    AttnCase("TARGET_VERIFY", [(31, 6), (0, 6)], page_size=16, dtype="float16"),
    AttnCase("TARGET_VERIFY", [(9, 3), (20, 3)], custom_mask=False),
    # head layouts: MHA, MQA, wide groups, head dims 16/64, v_head_dim != head_dim
    AttnCase("DECODE", [(20, 1), (41, 1)], num_q_heads=3, num_kv_heads=3),
    AttnCase("EXTEND", [(20, 9), (0, 17)], num_q_heads=8, num_kv_heads=1),
    AttnCase("DECODE", [(37, 1), (5, 1)], num_q_heads=24, num_kv_heads=1),
    AttnCase("DECODE", [(37, 1), (5, 1)], num_q_heads=6, num_kv_heads=2, head_dim=64, dtype="float16"),
    AttnCase("EXTEND", [(12, 7), (3, 20)], head_dim=16, num_q_heads=2, num_kv_heads=1),
    AttnCase("EXTEND", [(12, 7), (3, 20)], head_dim=32, v_head_dim=16),
    AttnCase("DECODE", [(12, 1), (30, 1)], head_dim=24, v_head_dim=40),
    # sliding window, logit cap, sinks, LSE in both kernels
    AttnCase("EXTEND", [(30, 12), (0, 25)], sliding_window=7, return_lse=True),
    AttnCase("DECODE", [(70, 1), (20, 1), (3, 1)], sliding_window=9, return_lse=True),
    AttnCase(
        "MIXED", [(7, 1), (2, 6), (0, 3)], page_size=4, sliding_window=3, logit_cap=5.0, sinks=True, return_lse=True
    ),
    AttnCase("EXTEND", [(10, 10), (0, 30)], logit_cap=2.0, dtype="float16"),
    AttnCase("DECODE", [(50, 1), (6, 1)], logit_cap=1.5, sinks=True, return_lse=True),
    AttnCase("EXTEND", [(5, 6), (0, 1)], sinks=True, return_lse=True, page_size=16),
    AttnCase("TARGET_VERIFY", [(25, 5), (3, 5)], sliding_window=6, sinks=True, logit_cap=4.0, return_lse=True),
    AttnCase("DRAFT_EXTEND", [(40, 3), (9, 2)], sliding_window=1, return_lse=True),
    # cross attention (non-causal over encoder keys) and encoder-decoder self attention
    AttnCase("EXTEND", [(0, 3, 5), (4, 2, 3), (0, 6, 20)], cross_attention=True, return_lse=True),
    AttnCase("DECODE", [(0, 1, 5), (4, 1, 30)], cross_attention=True, page_size=16),
    AttnCase("DECODE", [(0, 1, 5), (4, 1, 3)]),
    AttnCase("EXTEND", [(3, 4, 6), (0, 5, 2)], page_size=16, sliding_window=4),
    AttnCase("MIXED", [(3, 1, 6), (0, 5, 2)], cross_attention=True, sinks=True, dtype="float16"),
    # absorbed MLA (latent kv_lora_rank + rope), decode and extend-like modes
    AttnCase("DECODE", [(9, 1), (2, 1), (70, 1)], **MLA),
    AttnCase("DECODE", [(40, 1), (2, 1)], page_size=16, dtype="float16", return_lse=True, **MLA),
    AttnCase("EXTEND", [(2, 3), (0, 4), (30, 9)], dtype="float16", **MLA),
    AttnCase("TARGET_VERIFY", [(12, 3), (5, 3)], return_lse=True, **MLA),
    AttnCase("MIXED", [(12, 1), (5, 7)], sliding_window=5, logit_cap=3.0, sinks=True, page_size=16, **MLA),
    AttnCase("DRAFT_EXTEND", [(12, 2), (5, 3)], dtype="float16", **MLA),
    # the MLA kernel's folded verify / draft extend (same q_len per request) and decode with every feature
    AttnCase("TARGET_VERIFY", [(30, 8), (0, 8), (65, 8)], dtype="float16", page_size=64, **MLA),
    AttnCase(
        "TARGET_VERIFY",
        [(21, 2), (4, 2)],
        custom_mask=False,
        sliding_window=6,
        logit_cap=3.0,
        sinks=True,
        return_lse=True,
        **MLA,
    ),
    AttnCase("DRAFT_EXTEND", [(12, 4), (40, 4)], page_size=16, return_lse=True, **MLA),
    AttnCase(
        "DECODE",
        [(50, 1), (6, 1), (0, 1)],
        sliding_window=9,
        logit_cap=2.0,
        sinks=True,
        return_lse=True,
        steps=((0, 1), (2,)),
        **MLA,
    ),
    # one-token requests, zero-length prefixes, empty extend rows, lengths off every block size
    AttnCase("EXTEND", [(0, 1), (0, 1), (0, 1)]),
    AttnCase("EXTEND", [(0, 17), (0, 0), (0, 31)], page_size=16),
    AttnCase("DECODE", [(0, 1)]),
    AttnCase("DECODE", [(0, 1), (127, 1), (17, 1), (65, 1)], page_size=64, sinks=True),
    # chunked local attention: virtual batches (chunk not a multiple of the page size), decode chunk starts
    AttnCase("EXTEND", [(0, 17), (9, 12), (30, 0)], page_size=16, attention_chunk_size=6, return_lse=True),
    AttnCase("MIXED", [(13, 1), (2, 9), (0, 3)], attention_chunk_size=4, chunk_even_layers_only=True, dtype="float16"),
    AttnCase("DECODE", [(40, 1), (7, 1), (0, 1)], page_size=16, attention_chunk_size=7, steps=((0, 1), (2,))),
    # sliding-window KV pool (released prefix keys poisoned), window and full layers interleaved
    AttnCase(
        "EXTEND",
        [(30, 12), (0, 25), (9, 3)],
        page_size=16,
        sliding_window=7,
        window_even_layers_only=True,
        window_pool=True,
    ),
    AttnCase(
        "DECODE", [(70, 1), (20, 1), (3, 1)], sliding_window=9, window_pool=True, return_lse=True, steps=((0,), (1, 2))
    ),
    # several steps on one backend object (metadata rebuilt per step)
    AttnCase("DECODE", [(7, 1), (20, 1), (3, 1), (50, 1)], steps=((0, 1), (2, 3))),
    AttnCase("EXTEND", [(0, 9), (6, 5), (2, 2)], steps=((0,), (1, 2))),
    # fp8 (e4m3) KV caches with per-layer scales: split decode (several splits), extend with a window and
    # sinks, verify, two steps, absorbed MLA decode (V read from the latent, scaled by k_scale)
    AttnCase("DECODE", [(100, 1), (15, 1), (33, 1)], page_size=16, dtype="float16", kv_dtype=FP8, return_lse=True),
    AttnCase("EXTEND", [(30, 12), (0, 25)], sliding_window=7, sinks=True, kv_dtype=FP8, return_lse=True),
    AttnCase("TARGET_VERIFY", [(31, 6), (0, 6)], page_size=16, dtype="float16", kv_dtype=FP8),
    AttnCase("DECODE", [(40, 1), (7, 1)], page_size=16, kv_dtype=FP8, steps=((0,), (1,))),
    AttnCase("DECODE", [(40, 1), (2, 1)], page_size=16, dtype="float16", kv_dtype=FP8, **MLA),
    AttnCase("MIXED", [(12, 1), (5, 7)], kv_dtype=FP8, **MLA),
]


@pytest.mark.parametrize("case", CASES, ids=[c.describe() for c in CASES])
def test_case(case):
    assert_case(small_split_factory(), case)


# the kit's own tiny CPU profile, trimmed further: the interpreter is slow
_PROFILE = replace(
    profile_for("cpu", quick=True),
    name="triton-cpu",
    long_len=70,
    max_draft=4,
    hypothesis_examples=1,
    head_dims=(32,),
    gqa=((4, 2),),
    windows=(3,),
)


@pytest.mark.parametrize("mode", ["EXTEND", "DECODE", "MIXED", "TARGET_VERIFY", "DRAFT_EXTEND"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_compositions(mode, seed):
    rng = random.Random(f"{mode}-{seed}")
    reqs = [RequestShape(*r) for r in compose_requests(rng.randint, mode, _PROFILE)]
    page = rng.choice([1, 16, 64])
    dtype = rng.choice(["float32", "float16"])
    assert_case(small_split_factory(), AttnCase(mode, reqs, page_size=page, dtype=dtype, seed=seed, return_lse=True))
