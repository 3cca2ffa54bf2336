"""The MIXED split of the Triton backend (`attn_triton.mixed`, option `mixed_split`, default True): decodes through
the decode kernel, the other requests through the extend kernel, in any request order.

Checked against the float64 oracle on random MIXED batches (decodes interleaved with prefill chunks,
prefixes, empty extend rows, page sizes 1/16, fp32/fp16, windows, logit caps, sinks, LSE; the harness
NaN-poisons every unused KV slot), and over several steps of the same requests through the public
engine API (`RequestPool` / `build_step`), split and unsplit side by side against a plain float64 loop.
Under the Triton interpreter, small shapes.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from triton_helpers import SMALL_SPLITS, factory, requires_interpreter

import attn_core as ac
from attn_core.errors import InvalidArgumentError
from attn_core.testing.harness import AttnCase, assert_case
from attn_triton.metadata import ExtendMetadata
from attn_triton.mixed import MixedMetadata

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
    AttnCase("MIXED", [(5, 7), (12, 1)], arch="mla", kv_lora_rank=32, qk_rope_head_dim=8, sliding_window=5, return_lse=True),
]


@pytest.mark.parametrize("case", CASES, ids=[c.describe() for c in CASES])
def test_split_case(case):
    made = []
    assert_case(recording(made), case)  # the default
    assert isinstance(made[0].forward_metadata, MixedMetadata)


@pytest.mark.parametrize("case", CASES[:3], ids=[c.describe() for c in CASES[:3]])
def test_unsplit_case(case):
    """`mixed_split=False` keeps one extend launch for the whole MIXED step."""
    made = []
    assert_case(recording(made, mixed_split=False), case)
    assert isinstance(made[0].forward_metadata, ExtendMetadata)


def random_mixed_case(seed: int) -> AttnCase:
    """3-7 requests, each a decode (a cached prefix and one new token) or a prefill chunk (any prefix,
    0-12 new tokens), shuffled, at least one decode; random page size, dtype and features."""
    rng = random.Random(seed)
    n = rng.randint(3, 7)
    reqs = [(rng.randint(1, 45), 1) if rng.random() < 0.5 else (rng.randint(0, 30), rng.randint(0, 12)) for _ in range(n)]
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
    assert isinstance(made[0].forward_metadata, MixedMetadata), case.describe()


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
    assert isinstance(made[0].forward_metadata, ExtendMetadata)


def test_out_of_range_slot_is_flagged_not_read():
    """A decode's req_to_token entry past the pool (no host check sees device tables at the basic
    validation level): the split step's index launch refuses it and the poll names it."""
    kv = ac.MHATokenToKVPool(size=64, page_size=1, dtype=torch.float32, head_num=2, head_dim=16, layer_num=1, device="cpu")
    rows = ac.ReqToTokenPool(size=4, max_context_len=32, device="cpu")
    requests = ac.RequestPool(rows, ac.PagedTokenAllocator(64, 1), kv)
    ctx = ac.BackendContext(
        device=torch.device("cpu"), dtype=torch.float32, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=1,
        max_batch_size=4, max_context_len=32, req_to_token_pool=rows, token_to_kv_pool=kv, forward_modes={"extend", "decode", "mixed"},
    )  # fmt: skip
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
    assert isinstance(backend.forward_metadata, MixedMetadata)
    layer(torch.randn(4, 4, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16), step)
    assert backend.poll_device_fault() is not None


# ---- several steps through the engine API, split and unsplit, against a plain float64 loop ------------
HQ, HKV, D, LAYERS = 4, 2, 16, 2


