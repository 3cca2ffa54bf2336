"""MLA through the public API over several steps of the same requests, as an engine drives it:
`create_backend("triton", ctx)`, `RequestPool` + `build_step`, prefill, decode steps, speculative
verify rounds with tree masks (TARGET_VERIFY, 4 tokens), rollback, DRAFT_EXTEND, more decode. Every
layer output (and LSE) is compared with the float64 oracle over a host copy of each request's latent
rows; a spy checks which steps the MLA kernel (`kernels/mla_decode.py`) served. Also with the kernel's
variants: the wave-aware split policy capped at one split (decode finalized in the kernel, no merge
launch); the policy's split counts through the backend are checked
without a launch."""

from __future__ import annotations

import pytest
import torch
from triton_helpers import SMALL_SPLITS, requires_interpreter

import attn_core as ac
from attn_core.testing.batch_builder import random_tree_mask
from attn_core.testing.reference import reference_attention, relative_error, tolerance
from attn_triton.config import SplitPolicy
from attn_triton.kernels.mla_decode import MLAConfig

pytestmark = requires_interpreter

RANK, ROPE, HEADS = 64, 16, 16
WIDTH = RANK + ROPE


class Engine:
    """A tiny engine over one MLA backend: host copies of every request's latent rows per layer."""

    def __init__(self, dtype: torch.dtype, page_size: int, window: int, gen: torch.Generator, **options):
        slots, max_ctx = 64 * page_size + 512, 256
        self.kv = ac.MLATokenToKVPool(slots, page_size, dtype, RANK, ROPE, 2, "cpu")
        rows = ac.ReqToTokenPool(8, max_ctx, "cpu")
        self.requests = ac.RequestPool(rows, ac.PagedTokenAllocator(slots, page_size), self.kv)
        ctx = ac.BackendContext(
            device="cpu",
            dtype=dtype,
            num_q_heads=HEADS,
            num_kv_heads=1,
            head_dim=WIDTH,
            page_size=page_size,
            max_batch_size=8,
            max_context_len=max_ctx,
            req_to_token_pool=rows,
            token_to_kv_pool=self.kv,
            attention_arch="mla",
            kv_lora_rank=RANK,
            qk_rope_head_dim=ROPE,
            sliding_window_size=window,
            forward_modes={"extend", "decode", "target_verify", "draft_extend"},
            speculative_num_steps=3,
            speculative_topk=2,
            speculative_num_draft_tokens=4,
            features={"logit_cap", "sinks", "lse_output", "custom_mask"},
            validation="full",
        )
        self.backend = ac.create_backend("triton", ctx, **{"split_policy": SMALL_SPLITS, **options})
        self.layers = [
            ac.AttentionLayer(0, HEADS, 1, WIDTH, scaling=0.12, v_head_dim=RANK),
            ac.AttentionLayer(
                1, HEADS, 1, WIDTH, scaling=0.1, v_head_dim=RANK, logit_cap=6.0, sliding_window_size=window
            ),
        ]
        self.sinks = torch.randn(HEADS, generator=gen)
        self.dtype, self.gen = dtype, gen
        self.latents: dict[int, list[torch.Tensor]] = {}  # rid -> per layer [kv_len, 1, WIDTH]

    def add(self):
        r = self.requests.add()
        self.latents[r.rid] = [torch.zeros(0, 1, WIDTH, dtype=self.dtype) for _ in self.layers]
        return r

    def truncate(self, r, kv_len: int) -> None:
        self.requests.truncate(r, kv_len)
        self.latents[r.rid] = [x[:kv_len] for x in self.latents[r.rid]]

    def step(self, work, mode=None, masks=None) -> None:
        """Run one step over `work` [(request, new tokens)] and check both layers against the oracle."""
        batch = ac.build_step(self.requests, work, mode=mode, custom_masks=masks, attn_backend=self.backend)
        self.backend.init_forward_metadata(batch)
        T = sum(n for _, n in work)
        for lid, layer in enumerate(self.layers):
            q = torch.randn(T, HEADS, WIDTH, generator=self.gen).to(self.dtype)
            k = torch.randn(T, 1, WIDTH, generator=self.gen).to(self.dtype)
            extras = dict(sinks=self.sinks, return_lse=True) if lid == 1 else {}
            res = layer(q, k, k[..., :RANK], batch, **extras)
            o, lse = res if lid == 1 else (res, None)
            start = 0
            for j, (r, n) in enumerate(work):
                lat = self.latents[r.rid][lid] = torch.cat([self.latents[r.rid][lid], k[start : start + n]])
                kv_len = lat.shape[0]
                ref_o, ref_lse = reference_attention(
                    q[start : start + n],
                    lat,
                    lat[..., :RANK],
                    q_positions=torch.arange(kv_len - n, kv_len),
                    scale=layer.scaling,
                    window=layer.sliding_window_size,
                    logit_cap=layer.logit_cap,
                    sinks=extras.get("sinks"),
                    mask=None if masks is None else masks[j],
                )
                rows = slice(start, start + n)
                got = o[rows].view(n, HEADS, RANK)
                assert relative_error(got, ref_o) <= tolerance(self.dtype), (batch.forward_mode, lid, j)
                if lse is not None:
                    assert relative_error(lse[rows], ref_lse) <= (1e-5 if self.dtype == torch.float32 else 2e-3)
                start += n
        assert self.backend.poll_device_fault() is None


