"""`cutlass_mla` around its kernel call, on the CPU through the float64 stand-in: page tables and workspace
sizing per step and for graphs, folded k_scale, refusals (modes, heads, latent), and an engine's steps with
`HybridAttnBackend(prefill=torch_native, decode=cutlass_mla)` over one MLA pool against the float64 reference."""

from __future__ import annotations

import pytest
import torch

import attn_core as ac
from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.contract.errors import IncompatibleBackendError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.testing.harness import AttnCase, layer_inputs, make_env, make_layer
from attn_core.testing.reference import reference_attention, relative_error
from attn_core.wrappers import HybridAttnBackend
from attn_trtllm_mla.cutlass_backend import CutlassMLABackend
from attn_trtllm_mla.testing.blackwell_stand_ins import (
    cpu_backend_class,
    cutlass_mla_get_workspace_size,
    cutlass_mla_vendor,
)

MLA = dict(
    num_q_heads=8,
    num_kv_heads=1,
    head_dim=576,
    arch="mla",
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    dtype="bfloat16",
    page_size=128,
)


def test_page_table_and_workspace_per_step_and_for_graphs():
    vendor = cutlass_mla_vendor()
    env = make_env(AttnCase("DECODE", [(300, 1), (6, 1)], **MLA))
    backend = cpu_backend_class(CutlassMLABackend, vendor)(env.ctx)
    backend.init_forward_metadata(env.batch)
    plan = backend.forward_metadata
    assert plan.page_table.shape == (2, 3) and plan.page_table.dtype == torch.int32
    assert plan.workspace.numel() == cutlass_mla_get_workspace_size(3 * 128, 2)
    rows = env.batch.req_pool_indices.tolist()
    r2t = env.req_to_token_pool.req_to_token
    assert plan.page_table[0].tolist() == [int(r2t[rows[0], j * 128]) // 128 for j in range(3)]
    assert plan.page_table[1].tolist() == [int(r2t[rows[1], 0]) // 128, 0, 0]  # the dummy page past its end
    backend.init_cuda_graph_state(4, 4)
    width = -(-env.ctx.max_context_len // 128)
    assert backend._graph["workspace"].numel() == cutlass_mla_get_workspace_size(width * 128, 4)
    b = env.batch
    backend.init_forward_metadata_capture_cuda_graph(
        2, 2, b.req_pool_indices, b.seq_lens, None, ForwardMode.DECODE, None
    )
    layer = make_layer(env.case, 0)
    inputs = layer_inputs(env, 0, torch.Generator().manual_seed(0))
    backend.forward(inputs["q"], inputs["k"], None, layer, b)
    assert vendor.calls[-1] == (2, width)  # the graph's fixed-width table


def test_k_scale_folds_into_sm_scale_and_the_output():
    case = AttnCase("DECODE", [(130, 1), (3, 1)], **MLA)
    outs = []
    for cls in (cpu_backend_class(CutlassMLABackend, cutlass_mla_vendor()), TorchNativeBackend):
        env = make_env(case)
        backend = cls(env.ctx)
        layer = make_layer(case, 0)
        layer.k_scale = 0.5
        inputs = layer_inputs(env, 0, torch.Generator().manual_seed(2))
        backend.init_forward_metadata(env.batch)
        outs.append(backend.forward(inputs["q"], inputs["k"], None, layer, env.batch).float())
    assert (outs[0] - outs[1]).abs().max() / outs[1].abs().max() < 2e-2


def test_refusals():
    cls = cpu_backend_class(CutlassMLABackend, cutlass_mla_vendor())
    with pytest.raises(IncompatibleBackendError, match="up to 128"):
        cls(make_env(AttnCase("DECODE", [(3, 1)], **{**MLA, "num_q_heads": 256})).ctx)
    env = make_env(AttnCase("EXTEND", [(3, 2)], **MLA))
    with pytest.raises(UnsupportedFeatureError, match="EXTEND"):
        cls(env.ctx).init_forward_metadata(env.batch)


def test_hybrid_prefill_torch_native_decode_cutlass_over_engine_steps():
    """The documented pairing: prefill on another backend, DECODE on cutlass_mla, one MLA pool, requests over
    several steps; every step against the float64 reference over each request's history."""
    gen = torch.Generator().manual_seed(4)
    dt, hq, rank, rope, page = torch.bfloat16, 16, 512, 64, 128
    kv = ac.MLATokenToKVPool(
        size=8 * page, page_size=page, dtype=dt, kv_lora_rank=rank, qk_rope_head_dim=rope, layer_num=1
    )
    kv.get_key_buffer(0).fill_(float("nan"))
    rows = ac.ReqToTokenPool(size=4, max_context_len=512)
    requests = ac.RequestPool(rows, ac.PagedTokenAllocator(8 * page, page), kv)
    ctx = ac.BackendContext(
        device="cpu",
        dtype=dt,
        num_q_heads=hq,
        num_kv_heads=1,
        head_dim=rank + rope,
        page_size=page,
        max_context_len=512,
        req_to_token_pool=rows,
        token_to_kv_pool=kv,
        attention_arch="mla",
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
        validation="full",
    )
    decode = cpu_backend_class(CutlassMLABackend, cutlass_mla_vendor())(ctx)
    backend = HybridAttnBackend(prefill=TorchNativeBackend(ctx), decode=decode)
    layer = ac.AttentionLayer(0, hq, 1, rank + rope, scaling=0.05, v_head_dim=rank)
    reqs = [requests.add(), requests.add()]
    history = [torch.zeros(0, 1, rank + rope, dtype=dt) for _ in reqs]
    for new in ([140, 3], [1, 1], [1, 1], [1, 1]):
        batch = ac.build_step(requests, list(zip(reqs, new)), attn_backend=backend)
        T = sum(new)
        q = torch.randn(T, hq, rank + rope, generator=gen).to(dt)
        k = torch.randn(T, 1, rank + rope, generator=gen).to(dt)
        backend.init_forward_metadata(batch)
        out = layer(q, k, None, batch).reshape(T, hq, rank)
        start = 0
        for r, n in enumerate(new):
            history[r] = torch.cat([history[r], k[start : start + n]])
            total = history[r].shape[0]
            ref, _ = reference_attention(
                q[start : start + n],
                history[r],
                history[r][..., :rank],
                q_positions=torch.arange(total - n, total),
                scale=0.05,
            )
            assert relative_error(out[start : start + n], ref) < 2e-2, (new, r)
            start += n
