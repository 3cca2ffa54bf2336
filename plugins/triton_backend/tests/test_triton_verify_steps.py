"""Speculative rounds through the public API (`create_backend("triton", ctx)`, `RequestPool`,
`build_step`): the same requests prefill, then verify (chain and tree masks), roll back to the accepted
length, draft-extend and decode, over several rounds, two layers (one with a window and a logit cap),
GQA 8/2, page sizes 1 and 16. Every step's output is compared with the float64 oracle over each
request's own history, and the test checks which kernel ran: uniform TARGET_VERIFY / DRAFT_EXTEND
steps the verify kernel, a DRAFT_EXTEND with unequal lengths the extend kernel."""

from __future__ import annotations

import pytest
import torch
from triton_helpers import requires_interpreter

import attn_core as ac
from attn_core.contract.forward_mode import ForwardMode
from attn_core.testing.batch_builder import random_tree_mask
from attn_core.testing.reference import reference_attention, relative_error, tolerance

pytestmark = requires_interpreter

HQ, HKV, D = 8, 2, 32
DTYPE = torch.float16
LAYERS = [dict(), dict(sliding_window_size=11, logit_cap=4.0)]


class Engine:
    """Requests over a NaN-poisoned paged pool, their dense K/V history kept on the host for the oracle."""

    def __init__(self, page_size: int, prompt_lens: list[int], seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        slots = 512
        kv = ac.MHATokenToKVPool(
            size=slots, page_size=page_size, dtype=DTYPE, head_num=HKV, head_dim=D, layer_num=len(LAYERS)
        )
        for i in range(len(LAYERS)):  # unused slots poisoned
            kv.get_key_buffer(i).fill_(float("nan"))
            kv.get_value_buffer(i).fill_(float("nan"))
        rows = ac.ReqToTokenPool(size=8, max_context_len=160)
        self.requests = ac.RequestPool(rows, ac.PagedTokenAllocator(slots, page_size), kv)
        modes = {ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND}
        ctx = ac.BackendContext(
            device="cpu",
            dtype=DTYPE,
            num_q_heads=HQ,
            num_kv_heads=HKV,
            head_dim=D,
            page_size=page_size,
            max_batch_size=8,
            max_context_len=160,
            req_to_token_pool=rows,
            token_to_kv_pool=kv,
            forward_modes=frozenset(modes),
            speculative_num_steps=3,
            speculative_topk=2,
            speculative_num_draft_tokens=4,
            validation="full",
        )
        self.backend = ac.create_backend("triton", ctx)
        self.layers = [ac.AttentionLayer(i, HQ, HKV, D, scaling=0.2, **kw) for i, kw in enumerate(LAYERS)]
        self.reqs = [self.requests.add() for _ in prompt_lens]
        self.hist = [
            [(torch.zeros(0, HKV, D, dtype=DTYPE), torch.zeros(0, HKV, D, dtype=DTYPE)) for _ in LAYERS]
            for _ in prompt_lens
        ]
        self.step(list(prompt_lens))

    def step(self, counts: list[int], mode=None, masks=None) -> float:
        """Run one step with `counts` new tokens per request; the worst relative error of its outputs."""
        work = list(zip(self.reqs, counts))
        lens = [r.kv_len for r in self.reqs]
        batch = ac.build_step(self.requests, work, mode=mode, custom_masks=masks, attn_backend=self.backend)
        self.backend.init_forward_metadata(batch)
        T, worst = sum(counts), 0.0
        for li, layer in enumerate(self.layers):
            q = torch.randn(T, HQ, D, generator=self.gen).to(DTYPE)
            k = torch.randn(T, HKV, D, generator=self.gen).to(DTYPE)
            v = torch.randn(T, HKV, D, generator=self.gen).to(DTYPE)
            out = layer(q, k, v, batch).view(T, HQ, D)
            start = 0
            for r, n in enumerate(counts):
                hk, hv = self.hist[r][li]
                hk, hv = (
                    torch.cat([hk[: lens[r]], k[start : start + n]]),
                    torch.cat([hv[: lens[r]], v[start : start + n]]),
                )
                self.hist[r][li] = (hk, hv)
                ref, _ = reference_attention(
                    q[start : start + n],
                    hk,
                    hv,
                    q_positions=torch.arange(lens[r], lens[r] + n),
                    scale=0.2,
                    window=layer.sliding_window_size,
                    logit_cap=layer.logit_cap,
                    mask=None if masks is None else masks[r],
                )
                worst = max(worst, relative_error(out[start : start + n], ref))
                start += n
        assert self.backend.poll_device_fault() is None
        return worst

    def roll_back(self, kept: list[int]) -> None:
        for r, keep in zip(self.reqs, kept):
            self.requests.truncate(r, keep)


@pytest.mark.parametrize("page_size", [1, 16])
def test_speculative_rounds_of_the_same_requests(page_size, monkeypatch):
    import attn_triton.launchers as tb

    calls = {"verify": 0, "extend": 0}

    def counting(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(tb, "verify_attention", counting("verify", tb.verify_attention))
    monkeypatch.setattr(tb, "extend_attention", counting("extend", tb.extend_attention))
    eng = Engine(page_size, [19, 3, 40], seed=page_size)
    tol = tolerance(DTYPE)
    for rnd, drafts in enumerate([4, 2, 8]):
        calls.update(verify=0, extend=0)
        lens = [r.kv_len for r in eng.reqs]
        masks = (
            [random_tree_mask(n, drafts, eng.gen) for n in lens] if rnd != 1 else None
        )  # round 1: the default chain mask
        assert eng.step([drafts] * 3, mode="target_verify", masks=masks) <= tol, (rnd, "verify")
        assert calls == {"verify": len(LAYERS), "extend": 0}
        accepted = [int(torch.randint(0, drafts, (1,), generator=eng.gen)) for _ in lens]
        eng.roll_back([n + a + 1 for n, a in zip(lens, accepted)])
        calls.update(verify=0, extend=0)
        assert eng.step([2, 2, 2], mode="draft_extend") <= tol, (rnd, "draft extend")
        assert calls == {"verify": len(LAYERS), "extend": 0}
        eng.roll_back([r.kv_len - 1 for r in eng.reqs])
        assert eng.step([1, 1, 1]) <= tol, (rnd, "decode")
    calls.update(verify=0, extend=0)
    assert eng.step([3, 1, 2], mode="draft_extend") <= tol, "unequal draft extend"
    assert calls == {"verify": 0, "extend": len(LAYERS)}
