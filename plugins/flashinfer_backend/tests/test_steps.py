"""Step inputs, layer keys and context checks (FlashInfer-free parts of the backend, on CPU)."""

import pytest
import torch

from attn_core.contract.batch import SpecInfo
from attn_core.contract.context import BackendContext
from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.graph_step import CudaGraphStep
from attn_core.contract.layer import AttentionLayer
from attn_core.memory import PagedTokenAllocator, ReqToTokenPool
from attn_core.testing.batch_builder import build_forward_batch
from attn_flashinfer.spec import CAPABILITIES
from attn_flashinfer.steps import (
    LayerKey,
    check_context,
    check_local_step,
    check_window_pool_step,
    eager_inputs,
    graph_inputs,
    verify_mask,
)


def test_layer_key_window_cap_scale_and_cross():
    full = LayerKey.of(AttentionLayer(0, 8, 2, 128))
    assert full == LayerKey(-1, 0.0, 128**-0.5, False)
    win = LayerKey.of(AttentionLayer(1, 8, 2, 128, sliding_window_size=64, logit_cap=30.0, scaling=0.1))
    assert win == LayerKey(63, 30.0, 0.1, False)
    assert LayerKey.of(AttentionLayer(2, 8, 2, 128, sliding_window_size=1)).window_left == 0
    cross = LayerKey.of(AttentionLayer(3, 8, 2, 128, sliding_window_size=64, is_cross_attention=True))
    assert cross.cross and cross.window_left == -1  # a window never applies to encoder keys
    assert LayerKey.of(AttentionLayer(4, 8, 2, 128)) == full  # same settings: one plan
    assert not win.window_pool  # set by the backend for layers kept in a sliding-window KV pool
    local = LayerKey.of(AttentionLayer(5, 8, 2, 128, attention_chunk_size=32))
    assert local.chunk == 32 and local.window_left == -1 and local != full and full.chunk == 0


def _ctx(**kw):
    base = dict(device="cuda", dtype=torch.bfloat16, num_q_heads=8, num_kv_heads=2, head_dim=128)
    base.update(kw)
    return BackendContext(**base)


def test_context_checks_are_typed():
    """The base class refuses what CAPABILITIES says (here: the mismatch reasons it raises with);
    check_context only what the capabilities cannot express."""

    def reasons(**kw):
        return " ".join(CAPABILITIES.mismatches(_ctx(**kw).requirements(), layout_only=True))

    check_context(_ctx(), "flashinfer")
    assert reasons() == ""
    assert "device 'cpu'" in reasons(device="cpu")
    assert "arch 'mla'" in reasons(
        attention_arch="mla", num_kv_heads=1, head_dim=576, kv_lora_rank=512, qk_rope_head_dim=64
    )
    with pytest.raises(UnsupportedFeatureError, match="v_head_dim"):
        check_context(_ctx(v_head_dim=64), "flashinfer")
    assert "head_dim 96" in reasons(head_dim=96)
    assert "q dtype float32" in reasons(dtype=torch.float32, kv_dtype=torch.float32)
    assert "KV dtype float32" in reasons(kv_dtype=torch.float32)
    assert "mixed dtypes" in reasons(kv_dtype=torch.float16)
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in (64, 128, 256):
            check_context(_ctx(dtype=dtype, head_dim=head_dim), "flashinfer")
            assert reasons(dtype=dtype, head_dim=head_dim) == ""


def _batch(mode, reqs, page_size=1):
    pool = ReqToTokenPool(len(reqs) + 1, 64)
    alloc = PagedTokenAllocator(512, page_size)
    return build_forward_batch(
        mode, reqs, req_to_token_pool=pool, allocator=alloc, generator=torch.Generator().manual_seed(0)
    ), pool


def test_eager_inputs_of_decode_extend_and_verify():
    b, pool = _batch("DECODE", [(5, 1), (0, 1)])
    x = eager_inputs(b, pool.req_to_token)
    assert x.q_lens_host is None and x.prefix_lens is None and x.num_tokens == 2
    assert x.seq_lens_host.tolist() == [6, 1]
    b, pool = _batch("EXTEND", [(5, 3), (0, 4)])
    x = eager_inputs(b, pool.req_to_token)
    assert x.q_lens_host.tolist() == [3, 4] and x.prefix_lens_host.tolist() == [5, 0] and x.custom_mask is None
    b, pool = _batch("TARGET_VERIFY", [(5, 3), (2, 3)])
    x = eager_inputs(b, pool.req_to_token)
    assert torch.equal(x.custom_mask, b.spec_info.custom_mask) and x.custom_mask.numel() == 3 * 8 + 3 * 5
    # a batch missing its extend fields is refused by attn-core's batch validation (core/tests/test_validation.py)