WAVES = MLAConfig(block_h=16, block_n=16, num_warps=1, num_stages=1, ctas_per_sm=1)
KERNELS = {
    "default": ({}, None),
    # at most one split: DECODE finalizes in the kernel (no scratch, no merge)
    "direct": (dict(mla_config=WAVES, split_policy=SplitPolicy(min_split_len=8, cap=1)), 1),
}


ENGINE_CASES = [(torch.float32, 16, "default"), (torch.float16, 1, "default"), (torch.float16, 64, "direct")]


@pytest.mark.parametrize("dtype,page_size,kernel", ENGINE_CASES)
def test_mla_engine_rounds(dtype, page_size, kernel, monkeypatch):
    import attn_triton.launchers as tb

    calls = []
    real = tb.mla_attention
    options, want_splits = KERNELS[kernel]

    def spy(*args, **kw):
        calls.append(kw.get("q_len", 1))
        if want_splits is not None and kw.get("q_len", 1) == 1:
            assert kw["max_splits"] == want_splits
        return real(*args, **kw)

    monkeypatch.setattr(tb, "mla_attention", spy)
    gen = torch.Generator().manual_seed(page_size)
    eng = Engine(dtype, page_size, window=24, gen=gen, **options)
    reqs = [eng.add() for _ in range(3)]
    eng.step([(r, int(torch.randint(3, 40, (1,), generator=gen))) for r in reqs])  # prefill: general kernel
    assert calls == []
    for _ in range(2):
        eng.step([(r, 1) for r in reqs])
    assert calls == [1] * 4  # two decode steps x two layers
    for _ in range(2):  # verify rounds: 4 tokens in a random tree, then roll back to the accepted ones
        masks = [random_tree_mask(r.kv_len, 4, gen) for r in reqs]
        eng.step([(r, 4) for r in reqs], mode="target_verify", masks=masks)
        for r in reqs:
            eng.truncate(r, r.kv_len - 4 + int(torch.randint(1, 5, (1,), generator=gen)))
        eng.step([(r, 3) for r in reqs], mode="draft_extend")
        eng.step([(r, 1) for r in reqs])
    assert calls == [1] * 4 + [4, 4, 3, 3, 1, 1] * 2
    eng.step([(reqs[0], 2), (reqs[1], 3), (reqs[2], 1)], mode="draft_extend")  # uneven: the general extend kernel
    eng.step([(r, 1) for r in reqs])
    assert calls[-2:] == [1, 1] and len(calls) == 4 + 12 + 2


@pytest.mark.parametrize("deterministic", [False, True])
def test_mla_wave_split_policy_through_the_backend(deterministic):
    """`MLAConfig.ctas_per_sm` makes the backend's decode splits the wave-aware count for the kernel's
    programs per request (one 16-row head block of 16 heads; the interpreter counts 4 SMs); deterministic
    mode keeps its fixed splits; 0 keeps SplitPolicy's fill-two-waves count."""
    from attn_triton.config import wave_splits

    gen = torch.Generator().manual_seed(0)
    eng = Engine(torch.float32, 16, window=24, gen=gen, mla_config=WAVES)
    eng.backend.ctx.deterministic = deterministic
    for bs in (1, 2, 3, 8):
        got = eng.backend.planner.decode_splits(bs).max_splits
        want = (
            SMALL_SPLITS.deterministic_max_splits
            if deterministic
            else wave_splits(bs, 4, SMALL_SPLITS.cap, SMALL_SPLITS.waves)
        )
        assert got == want, (bs, got, want)
    assert [wave_splits(bs, 4, 8, 64.0) for bs in (1, 2, 3, 8)] == [4, 2, 4, 1]  # 1, 2, 3, 8 programs on 4 slots
