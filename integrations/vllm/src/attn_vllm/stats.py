"""Counters of what attn did for vLLM in this process (tests read them with vLLM's engine in-process,
`VLLM_ENABLE_V1_MULTIPROCESSING=0`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Stats:
    """Steps built (`steps`, by mode in `modes`), layer attention calls, K/V writes, checks that the
    cache vLLM passed is the memory attn's pool wraps, the attn backends used and each pool's layout."""

    steps: int = 0
    attention_calls: int = 0
    kv_writes: int = 0
    cache_checks: int = 0
    modes: dict[str, int] = field(default_factory=dict)
    backends: set[str] = field(default_factory=set)
    pools: list[str] = field(default_factory=list)

    def reset(self) -> None:
        self.__init__()


#: this process's counters
STATS = Stats()
