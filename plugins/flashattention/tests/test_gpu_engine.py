"""The example engine (examples/hf_llama.py) on a Hopper GPU with fa4, and with the selection's hybrid
(prefill on fa4, decode on attn-triton), against `transformers`' own greedy `generate` of the float32
model: arrivals over time, chunked prefill (MIXED steps), prefix sharing, CUDA-graph decode, speculative
decoding with tree-shaped verify masks. Attention runs in float16 (FA4 has no float32 path); the tokens
must be the same. Skips without CUDA, flash-attn-4, attn-triton or transformers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import attn_core as ac
from attn_core.contract.capabilities import Requirements
from attn_core.contract.forward_mode import ForwardMode

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[3]


def _usable(name: str) -> bool:
    entry = next((e for e in ac.list_backends() if e.name == name), None)
    return entry is not None and entry.ok and entry.probe() is None


def _engine_module():
    pytest.importorskip("transformers", reason="the example engine needs transformers (GPU runs: wheels in .whl/)")
    spec = importlib.util.spec_from_file_location("hf_llama", ROOT / "examples" / "hf_llama.py")
    module = sys.modules.setdefault("hf_llama", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module


def _greedy(model, jobs) -> list[list[int]]:
    outs = []
    for j in jobs:
        ids = torch.tensor([j.prompt], device=model.device)
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=j.max_new,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
        outs.append(gen[0, len(j.prompt) :].tolist())
    return outs


def _poisoned(engine):
    for layer in range(engine.kv.layer_num):
        engine.kv.get_key_buffer(layer).fill_(float("nan"))
        engine.kv.get_value_buffer(layer).fill_(float("nan"))
    return engine


def _selected_on_this_gpu() -> str:
    """What `select_backend` picks for the engine's settings here (fa4 and attn-triton installed)."""
    modes = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED})
    cc = tuple(torch.cuda.get_device_capability())
    dtypes = dict(q_dtype="float16", kv_dtype="float16")
    return ac.select_backend(
        Requirements(
            device_type="cuda", compute_capability=cc, head_dim=128, page_size=16, forward_modes=modes, **dtypes
        )
    )


@pytest.mark.parametrize("which", ["fa4", "selected"])
def test_engine_matches_generate(which):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not _usable("fa4"):
        pytest.skip("fa4 cannot run here")
    backend = which
    if which == "selected":
        if not _usable("triton"):
            pytest.skip("attn-triton cannot run here")
        backend = _selected_on_this_gpu()
        if torch.cuda.get_device_capability() == (9, 0):
            assert backend == "hybrid(prefill=fa4,decode=triton)", backend
    hf = _engine_module()
    model = hf.tiny_llama(seed=0, layers=2, device="cuda")
    reference = _greedy(model, hf.demo_jobs(seed=1, n=8, max_new=8))
    for page_size in (1, 16):
        for graph_sizes in ((), (1, 2, 4)):
            jobs = hf.demo_jobs(seed=1, n=8, max_new=8)
            sizes = dict(num_slots=256, max_running=4, token_budget=32)
            engine = _poisoned(
                hf.Engine(model, backend, page_size, attn_dtype=torch.float16, graph_sizes=graph_sizes, **sizes)
            )
            engine.serve(jobs)
            assert [j.out for j in jobs] == reference, (backend, page_size, graph_sizes)
        spec_jobs = hf.demo_jobs(seed=4, n=4, max_new=12)
        engine = _poisoned(
            hf.Engine(model, backend, page_size, num_slots=512, max_running=4, attn_dtype=torch.float16, spec_steps=3)
        )
        engine.serve_speculative(spec_jobs, draft_layers=1)
        assert [j.out for j in spec_jobs] == _greedy(model, hf.demo_jobs(seed=4, n=4, max_new=12)), (
            "speculative",
            backend,
            page_size,
        )
