"""Run vLLM's own engine once on the CPU and write what it produced as JSON (used by the tests, one
process per engine: `python vllm_run.py SPEC.json OUT.json`).

SPEC: {"model": dir, "backend": attn backend name or null (vLLM's own CPU backend), "llm": extra LLM(...)
arguments, "prompts": [[token ids]], "max_tokens": [per prompt]}. OUT: {"tokens": [[ids]], "cached":
[num_cached_tokens per prompt], "stats": attn_vllm.stats.STATS as a dict (attn runs), "caches": whether
every layer's cache after the run is still the memory the attn pool wrapped} or {"error": type name,
"message": str} when vLLM refused to start. The engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so the counters are readable here.
"""

from __future__ import annotations

import json
import os
import sys


def _caches_kept(llm) -> bool:
    """Whether the memory every attn pool wraps is exactly the memory vLLM's attention layers hold as
    their caches (storage identity: attn read and wrote vLLM's cache, no copy of it)."""
    import gc

    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    from attn_core import EngineKVPool

    found = get_layers_from_vllm_config(llm.llm_engine.vllm_config, Attention)
    layers = {layer.kv_cache.untyped_storage().data_ptr() for layer in found.values()}
    pools = [o for o in gc.get_objects() if isinstance(o, EngineKVPool)]
    wrapped = {
        t.untyped_storage().data_ptr() for pool in pools for t in pool.engine_tensors[0] + pool.engine_tensors[1]
    }
    return bool(layers) and wrapped == layers


def main(spec_path: str, out_path: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with open(spec_path) as f:
        spec = json.load(f)
    kwargs = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        seed=0,
    )
    kwargs.update(spec.get("llm", {}))
    if spec.get("backend"):
        os.environ["ATTN_VLLM_BACKEND"] = spec["backend"]
        kwargs["attention_backend"] = "CUSTOM"
    from vllm import LLM, SamplingParams

    result: dict = {}
    try:
        llm = LLM(**kwargs)
    except Exception as exc:  # the refusal tests read the type and message
        chain, e = [], exc
        while e is not None:
            chain.append(f"{type(e).__name__}: {e}")
            e = e.__cause__ or e.__context__
        result = {"error": type(exc).__name__, "message": "\n".join(chain)}
    else:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in spec["max_tokens"]]
        outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        result["cached"] = [o.num_cached_tokens or 0 for o in outs]
        if spec.get("backend"):
            from attn_vllm.stats import STATS

            result["stats"] = {
                "steps": STATS.steps,
                "attention_calls": STATS.attention_calls,
                "kv_writes": STATS.kv_writes,
                "cache_checks": STATS.cache_checks,
                "modes": STATS.modes,
                "backends": sorted(STATS.backends),
                "pools": STATS.pools,
            }
            result["caches"] = _caches_kept(llm)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
