"""Token positions and offsets of a step, computed on the device from per-request lengths (vectorized,
no host sync: the token count is passed in from the host).

These are the engine's inputs to rotary position embeddings (RoPE): attention backends never read
`ForwardBatch.positions`; the engine applies RoPE to q and k itself before calling attention, at the
positions these helpers give. `attn_core.build_step` fills `ForwardBatch.positions` and
`extend_start_loc` with them.

Tokens of a step are flattened request after request; request r runs `extend_lens[r]` new tokens after
`prefix_lens[r]` cached ones, so its tokens sit at positions prefix_lens[r] .. prefix_lens[r] +
extend_lens[r] - 1.
"""

from __future__ import annotations

import torch


def extend_start_loc_from_lens(extend_lens: torch.Tensor) -> torch.Tensor:
    """int32 `[bs]`: row of each request's first new token in the flattened token dimension.

    Worked example: extend_lens [3, 0, 2] -> [0, 3, 3].
    """
    out = torch.zeros(extend_lens.shape[0], dtype=torch.int32, device=extend_lens.device)
    out[1:] = torch.cumsum(extend_lens[:-1], dim=0)
    return out


def positions_from_lens(prefix_lens: torch.Tensor, extend_lens: torch.Tensor, total: int) -> torch.Tensor:
    """int64 `[total]`: the position of every new token of the step (token i of request r sits at
    prefix_lens[r] + i). `total` = extend_lens.sum(), given from the host so nothing syncs.

    Worked example: prefix_lens [0, 5, 2], extend_lens [3, 0, 2], total 5 -> [0, 1, 2, 2, 3].
    A DECODE step (every extend_len 1) gives prefix_lens itself: seq_lens - 1.
    """
    ends = torch.cumsum(extend_lens.to(torch.int64), dim=0)
    tok = torch.arange(total, device=extend_lens.device, dtype=torch.int64)
    owner = torch.searchsorted(ends, tok, right=True)
    starts = ends - extend_lens.to(torch.int64)
    return prefix_lens.to(torch.int64)[owner] + tok - starts[owner]
