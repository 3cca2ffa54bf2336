"""The same requests over several steps, as an engine runs them: a prefill, decode steps, a chunked
extend and a verify step, every K/V written by the backend itself (reshape-and-cache) and read back by
the later steps; each step's output against the float64 reference over the request's whole history."""

from __future__ import annotations

import pytest
import torch
from attn_ascend.testing.emulated_torch_npu import emulated_backend_class

from attn_core.batching.positions import extend_start_loc_from_lens, positions_from_lens
from attn_core.contract.batch import ForwardBatch, SpecInfo
from attn_core.contract.context import BackendContext
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.layer import AttentionLayer
from attn_core.memory import MHATokenToKVPool, MLATokenToKVPool, PagedTokenAllocator, ReqToTokenPool
from attn_core.testing.batch_builder import build_forward_batch
from attn_core.testing.reference import reference_attention, relative_error

PAGE = 16
DTYPE = torch.bfloat16


class Engine:
    """Pools, one backend, and the dense history (K, V per request) the reference reads."""

    def __init__(self, mla: bool, prompt_lens: list[int]):
        self.mla = mla
        self.gen = torch.Generator().manual_seed(11)
        slots = 64 * PAGE
        self.req_pool = ReqToTokenPool(len(prompt_lens), 512)
        self.alloc = PagedTokenAllocator(slots, PAGE)
        if mla:
            self.hq, self.hkv, self.d, self.dv = 4, 1, 576, 512
            self.kv_pool = MLATokenToKVPool(slots, PAGE, DTYPE, 512, 64, 1)
            extra = dict(attention_arch="mla", kv_lora_rank=512, qk_rope_head_dim=64)
        else:
            self.hq, self.hkv, self.d, self.dv = 8, 2, 64, 64
            self.kv_pool = MHATokenToKVPool(slots, PAGE, DTYPE, self.hkv, self.d, 1)
            extra = {}
        for b in (self.kv_pool.get_key_buffer(0), self.kv_pool.get_value_buffer(0)):
            b.fill_(float("nan"))
        modes = {ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY}
        ctx = BackendContext(
            "cpu",
            DTYPE,
            self.hq,
            self.hkv,
            self.d,
            page_size=PAGE,
            max_context_len=512,
            forward_modes=modes,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool,
            **extra,
        )
        self.backend = emulated_backend_class()(ctx)
        self.layer = AttentionLayer(0, self.hq, self.hkv, self.d, scaling=0.11, v_head_dim=self.dv)
        first = build_forward_batch(
            "EXTEND", [(0, n) for n in prompt_lens], req_to_token_pool=self.req_pool, allocator=self.alloc
        )
        self.rows = first.req_pool_indices.tolist()
        self.lens = [0] * len(prompt_lens)
        self.keys: list[torch.Tensor] = [torch.zeros(0, self.hkv, self.d, dtype=DTYPE) for _ in prompt_lens]
        self.vals: list[torch.Tensor] = [torch.zeros(0, self.hkv, self.dv, dtype=DTYPE) for _ in prompt_lens]
        self.prefill_error = self.run(first, prompt_lens)

    def batch(self, mode: ForwardMode, new: list[int]) -> ForwardBatch:
        """A step adding `new[r]` tokens to request r: slots from the allocator, rows of req_to_token."""
        locs = []
        for r, n in enumerate(new):
            last = int(self.req_pool.req_to_token[self.rows[r], self.lens[r] - 1])
            slots = self.alloc.alloc_extend([self.lens[r]], [self.lens[r] + n], [last])
            self.req_pool.write(self.rows[r], self.lens[r], slots)
            locs.append(slots)
        seq = torch.tensor([n + a for n, a in zip(self.lens, new)], dtype=torch.int32)
        prefix = torch.tensor(self.lens, dtype=torch.int32)
        ext = torch.tensor(new, dtype=torch.int32)
        b = ForwardBatch(
            mode,
            len(new),
            torch.tensor(self.rows),
            seq,
            seq,
            int(seq.sum()),
            torch.cat(locs),
            positions_from_lens(prefix, ext, int(ext.sum())),
            self.req_pool,
            self.kv_pool,
        )
        if mode.is_extend():
            b.extend_prefix_lens, b.extend_prefix_lens_cpu, b.extend_seq_lens, b.extend_seq_lens_cpu = (
                prefix,
                prefix,
                ext,
                ext,
            )
            b.extend_start_loc, b.extend_num_tokens = extend_start_loc_from_lens(ext), int(ext.sum())
        if mode.is_target_verify():
            b.spec_info = SpecInfo(num_draft_tokens=new[0])
        return b

    def run(self, batch: ForwardBatch, new: list[int]) -> float:
        """One step: metadata once, the layer's forward, then the reference over each request's history."""
        T = sum(new)
        q = torch.randn(T, self.hq, self.d, generator=self.gen).to(DTYPE)
        k = torch.randn(T, self.hkv, self.d, generator=self.gen).to(DTYPE)
        v = None if self.mla else torch.randn(T, self.hkv, self.dv, generator=self.gen).to(DTYPE)
        batch.attn_backend = self.backend
        self.backend.init_forward_metadata(batch)
        out = self.layer(q, k, v, batch).reshape(T, self.hq, self.dv)
        worst, start = 0.0, 0
        for r, n in enumerate(new):
            self.keys[r] = torch.cat([self.keys[r], k[start : start + n]])
            self.vals[r] = torch.cat(
                [self.vals[r], k[start : start + n, :, : self.dv] if self.mla else v[start : start + n]]
            )
            pos = torch.arange(self.lens[r], self.lens[r] + n)
            ref, _ = reference_attention(q[start : start + n], self.keys[r], self.vals[r], q_positions=pos, scale=0.11)
            worst = max(worst, relative_error(out[start : start + n], ref))
            self.lens[r] += n
            start += n
        return worst


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_prefill_decode_extend_verify_of_the_same_requests(mla):
    eng = Engine(mla, [20, 5, 33])
    assert eng.prefill_error < 2e-2, f"prefill: rel err {eng.prefill_error:.3g}"
    steps = [("DECODE", [1, 1, 1])] * 3 + [("EXTEND", [4, 17, 1]), ("TARGET_VERIFY", [3, 3, 3]), ("DECODE", [1, 1, 1])]
    for mode, new in steps:
        err = eng.run(eng.batch(ForwardMode.parse(mode), new), new)
        assert err < 2e-2, f"{mode} step: rel err {err:.3g}"
    assert eng.lens == [20 + 3 + 4 + 3 + 1, 5 + 3 + 17 + 3 + 1, 33 + 3 + 1 + 3 + 1]
