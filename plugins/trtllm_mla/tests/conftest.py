"""The fixture of the CPU wiring tests: `trt_factory`, `TRTLLMMLABackend` allowed on the CPU, its TRT-LLM
kernel calls replaced by `fake_trtllm_decode` (plain float64, the documented semantics of FlashInfer
0.6.6's `trtllm_batch_decode_with_kv_cache_mla`) and its fallback a `FlashInferMLABackend` over
attn-flashinfer's float64 stand-in for FlashInfer (`plugins/flashinfer_backend/tests/fake_flashinfer.py`),
allowed on the CPU too. Tests using it skip where the real flashinfer is importable."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pathlib

import pytest
import torch

FAKE_FLASHINFER = pathlib.Path(__file__).resolve().parents[2] / "flashinfer_backend" / "tests" / "fake_flashinfer.py"


def fake_trtllm_decode(kwargs: dict, kernel: str) -> torch.Tensor:
    """TRT-LLM's MLA decode in float64, from the arguments `args.decode_kwargs` packs: query `[bs, q_len,
    H, rank + rope]`, the paged latent `[pages, P, rank + rope]`, block table `[bs, width]` (entries past a
    request's pages must be -1: asserted), key counts `[bs]`; token t of a request with n keys sees keys
    < n - q_len + t + 1; scores × bmm1_scale, output × bmm2_scale over the latent's first rank channels.
    Returns `out` (filled, q_len 1 with `out` given) or a new `[bs, H, rank]` / `[bs, q_len, H, rank]`."""
    assert kernel == "trtllm-gen"
    q, cache, table, lens = kwargs["query"], kwargs["kv_cache"], kwargs["block_tables"], kwargs["seq_lens"]
    rank, bmm1, bmm2 = kwargs["kv_lora_rank"], kwargs["bmm1_scale"], kwargs["bmm2_scale"]
    bs, q_len, heads, dim = q.shape
    page = cache.shape[1]
    assert table.dtype == torch.int32 and lens.dtype == torch.int32 and table.shape[1] * page % 128 == 0
    out = torch.zeros(bs, q_len, heads, rank, dtype=torch.float64)
    for b in range(bs):
        n = int(lens[b])
        assert n <= kwargs["max_seq_len"]
        used = -(-n // page)
        assert bool((table[b, used:] == -1).all()), "padding entries are -1"
        keys = cache[table[b, :used].long()].reshape(-1, dim)[:n].double()
        scores = torch.einsum("thd,nd->thn", q[b].double(), keys) * bmm1
        visible = torch.arange(n)[None, :] < (n - q_len + torch.arange(q_len) + 1)[:, None]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out[b] = torch.einsum("thn,nr->thr", torch.softmax(scores, -1), keys[:, :rank]) * bmm2
    if q_len == 1 and kwargs["out"] is not None:
        kwargs["out"].copy_(out[:, 0].to(kwargs["out"].dtype))
        return kwargs["out"]
    out = out.to(q.dtype)
    return out[:, 0] if q_len == 1 else out


@pytest.fixture(scope="module")
def trt_factory():
    """A TRTLLMMLABackend subclass allowed on the CPU, over the stand-ins; `.calls` counts the TRT-LLM
    decode calls by q_len."""
    spec = importlib.util.spec_from_file_location("fake_flashinfer_loader", FAKE_FLASHINFER)
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    with loader.installed(("attn_trtllm_mla.backend",)) as fake:
        mla_backend = importlib.import_module("attn_flashinfer.mla_backend")
        trt = importlib.import_module("attn_trtllm_mla.backend")
        kernel = importlib.import_module("attn_trtllm_mla.kernel")
        calls: list[int] = []

        class MLAOnCpu(mla_backend.FlashInferMLABackend):
            capabilities = dataclasses.replace(mla_backend.CAPABILITIES, devices=frozenset({"cuda", "cpu"}))
            cpu_work_sms = fake.NUM_SM

            def __init__(self, ctx, **kw):
                super().__init__(ctx, workspace_bytes=1 << 20, **kw)

        class TrtOnCpu(trt.TRTLLMMLABackend):
            capabilities = dataclasses.replace(trt.CAPABILITIES, devices=frozenset({"cuda", "cpu"}))
            fallback_class = MLAOnCpu

        def decode(kwargs, name):
            calls.append(kwargs["query"].shape[1])
            return fake_trtllm_decode(kwargs, name)

        patch = pytest.MonkeyPatch()
        patch.setattr(kernel, "kernel_for", lambda capability, dtype: "trtllm-gen" if dtype == torch.bfloat16 else None)
        patch.setattr(kernel, "new_workspace", lambda device: torch.zeros(1024, dtype=torch.uint8, device=device))
        patch.setattr(kernel, "decode", decode)
        TrtOnCpu.calls = calls
        try:
            yield TrtOnCpu
        finally:
            patch.undo()
