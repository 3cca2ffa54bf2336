"""The MIXED split of the Triton backend (`attn_triton.mixed`, option `mixed_split`, default True): decodes through
the decode kernel, the other requests through the extend kernel, in any request order.

Checked against the float64 oracle on random MIXED batches (decodes interleaved with prefill chunks,
prefixes, empty extend rows, page sizes 1/16, fp32/fp16, windows, logit caps, sinks, LSE; the harness
NaN-poisons every unused KV slot), and over several steps of the same requests through the public
engine API (`RequestPool` / `build_step`), split and unsplit side by side against a plain float64 loop.
Under the Triton interpreter, small shapes.
"""

from __future__ import annotations

import random

import pytest
import torch
from triton_helpers import SMALL_SPLITS, factory, requires_interpreter

import attn_core as ac
from attn_core.contract.errors import InvalidArgumentError
from attn_core.testing.engine_steps import MIXED_STEPS, EngineWorld, compare_over_steps
from attn_core.testing.harness import AttnCase, assert_case
from attn_triton.mixed import MixedPath
from attn_triton.plans import ExtendPath

pytestmark = requires_interpreter


def recording(made: list, **options):
    """A harness factory building split-enabled backends and remembering them."""

    def make(ctx):
        backend = factory(split_policy=SMALL_SPLITS, **options)(ctx)
        made.append(backend)
        return backend

    return make


def test_option_is_checked():
    case = AttnCase("MIXED", [(3, 1), (0, 2)])
    with pytest.raises(InvalidArgumentError, match="mixed_split"):
        assert_case(factory(mixed_split="yes"), case)


# ---- one step against the float64 oracle ----------------------------------------------------------
CASES = [
    # decode-first (views only), decodes last, interleaved (gather/scatter), an empty extend row
    AttnCase("MIXED", [(7, 1), (30, 1), (2, 6), (0, 3)], page_size=16, return_lse=True),
    AttnCase("MIXED", [(2, 6), (0, 3), (7, 1), (30, 1)], dtype="float16"),
    AttnCase("MIXED", [(9, 1), (2, 6), (40, 1), (5, 0), (0, 3), (17, 1)], page_size=16, return_lse=True),
    # only decodes in a MIXED step (no extend launch)
    AttnCase("MIXED", [(9, 1), (33, 1)], page_size=16),
    # window, logit cap, sinks, LSE through both kernels; MQA; absorbed MLA
    AttnCase("MIXED", [(20, 4), (7, 1), (2, 6), (50, 1)], sliding_window=5, logit_cap=4.0, sinks=True, return_lse=True),
    AttnCase("MIXED", [(3, 5), (26, 1)], num_q_heads=8, num_kv_heads=1, dtype="float16", page_size=16, sinks=True),
    AttnCase(
        "MIXED", [(5, 7), (12, 1)], arch="mla", kv_lora_rank=32, qk_rope_head_dim=8, sliding_window=5, return_lse=True
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.describe() for c in CASES])
def test_split_case(case):
    made = []
    assert_case(recording(made), case)  # the default
    assert isinstance(made[0].forward_metadata.plain, MixedPath)


@pytest.mark.parametrize("case", CASES[:3], ids=[c.describe() for c in CASES[:3]])
def test_unsplit_case(case):
    """`mixed_split=False` keeps one extend launch for the whole MIXED step."""
    made = []
    assert_case(recording(made, mixed_split=False), case)
    assert isinstance(made[0].forward_metadata.plain, ExtendPath)


def random_mixed_case(seed: int) -> AttnCase:
    """3-7 requests, each a decode (a cached prefix and one new token) or a prefill chunk (any prefix,
    0-12 new tokens), shuffled, at least one decode; random page size, dtype and features."""
    rng = random.Random(seed)
    n = rng.randint(3, 7)
    reqs = [
        (rng.randint(1, 45), 1) if rng.random() < 0.5 else (rng.randint(0, 30), rng.randint(0, 12)) for _ in range(n)
    ]
    reqs[rng.randrange(n)] = (rng.randint(1, 45), 1)
    rng.shuffle(reqs)
    return AttnCase(
        "MIXED",
        reqs,
        page_size=rng.choice([1, 16]),
        dtype=rng.choice(["float32", "float16"]),
        sliding_window=rng.choice([None, None, 6]),
        logit_cap=rng.choice([0.0, 3.0]),
        sinks=rng.random() < 0.3,
        return_lse=True,
        seed=seed,
    )


