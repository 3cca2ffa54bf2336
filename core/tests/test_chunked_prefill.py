"""The kernel-independent half of DeepSeek's prefill path (`attn_core.batching.chunked_prefill`), on CPU: the host
lengths it plans from, its input checks (typed errors before any pass runs) and the order it runs the
passes in. The numerics are checked through subclasses with real passes: attn-trtllm-mla's CPU tests (a
float64 fake of its kernel) and attn-flashinfer's GPU tests."""

import pytest
import torch

import attn_core as ac
from attn_core.batching.chunk_plan import plan_prefix_chunks
from attn_core.batching.chunked_prefill import ChunkedPrefillPlan, prefill_lengths
from attn_core.contract.errors import InvalidArgumentError


class RecordingPlan(ChunkedPrefillPlan):
    """Passes that record their calls and return output 0 with LSE 0 (every pass sees keys)."""

    calls: list

    def run_new(self, q, k, v):
        self.calls.append("new")
        return torch.zeros(self.num_tokens, self.num_heads, self.v_head_dim), torch.zeros(
            self.num_tokens, self.num_heads
        )

    def run_chunk(self, chunk, q, k, v):
        self.calls.append(chunk.index)
        return torch.zeros(self.num_tokens, self.num_heads, self.v_head_dim), torch.zeros(
            self.num_tokens, self.num_heads
        )


def _plan(prefix=(5, 0), T=5, H=2):
    chunks = plan_prefix_chunks(list(prefix), 4)
    plan = RecordingPlan(chunks, [torch.arange(c.num_tokens) for c in chunks.chunks], T, H, 8)
    plan.calls = []
    return plan


def test_prefill_lengths_worked_example_and_refusal():
    pool = ac.RequestPool(ac.ReqToTokenPool(4, 64), ac.PagedTokenAllocator(256, 4))
    a, b = pool.add(), pool.add()
    ac.build_step(pool, [(a, 5)])
    batch = ac.build_step(pool, [(a, 3), (b, 2)])
    q_lens, prefix = prefill_lengths(batch)
    assert q_lens.tolist() == [3, 2] and prefix.tolist() == [5, 0]
    with pytest.raises(InvalidArgumentError, match="EXTEND"):
        prefill_lengths(ac.build_step(pool, [(a, 1), (b, 1)]))


def test_attend_runs_new_then_every_chunk_in_order():
    plan = _plan()
    q, v = torch.zeros(5, 2, 12), torch.zeros(5, 2, 8)
    o, lse = plan.attend(
        q, q, v, lambda c, s: (torch.zeros(c.num_tokens, 2, 12), torch.zeros(c.num_tokens, 2, 8)), return_lse=True
    )
    assert plan.calls == ["new", 0, 1, 2] and o.shape == (5, 16) and lse.shape == (5, 2)
    assert torch.allclose(lse, torch.full((5, 2), float(torch.log(torch.tensor(4.0)))))  # four passes of LSE 0 merged


def test_attend_refuses_bad_inputs_before_any_pass():
    plan = _plan()
    q = torch.zeros(5, 2, 12)
    with pytest.raises(InvalidArgumentError, match="5 rows of 2 heads"):
        plan.attend(q[:4], q, q)
    with pytest.raises(InvalidArgumentError, match="5 rows of 2 heads"):
        plan.attend(torch.zeros(5, 3, 12), q, q)
    with pytest.raises(InvalidArgumentError, match="prefix_kv"):
        plan.attend(q, q, q)
    assert plan.calls == []
    with pytest.raises(InvalidArgumentError, match="K/V of 2 tokens for chunk 0"):
        plan.attend(q, q, q, lambda c, s: (torch.zeros(1, 2, 12), torch.zeros(1, 2, 8)))
