"""The MIXED split of attn-flashinfer (`attn_flashinfer.mixed`, option `mixed_split`) on the CPU, over the
float64 stand-in for FlashInfer's wrappers (`fake_flashinfer.py`, the `factory` fixture of conftest.py):
the kit's MIXED checks with the split on; random MIXED batches (decodes interleaved with chunks,
prefixes, empty extend rows, page sizes 1/16, windows, logit caps, LSE, HND) against the float64 oracle
with NaN-poisoned KV; several engine steps through `RequestPool` / `build_step`, split and unsplit,
against a plain float64 loop; a dispatch spy on which rows each wrapper got. Skipped where the real
flashinfer is importable (test_gpu_mixed_split.py runs the real thing there).
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

import attn_core as ac
from attn_core.contract.errors import InvalidArgumentError
from attn_core.testing.engine_steps import MIXED_STEPS, EngineWorld, compare_over_steps
from attn_core.testing.harness import AttnCase, assert_case

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is not None, reason="the real flashinfer is installed"
)

BASE = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, device="cpu")


def split_kind(backend) -> str:
    """`split` when the backend's current metadata is a split MIXED step, else `one plan`."""
    return "split" if type(backend.forward_metadata).__name__ == "SplitStep" else "one plan"


def recording(factory, made: list, **options):
    def make(ctx):
        made.append(factory(ctx, **options))
        return made[-1]

    return make


def test_option_is_checked(factory):
    with pytest.raises(InvalidArgumentError, match="mixed_split"):
        assert_case(
            lambda ctx: factory(ctx, mixed_split=1), AttnCase("MIXED", [(3, 1), (0, 2)], dtype="float16", **BASE)
        )


