"""The standard benchmark shapes: the decode and extend rows of docs/design.md §8 plus one mixed batch.

`size="full"` is the anchor model (32 q / 8 kv heads, head_dim 128, bf16) at the anchor batch shapes;
`size="small"` (the CPU default) keeps head_dim and the batch kinds but divides heads, batch sizes and
query lengths by 4 and context lengths by 8, so a 2-core CPU finishes `bench torch_native` in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from attn_core.contract.forward_mode import ForwardMode

KINDS = ("decode", "extend", "mixed")


@dataclass(frozen=True)
class BenchModel:
    """Attention shape of the benchmarked model (heads per rank)."""

    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    kv_dtype: Optional[str] = None
    page_size: int = 1

    @property
    def kv(self) -> str:
        return self.kv_dtype or self.dtype


@dataclass(frozen=True)
class Workload:
    """One benchmark row: a step of `mode` over `requests` = ((prefix_len, extend_len), ...)."""

    kind: str
    label: str
    mode: ForwardMode
    requests: tuple[tuple[int, int], ...]

    @property
    def batch_size(self) -> int:
        return len(self.requests)


def _decode(bs: int, ctx: int) -> Workload:
    return Workload("decode", f"decode bs{bs} ctx{ctx}", ForwardMode.DECODE, ((ctx - 1, 1),) * bs)


def _extend(bs: int, q: int, prefix: int) -> Workload:
    label = f"extend bs{bs} q{q} prefix{prefix}" if prefix else f"prefill bs{bs} q{q}"
    return Workload("extend", label, ForwardMode.EXTEND, ((prefix, q),) * bs)


def _mixed(n_decode: int, ctx: int, n_extend: int, q: int, prefix: int) -> Workload:
    label = f"mixed {n_decode}x decode ctx{ctx} + {n_extend}x extend q{q} prefix{prefix}"
    return Workload("mixed", label, ForwardMode.MIXED, ((ctx - 1, 1),) * n_decode + ((prefix, q),) * n_extend)


def standard_workloads(kind: str = "all", size: str = "full") -> list[Workload]:
    """The rows of `kind` ("decode", "extend", "mixed" or "all") at `size` ("full" or "small")."""
    if size not in ("full", "small"):
        raise ValueError(f"size must be 'full' or 'small', got {size!r}")
    small = size == "small"

    def bs(n: int) -> int:
        return max(1, n // 4) if small else n

    def q(n: int) -> int:
        return max(1, n // 4) if small else n

    def ctx(n: int) -> int:
        return max(1, n // 8) if small else n

    rows = {
        "decode": [
            _decode(bs(1), ctx(8192)),
            _decode(bs(64), ctx(4096)),
            _decode(bs(256), ctx(1024)),
            _decode(bs(16), ctx(32768)),
        ],
        "extend": [_extend(bs(8), q(512), ctx(3584)), _extend(bs(2), q(4096), 0), _extend(bs(32), q(128), ctx(2048))],
        "mixed": [_mixed(bs(60), ctx(2048), bs(4) if not small else 1, q(512), ctx(1024))],
    }
    kinds = KINDS if kind == "all" else (kind,)
    if any(k not in rows for k in kinds):
        raise ValueError(f"workload must be one of {KINDS + ('all',)}, got {kind!r}")
    return [w for k in kinds for w in rows[k]]


def model_for(size: str, dtype: str = "bfloat16", page_size: int = 1, kv_dtype: Optional[str] = None) -> BenchModel:
    """The anchor model of docs/design.md §8 at `size` (heads divided by 4 when small)."""
    heads = (8, 2) if size == "small" else (32, 8)
    return BenchModel(heads[0], heads[1], 128, dtype, kv_dtype, page_size)


def kv_bytes_read(w: Workload, m: BenchModel, kv_itemsize: int) -> int:
    """Bytes of K and V the step must read: every key of every request (new ones included)."""
    return sum(p + e for p, e in w.requests) * m.num_kv_heads * 2 * m.head_dim * kv_itemsize


def step_bytes(w: Workload, m: BenchModel, q_itemsize: int, kv_itemsize: int) -> int:
    """Minimum memory traffic of a step: K/V read, q read, output written, new K/V written."""
    t = sum(e for _, e in w.requests)
    q_and_out = 2 * t * m.num_q_heads * m.head_dim * q_itemsize
    new_kv = t * m.num_kv_heads * 2 * m.head_dim * kv_itemsize
    return kv_bytes_read(w, m, kv_itemsize) + q_and_out + new_kv


def step_flops(w: Workload, m: BenchModel) -> int:
    """Useful FLOPs of a step under the causal mask: 2·Hq·(D + Dv) per visible (query, key) pair;
    a request with prefix P and E new tokens has E·P + E(E+1)/2 visible pairs."""
    pairs = sum(e * p + e * (e + 1) // 2 for p, e in w.requests)
    return 2 * m.num_q_heads * 2 * m.head_dim * pairs