def test_window_pool_steps_refuse_verify_masks_and_hnd_pages():
    """A step over a sliding-window KV pool: a verify tree mask, and HND at page_size > 1, are typed
    refusals (raised by `build_forward_metadata` before any plan or KV write); the rest passes."""
    b, pool = _batch("TARGET_VERIFY", [(5, 3), (2, 3)])
    with pytest.raises(UnsupportedFeatureError, match="custom mask"):
        check_window_pool_step(eager_inputs(b, pool.req_to_token), "NHD", 1, "flashinfer")
    b, pool = _batch("EXTEND", [(5, 3), (0, 4)], page_size=16)
    x = eager_inputs(b, pool.req_to_token)
    with pytest.raises(UnsupportedFeatureError, match="HND at page_size 16"):
        check_window_pool_step(x, "HND", 16, "flashinfer")
    check_window_pool_step(x, "NHD", 16, "flashinfer")
    check_window_pool_step(x, "HND", 1, "flashinfer")


def test_local_steps_refuse_verify_masks_and_hnd_token_keys():
    """A context with chunked local layers: a verify tree mask is refused, and HND only where the local
    key lists would be per token at page_size > 1 (chunks off the pages)."""
    b, pool = _batch("TARGET_VERIFY", [(5, 3), (2, 3)])
    with pytest.raises(UnsupportedFeatureError, match="custom mask"):
        check_local_step(eager_inputs(b, pool.req_to_token), "NHD", 1, 1, "flashinfer")
    b, pool = _batch("EXTEND", [(5, 3), (0, 4)], page_size=16)
    x = eager_inputs(b, pool.req_to_token)
    with pytest.raises(UnsupportedFeatureError, match="HND at page_size 16"):
        check_local_step(x, "HND", 16, 1, "flashinfer")
    check_local_step(x, "HND", 16, 16, "flashinfer")
    check_local_step(x, "NHD", 16, 1, "flashinfer")


def test_verify_mask_checks_length_and_pads_graph_rows():
    q = torch.tensor([2, 2])
    seq = torch.tensor([3, 4])
    spec = SpecInfo(num_draft_tokens=2, custom_mask=torch.rand(14) > 0.5)
    assert torch.equal(verify_mask(spec, q, seq, pad=False), spec.custom_mask)
    short = SpecInfo(num_draft_tokens=2, custom_mask=spec.custom_mask[:6])
    with pytest.raises(InvalidArgumentError, match="custom_mask"):
        verify_mask(short, q, seq, pad=False)
    padded = verify_mask(short, q, seq, pad=True)
    assert padded.numel() == 14 and torch.equal(padded[:6], short.custom_mask) and bool(padded[6:].all())
    static = SpecInfo(num_draft_tokens=2, custom_mask=torch.cat([spec.custom_mask, torch.rand(40) > 0.5]))
    with pytest.raises(InvalidArgumentError, match="custom_mask"):  # an eager step's mask is exactly its size
        verify_mask(static, q, seq, pad=False)
    assert torch.equal(verify_mask(static, q, seq, pad=True), spec.custom_mask)  # a graph's buffer: its start
    with pytest.raises(InvalidArgumentError, match="bool"):
        verify_mask(SpecInfo(2, torch.ones(14, dtype=torch.uint8)), q, seq, pad=False)


def test_graph_inputs_slice_to_the_batch_size():
    r2t = torch.zeros(4, 8, dtype=torch.int32)
    rows, seq = torch.arange(4), torch.tensor([3, 4, 1, 1], dtype=torch.int32)
    step = CudaGraphStep(forward_mode=ForwardMode.DECODE, bs=2, req_pool_indices=rows, seq_lens=seq)
    x = graph_inputs(r2t, step, step.num_tokens, seq[:2], None)
    assert x.bs == 2 and x.num_tokens == 2 and x.req_pool_indices.shape[0] == 2 and x.q_lens_host is None
    spec = SpecInfo(num_draft_tokens=2, custom_mask=torch.ones(6, dtype=torch.bool))
    step = CudaGraphStep(
        forward_mode=ForwardMode.TARGET_VERIFY, bs=2, req_pool_indices=rows, seq_lens=seq, spec_info=spec
    )
    x = graph_inputs(r2t, step, step.num_tokens, seq[:2], None)
    assert x.num_tokens == 4 and x.q_lens_host.tolist() == [2, 2] and x.custom_mask.numel() == 14