@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_batches(seed):
    case = random_mixed_case(seed)
    made = []
    assert_case(recording(made, mixed_split=True), case)
    assert isinstance(made[0].forward_metadata.plain, MixedPath), case.describe()


@pytest.mark.parametrize(
    "case",
    [
        AttnCase("MIXED", [(3, 1, 6), (0, 5, 2)], cross_attention=True),
        AttnCase("MIXED", [(13, 1), (2, 9), (0, 3)], attention_chunk_size=4, chunk_even_layers_only=True),
        AttnCase("MIXED", [(0, 4), (0, 3)]),
    ],
    ids=["encoder tokens", "chunked local attention", "no decode"],
)
def test_steps_the_split_does_not_serve_stay_unsplit(case):
    made = []
    assert_case(recording(made, mixed_split=True), case)
    assert isinstance(made[0].forward_metadata.plain, ExtendPath)


def test_out_of_range_slot_is_flagged_not_read(monkeypatch):
    """A decode's req_to_token entry past the pool (no host check sees device tables at the basic
    validation level on a GPU; emulated here, where the CPU would validate fully): the split step's
    index launch refuses it and the poll names it."""
    import attn_core.contract.backend

    monkeypatch.setattr(attn_core.contract.backend, "effective_level", lambda ctx: ctx.validation)
    kv = ac.MHATokenToKVPool(
        size=64, page_size=1, dtype=torch.float32, head_num=2, head_dim=16, layer_num=1, device="cpu"
    )
    rows = ac.ReqToTokenPool(size=4, max_context_len=32, device="cpu")
    requests = ac.RequestPool(rows, ac.PagedTokenAllocator(64, 1), kv)
    ctx = ac.BackendContext(
        device=torch.device("cpu"),
        dtype=torch.float32,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=1,
        max_batch_size=4,
        max_context_len=32,
        req_to_token_pool=rows,
        token_to_kv_pool=kv,
        forward_modes={"extend", "decode", "mixed"},
    )
    backend = factory(mixed_split=True)(ctx)
    layer = ac.AttentionLayer(0, 4, 2, 16)
    a, b = requests.add(), requests.add()
    first = ac.build_step(requests, [(a, 5)], attn_backend=backend)
    backend.init_forward_metadata(first)
    layer(torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16), first)
    assert backend.poll_device_fault() is None
    step = ac.build_step(requests, [(b, 3), (a, 1)], attn_backend=backend)
    rows.req_to_token[a.row, 2] = 10**6
    backend.init_forward_metadata(step)
    assert isinstance(backend.forward_metadata.plain, MixedPath)
    layer(torch.randn(4, 4, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16), step)
    assert backend.poll_device_fault() is not None


# ---- several steps through the engine API, split and unsplit, against a plain float64 loop ------------
@pytest.mark.parametrize("page_size,dtype", [(1, torch.float32), (16, torch.float16)])
def test_engine_steps_split_and_unsplit_agree(page_size, dtype):
    worlds = [
        EngineWorld(
            lambda ctx, s=s: factory(split_policy=SMALL_SPLITS, mixed_split=s)(ctx), page_size=page_size, dtype=dtype
        )
        for s in (True, False)
    ]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    path_kind = lambda w: type(w.backend.forward_metadata.plain)  # noqa: E731
    seen = compare_over_steps(worlds, MIXED_STEPS, seed=page_size, tol=tol, observe=path_kind)
    assert [mode for mode, _, _ in seen] == ["EXTEND", "MIXED", "MIXED", "MIXED", "DECODE", "MIXED"]
    assert all((split, unsplit) == (MixedPath, ExtendPath) for mode, split, unsplit in seen if mode == "MIXED")


def test_kit_mixed_checks_pass_unsplit():
    """The conformance kit's MIXED checks (its own random compositions and features) on a backend built
    with `mixed_split=False` (the kit's default plan runs the split, the backend's default): the kit's plan
    with that option, every MIXED check it does not skip."""
    from attn_core.testing.kit import make_plan
    from attn_core.testing.outcome import execute

    plan = make_plan("triton", device="cpu", quick=True, options={"mixed_split": False})
    checks = [c for c in plan.checks if "MIXED" in c.id and plan.skip_reason(c.id) is None]
    assert len(checks) >= 3, [c.id for c in plan.checks]
    for check in checks:
        outcome = execute(check)
        assert not outcome.failed, f"{check.id}: {outcome.message}"
