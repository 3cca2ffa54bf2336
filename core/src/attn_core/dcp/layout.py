"""Decode-context-parallel (DCP) KV layout: a request's tokens interleaved over the DCP ranks.

With `world` ranks and interleave size `I` (tokens per block; the page size by default), global token
position p of a request lives on rank `(p // I) % world`, at local position
`(p // (I * world)) * I + p % I` in that rank's own row of the request. Block b (tokens b*I .. b*I+I-1)
goes to rank b % world; each rank's blocks are contiguous in its local row, so with I equal to the page
size a local page holds exactly one block.

Worked example (world 2, I 4, a request of 11 tokens):

    position      0 1 2 3 | 4 5 6 7 | 8 9 10
    rank          0 0 0 0 | 1 1 1 1 | 0 0 0
    local pos     0 1 2 3 | 0 1 2 3 | 4 5 6
    local length  rank 0: 7, rank 1: 4

All helpers take and return int64 tensors (any shape; host or device, no sync) and are pure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_core.contract.errors import InvalidArgumentError


@dataclass(frozen=True)
class DcpLayout:
    """Where a request's tokens live across `world` DCP ranks, in blocks of `interleave` tokens.

    Example: DcpLayout(world=2, interleave=4).rank_of(torch.tensor([0, 4, 8, 10])) -> [0, 1, 0, 0].
    """

    world: int
    interleave: int

    def __post_init__(self):
        if not isinstance(self.world, int) or self.world < 1:
            raise InvalidArgumentError("world", "an int >= 1 (the number of DCP ranks)", self.world)
        if not isinstance(self.interleave, int) or self.interleave < 1:
            raise InvalidArgumentError(
                "interleave", "an int >= 1 (tokens per block, the page size by default)", self.interleave
            )

    def check_rank(self, rank: int) -> None:
        """Raise `InvalidArgumentError` unless 0 <= rank < world."""
        if not isinstance(rank, int) or not 0 <= rank < self.world:
            raise InvalidArgumentError("rank", f"an int in [0, {self.world})", rank)

    def rank_of(self, positions: torch.Tensor) -> torch.Tensor:
        """The rank holding each global token position (int64, same shape).

        Example (world 2, interleave 4): [0, 3, 4, 7, 8, 10] -> [0, 0, 1, 1, 0, 0].
        """
        return torch.div(positions, self.interleave, rounding_mode="floor") % self.world

    def local_position(self, positions: torch.Tensor) -> torch.Tensor:
        """Each global position's index in its rank's local row of the request (int64, same shape).

        Example (world 2, interleave 4): [0, 3, 4, 7, 8, 10] -> [0, 3, 0, 3, 4, 6].
        """
        cycle = self.interleave * self.world
        return torch.div(positions, cycle, rounding_mode="floor") * self.interleave + positions % self.interleave

    def local_lens(self, lens: torch.Tensor, rank: int) -> torch.Tensor:
        """How many of a request's first `lens` tokens live on `rank` (int64, same shape as lens).

        Example (world 2, interleave 4): lens [0, 3, 4, 5, 11] -> rank 0: [0, 3, 4, 4, 7], rank 1: [0, 0, 0, 1, 4].
        """
        self.check_rank(rank)
        cycle = self.interleave * self.world
        full = torch.div(lens, cycle, rounding_mode="floor") * self.interleave
        return full + (lens % cycle - rank * self.interleave).clamp(0, self.interleave)

    def global_position(self, local: torch.Tensor, rank: int) -> torch.Tensor:
        """The global position of each index of `rank`'s local row (int64, same shape); the inverse of
        `local_position` on that rank.

        Example (world 2, interleave 4): rank 0 [0, 3, 4, 6] -> [0, 3, 8, 10]; rank 1 [0, 3, 4] -> [4, 7, 12].
        """
        self.check_rank(rank)
        block = torch.div(local, self.interleave, rounding_mode="floor")
        return (block * self.world + rank) * self.interleave + local % self.interleave