def test_kit_mixed_checks_with_the_split(factory, monkeypatch):
    """The conformance kit's MIXED checks (its own compositions and feature mixes) on a backend built
    with `mixed_split=True`; the split served some of their layers."""
    from attn_core.testing.kit import make_plan
    from attn_core.testing.outcome import execute

    mixed = importlib.import_module("attn_flashinfer.mixed")
    calls = []
    real = mixed.MixedPlan.run
    monkeypatch.setattr(mixed.MixedPlan, "run", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    plan = make_plan(factory, device="cpu", quick=True, options={"mixed_split": True})
    # masked_nonfinite-*: a check of the kernels' arithmetic with Inf/NaN in masked keys, which the fake
    # FlashInfer computes densely (it emulates the API, not the kernels); the GPU run checks the real one
    checks = [
        c
        for c in plan.checks
        if "MIXED" in c.id and not c.id.startswith("masked_nonfinite") and plan.skip_reason(c.id) is None
    ]
    assert len(checks) >= 3, [c.id for c in plan.checks]
    for check in checks:
        outcome = execute(check)
        assert outcome.status == "passed", f"{check.id}: {outcome.message}"
    assert calls


CASES = [
    # decode-first (views only), decodes last, interleaved with an empty extend row (gather/scatter)
    AttnCase("MIXED", [(7, 1), (30, 1), (2, 6), (0, 3)], page_size=16, return_lse=True, dtype="float16", **BASE),
    AttnCase("MIXED", [(2, 6), (0, 3), (7, 1), (30, 1)], dtype="bfloat16", **BASE),
    AttnCase(
        "MIXED",
        [(9, 1), (2, 6), (40, 1), (5, 0), (0, 3), (17, 1)],
        page_size=16,
        return_lse=True,
        dtype="float16",
        **BASE,
    ),
    # window (paged over the whole sequence for chunks with a prefix), logit cap, LSE; HND; MQA
    AttnCase(
        "MIXED",
        [(20, 4), (7, 1), (2, 6), (50, 1)],
        sliding_window=5,
        logit_cap=4.0,
        return_lse=True,
        dtype="float16",
        **BASE,
    ),
    AttnCase("MIXED", [(3, 5), (26, 1), (0, 2)], page_size=16, kv_layout="HND", dtype="float16", **BASE),
    AttnCase("MIXED", [(3, 5), (26, 1)], num_q_heads=8, num_kv_heads=1, head_dim=64, dtype="float16", device="cpu"),
    # an fp8 cache with per-layer k_scale / v_scale: the decode part reads it as a DECODE step does
    AttnCase(
        "MIXED",
        [(9, 3), (20, 1), (0, 4), (6, 1)],
        head_dim=128,
        num_q_heads=4,
        num_kv_heads=2,
        dtype="bfloat16",
        kv_dtype="float8_e4m3fn",
        page_size=16,
        return_lse=True,
        device="cpu",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.describe() for c in CASES])
def test_split_case(factory, case):
    made = []
    assert_case(recording(factory, made, mixed_split=True), case)
    assert split_kind(made[0]) == "split"


def random_mixed_case(seed: int) -> AttnCase:
    """3-7 requests, each a decode (a cached prefix and one new token) or a prefill chunk (any prefix,
    0-12 new tokens), shuffled, at least one decode and one chunk; random page size, layout and features."""
    rng = random.Random(seed)
    n = rng.randint(3, 7)
    reqs = [
        (rng.randint(1, 45), 1) if rng.random() < 0.5 else (rng.randint(0, 30), rng.choice([0, 2, 5, 12]))
        for _ in range(n)
    ]
    reqs[0], reqs[1] = (rng.randint(1, 45), 1), (rng.randint(0, 30), rng.randint(2, 12))
    rng.shuffle(reqs)
    return AttnCase(
        "MIXED",
        reqs,
        page_size=rng.choice([1, 16]),
        kv_layout=rng.choice(["NHD", "HND"]),
        dtype=rng.choice(["float16", "bfloat16"]),
        sliding_window=rng.choice([None, None, 6]),
        logit_cap=rng.choice([0.0, 3.0]),
        return_lse=True,
        seed=seed,
        **BASE,
    )


@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_batches(factory, seed):
    case = random_mixed_case(seed)
    made = []
    assert_case(recording(factory, made, mixed_split=True), case)
    assert split_kind(made[0]) == "split", case.describe()


@pytest.mark.parametrize(
    "case",
    [
        AttnCase("MIXED", [(3, 1, 6), (0, 5, 2)], cross_attention=True, dtype="float16", **BASE),
        AttnCase(
            "MIXED",
            [(13, 1), (2, 9), (0, 3)],
            attention_chunk_size=4,
            chunk_even_layers_only=True,
            dtype="float16",
            **BASE,
        ),
        AttnCase("MIXED", [(21, 1), (4, 9), (0, 3)], sliding_window=7, window_pool=True, dtype="float16", **BASE),
        AttnCase("MIXED", [(0, 4), (0, 3)], dtype="float16", **BASE),
        AttnCase("MIXED", [(5, 1), (9, 1)], dtype="float16", **BASE),
        AttnCase("MIXED", [(5, 1), (4, 0), (9, 1)], dtype="float16", **BASE),
    ],
    ids=[
        "encoder tokens",
        "chunked local attention",
        "window pool",
        "no decode",
        "only decodes",
        "decodes and an empty row",
    ],
)
def test_steps_the_split_does_not_serve_keep_one_plan(factory, case):
    made = []
    assert_case(recording(factory, made, mixed_split=True), case)
    assert split_kind(made[0]) == "one plan"


# ---- which rows each wrapper gets ----------------------------------------------------------------
def test_decode_wrapper_gets_exactly_the_decode_rows(factory, monkeypatch):
    """An interleaved MIXED step (query lengths [4, 1, 2, 1, 3]: decodes are requests 1 and 3): the
    decode wrapper runs once per layer on exactly the decodes' q rows (rows 7 and 4 of the batch's q, in
    the order of `decode_first_split`: (3, 1, 2, 0, 4)) over 2 requests; the ragged wrapper on the
    chunks' 9 rows, requests 2, 0, 4."""
    fake = factory.fake
    seen = {"decode": [], "ragged": []}
    for name, cls in (
        ("decode", fake.BatchDecodeWithPagedKVCacheWrapper),
        ("ragged", fake.BatchPrefillWithRaggedKVCacheWrapper),
    ):
        real = cls.run

        def spy(self, q, *args, _real=real, _name=name, **kw):
            seen[_name].append(
                (q.clone(), len(self.indptr if _name == "decode" else self.qo) - 1, q.data_ptr(), kw.get("out"))
            )
            return _real(self, q, *args, **kw)

        monkeypatch.setattr(cls, "run", spy)
    dev, hq, hkv, d = torch.device("cpu"), 4, 2, 64
    kv = ac.MHATokenToKVPool(
        size=128, page_size=1, dtype=torch.float16, head_num=hkv, head_dim=d, layer_num=1, device=dev
    )
    rows = ac.ReqToTokenPool(size=8, max_context_len=32, device=dev)
    requests = ac.RequestPool(rows, ac.PagedTokenAllocator(128, 1), kv)
    ctx = ac.BackendContext(
        device=dev,
        dtype=torch.float16,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=1,
        max_batch_size=8,
        max_context_len=32,
        req_to_token_pool=rows,
        token_to_kv_pool=kv,
        forward_modes={"extend", "decode", "mixed"},
    )
    backend = factory(ctx, mixed_split=True)
    layer = ac.AttentionLayer(0, hq, hkv, d)
    reqs = [requests.add() for _ in range(5)]
    prompt = ac.build_step(requests, [(r, 3) for r in reqs], attn_backend=backend)
    backend.init_forward_metadata(prompt)
    layer(*(torch.randn(15, h, d).half() for h in (hq, hkv, hkv)), prompt)
    seen["decode"].clear(), seen["ragged"].clear()
    step = ac.build_step(requests, [(r, n) for r, n in zip(reqs, [4, 1, 2, 1, 3])], attn_backend=backend)
    backend.init_forward_metadata(step)
    assert split_kind(backend) == "split"
    q = torch.randn(11, hq, d).half()
    layer(q, torch.randn(11, hkv, d).half(), torch.randn(11, hkv, d).half(), step)
    ((dq, dreqs, _, _),) = seen["decode"]
    assert dreqs == 2 and torch.equal(dq, q[[7, 4]])
    ((rq, rreqs, _, _),) = seen["ragged"]
    assert rreqs == 3 and torch.equal(rq, q[[5, 6, 0, 1, 2, 3, 8, 9, 10]])
    # a decode-first step: both parts read q and write the output in place (views, no gather or scatter)
    seen["decode"].clear(), seen["ragged"].clear()
    step = ac.build_step(requests, [(r, n) for r, n in zip(reqs, [1, 1, 4, 2, 3])], attn_backend=backend)
    backend.init_forward_metadata(step)
    q = torch.randn(11, hq, d).half()
    out = layer(q, torch.randn(11, hkv, d).half(), torch.randn(11, hkv, d).half(), step)
    ((dq, dreqs, dptr, dout),) = seen["decode"]
    ((rq, rreqs, rptr, rout),) = seen["ragged"]
    assert (dreqs, rreqs) == (2, 3) and torch.equal(dq, q[:2]) and torch.equal(rq, q[2:])
    assert dptr == q.data_ptr() and rptr == q[2:].data_ptr()
    assert dout.data_ptr() == out.data_ptr() and rout.data_ptr() == out[2:].data_ptr()


# ---- several steps through the engine API, split and unsplit, against a plain float64 loop ------------
@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_steps_split_and_unsplit_agree(factory, page_size):
    worlds = [
        EngineWorld(lambda ctx, s=s: factory(ctx, mixed_split=s), page_size=page_size, dtype=torch.float16, head_dim=64)
        for s in (True, False)
    ]
    kinds = compare_over_steps(worlds, MIXED_STEPS, seed=page_size, tol=2e-2, observe=lambda w: split_kind(w.backend))
    mixed = ("MIXED", "split", "one plan")
    assert kinds == [("EXTEND", "one plan", "one plan"), mixed, mixed, mixed, ("DECODE", "one plan", "one plan"), mixed]
