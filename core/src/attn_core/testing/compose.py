"""Random batch compositions: which requests a step carries, drawn from any source of integers.

`compose_requests(draw, mode, profile)` is the one place that decides what a random batch looks like;
`draw(lo, hi)` returns an int in [lo, hi]. The CLI passes a seeded `random.Random().randint`, the pytest
suite passes hypothesis' `data.draw(integers(lo, hi))` so failures shrink to small batches.
"""

from __future__ import annotations

from typing import Callable

from attn_core.contract.forward_mode import ForwardMode
from attn_core.testing.profile import KitProfile

Draw = Callable[[int, int], int]


def compose_requests(draw: Draw, mode: ForwardMode, profile: KitProfile) -> list[tuple[int, int]]:
    """(prefix_len, extend_len) of every request of one random step of `mode`.

    Mixes fresh prefills, prefix hits, one-token requests, the occasional long request (about 1 in 8
    lengths), empty extend rows (EXTEND only) and, for MIXED, both decode and extend requests.
    """
    mode = ForwardMode.parse(mode)
    bs = draw(1, profile.max_batch)

    def prefix(lo: int = 0) -> int:
        return draw(profile.long_len // 2, profile.long_len) if draw(0, 7) == 0 else draw(lo, profile.max_prefix)

    def extend() -> int:
        return draw(profile.long_len // 2, profile.long_len) if draw(0, 7) == 0 else draw(1, profile.max_extend)

    if mode.is_decode():
        return [(prefix(), 1) for _ in range(bs)]
    if mode.is_target_verify():
        n = draw(1, profile.max_draft)
        return [(prefix(1), n) for _ in range(bs)]
    reqs: list[tuple[int, int]] = []
    for _ in range(bs):
        kind = draw(0, 3)
        if kind == 0:
            reqs.append((0, extend()))  # fresh prefill
        elif kind == 1:
            reqs.append((prefix(1), extend()))  # prefix hit or a later chunk
        elif kind == 2 or mode != ForwardMode.EXTEND:
            reqs.append((prefix(), 1))  # one new token
        else:
            reqs.append((prefix(1), 0))  # empty extend row (legal in EXTEND)
    if mode.is_mixed():
        if not any(e == 1 for _, e in reqs):
            reqs.append((prefix(), 1))
        if not any(e > 1 for _, e in reqs):
            reqs.append((prefix(), draw(2, max(2, profile.max_extend))))
    if not any(e for _, e in reqs):
        reqs[0] = (reqs[0][0], 1)
    return reqs