class World:
    """One engine's state: NaN-poisoned pools, a RequestPool and a Triton backend."""

    def __init__(self, page_size: int, dtype: torch.dtype, mixed_split: bool):
        slots = 256
        self.kv = ac.MHATokenToKVPool(
            size=slots, page_size=page_size, dtype=dtype, head_num=HKV, head_dim=D, layer_num=LAYERS, device="cpu"
        )
        for lid in range(LAYERS):
            self.kv.get_key_buffer(lid).fill_(float("nan"))
            self.kv.get_value_buffer(lid).fill_(float("nan"))
        self.rows = ac.ReqToTokenPool(size=8, max_context_len=64, device="cpu")
        self.requests = ac.RequestPool(self.rows, ac.PagedTokenAllocator(slots, page_size), self.kv)
        ctx = ac.BackendContext(
            device=torch.device("cpu"), dtype=dtype, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=page_size,
            max_batch_size=8, max_context_len=64, req_to_token_pool=self.rows, token_to_kv_pool=self.kv,
            forward_modes={"extend", "decode", "mixed"}, validation="full",
        )  # fmt: skip
        self.backend = factory(split_policy=SMALL_SPLITS, mixed_split=mixed_split)(ctx)
        self.layers = [ac.AttentionLayer(i, HQ, HKV, D) for i in range(LAYERS)]
        self.by_name: dict[str, object] = {}

    def step(self, work, qkv):
        """Run one step: work [(name, new_tokens)] → per layer output `[T, Hq*D]` (float64)."""
        for name, _ in work:
            if name not in self.by_name:
                self.by_name[name] = self.requests.add()
        batch = ac.build_step(self.requests, [(self.by_name[n], t) for n, t in work], attn_backend=self.backend)
        self.backend.init_forward_metadata(batch)
        outs = [layer(q, k, v, batch).double() for layer, (q, k, v) in zip(self.layers, qkv)]
        assert self.backend.poll_device_fault() is None
        return batch.forward_mode, type(self.backend.forward_metadata), outs

    def free(self, name):
        self.requests.free(self.by_name.pop(name))


def reference_step(history, work, qkv):
    """Plain float64 causal attention: every request's keys are its history plus this step's tokens."""
    outs = []
    for lid, (q, k, v) in enumerate(qkv):
        rows, t = [], 0
        for name, n in work:
            hk, hv = history.setdefault((name, lid), (torch.zeros(0, HKV, D, dtype=torch.float64),) * 2)
            hk = torch.cat([hk, k[t : t + n].double()])
            hv = torch.cat([hv, v[t : t + n].double()])
            history[(name, lid)] = (hk, hv)
            for i in range(n):
                p = hk.shape[0] - n + i  # the token's position: it sees keys 0..p
                for h in range(HQ):
                    g = h // (HQ // HKV)
                    s = (hk[: p + 1, g] @ q[t + i, h].double()) / math.sqrt(D)
                    rows.append(torch.softmax(s, 0) @ hv[: p + 1, g])
            t += n
        outs.append(torch.stack(rows).view(t, HQ * D))
    return outs


STEPS = [
    [("a", 9)],
    [("a", 1), ("b", 12)],  # MIXED, decode-first
    [("b", 1), ("c", 5), ("a", 1)],  # MIXED, interleaved
    [("c", 7), ("a", 1), ("b", 1)],  # MIXED, prefill first
    [("a", 1), ("b", 1), ("c", 1)],  # DECODE
    "free a",
    [("d", 4), ("c", 1), ("e", 6), ("b", 1)],  # MIXED after a request left
]


@pytest.mark.parametrize("page_size,dtype", [(1, torch.float32), (16, torch.float16)])
def test_engine_steps_split_and_unsplit_agree(page_size, dtype):
    gen = torch.Generator().manual_seed(page_size)
    split, unsplit = World(page_size, dtype, True), World(page_size, dtype, False)
    history: dict = {}
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    modes = []
    for work in STEPS:
        if isinstance(work, str):
            split.free(work.split()[1])
            unsplit.free(work.split()[1])
            continue
        T = sum(n for _, n in work)
        qkv = [tuple(torch.randn(T, h, D, generator=gen).to(dtype) for h in (HQ, HKV, HKV)) for _ in range(LAYERS)]
        mode, split_meta, split_out = split.step(work, qkv)
        _, unsplit_meta, unsplit_out = unsplit.step(work, qkv)
        ref = reference_step(history, work, qkv)
        modes.append(mode.name)
        if mode == ac.ForwardMode.MIXED:
            assert split_meta is MixedMetadata and unsplit_meta is ExtendMetadata
        for a, b, r in zip(split_out, unsplit_out, ref):
            scale = r.abs().max()
            assert float((a - r).abs().max() / scale) <= tol, work
            assert float((b - r).abs().max() / scale) <= tol, work
            assert float((a - b).abs().max() / scale) <= tol, work
        for lid in range(LAYERS):  # the same K/V in the same slots, NaN where nothing was written
            for get in ("get_key_buffer", "get_value_buffer"):
                x, y = getattr(split.kv, get)(lid), getattr(unsplit.kv, get)(lid)
                assert torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))
    assert modes == ["EXTEND", "MIXED", "MIXED", "MIXED", "DECODE", "MIXED"]


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
