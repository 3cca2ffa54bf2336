"""How big the conformance kit's cases are: one `KitProfile` per (device, quick).

CPU profiles keep every case tiny (a Triton backend runs them under the interpreter); CUDA profiles use
realistic head counts and context lengths. `--quick` trims the number of cases, not their meaning.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class KitProfile:
    """Sizes and counts of one kit run, built by keyword. Lengths are in tokens."""

    name: str
    device: str
    quick: bool
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    mla_head_dim: int  # kv_lora_rank + qk_rope_head_dim of MLA cases when any head_dim is allowed
    max_batch: int  # requests per random batch
    max_prefix: int  # cached tokens of an ordinary request
    max_extend: int  # new tokens of an ordinary extend request
    long_len: int  # length of the occasional long request
    max_draft: int  # draft tokens per TARGET_VERIFY request
    random_cases: int  # seeded random compositions per forward mode
    hypothesis_examples: int  # examples per mode of the pytest hypothesis test
    head_dims: tuple[int, ...]  # tried when the backend accepts any head_dim
    gqa: tuple[tuple[int, int], ...]  # (q heads, kv heads) tried
    windows: tuple[int, ...]  # sliding windows tried
    num_layers: int = 2  # layers per case: metadata is built once and reused by all
    #: chunk sizes of chunked local attention tried (at least one not a multiple of the page sizes)
    chunk_sizes: tuple[int, ...] = (5, 24)


_PROFILES = {
    ("cpu", True): KitProfile(
        name="cpu-quick",
        device="cpu",
        quick=True,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        mla_head_dim=40,
        max_batch=4,
        max_prefix=20,
        max_extend=7,
        long_len=80,
        max_draft=3,
        random_cases=1,
        hypothesis_examples=5,
        head_dims=(32, 64, 128),
        gqa=((4, 4), (8, 1)),
        windows=(1, 5),
    ),
    ("cpu", False): KitProfile(
        name="cpu",
        device="cpu",
        quick=False,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        mla_head_dim=40,
        max_batch=6,
        max_prefix=64,
        max_extend=24,
        long_len=300,
        max_draft=5,
        random_cases=4,
        hypothesis_examples=25,
        head_dims=(32, 64, 96, 128, 256),
        gqa=((4, 4), (8, 1), (8, 2), (10, 2)),
        windows=(1, 3, 16),
    ),
    ("cuda", True): KitProfile(
        name="cuda-quick",
        device="cuda",
        quick=True,
        num_q_heads=16,
        num_kv_heads=4,
        head_dim=128,
        mla_head_dim=576,
        max_batch=8,
        max_prefix=512,
        max_extend=64,
        long_len=2048,
        max_draft=8,
        random_cases=1,
        hypothesis_examples=5,
        head_dims=(64, 128, 256),
        gqa=((16, 16), (32, 4)),
        windows=(1, 128),
        chunk_sizes=(200,),
    ),
    ("cuda", False): KitProfile(
        name="cuda",
        device="cuda",
        quick=False,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        mla_head_dim=576,
        max_batch=16,
        max_prefix=2048,
        max_extend=256,
        long_len=8192,
        max_draft=8,
        random_cases=4,
        hypothesis_examples=25,
        head_dims=(64, 96, 128, 256),
        gqa=((32, 32), (32, 8), (64, 8), (40, 8), (16, 1)),
        windows=(1, 128, 1024),
        chunk_sizes=(200, 1024),
    ),
}


def profile_for(device: str, quick: bool) -> KitProfile:
    """The profile of a kit run on `device` ("cpu" or "cuda", an index like "cuda:1" allowed)."""
    kind = device.split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        kind = "cuda"  # other accelerators get the realistic sizes
    base = _PROFILES[(kind, bool(quick))]
    return base if device == base.device else _replace_device(base, device)


def _replace_device(p: KitProfile, device: str) -> KitProfile:
    from dataclasses import replace

    return replace(p, device=device)
