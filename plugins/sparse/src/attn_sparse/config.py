"""Launch shapes of attn-sparse's kernels: how a request's keys are split across programs (`SplitPolicy`)
and how query rows are packed into a tile (`TileGeometry`). Pure host arithmetic, no torch.

Query rows of a tile: `BLOCK_M` rows, each one (token, q head) pair of one request and one KV head: the
tile covers `block_t` consecutive new tokens of the request times `heads_per_slice` of the KV head's
`group` q heads (GQA packing: the group's heads share each K/V tile they load). A group wider than a tile
is cut into `slices`.
"""

from __future__ import annotations

from dataclasses import dataclass

from attn_core.contract.errors import InvalidArgumentError


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: cdiv(7, 2) == 4, cdiv(0, 5) == 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1): next_power_of_2(5) == 8, next_power_of_2(16) == 16."""
    return 1 << (max(n, 1) - 1).bit_length()


@dataclass(frozen=True)
class SplitPolicy:
    """How many parts ("splits") the keys of every tile are cut into, each part one program writing a
    partial output and LSE that a reduction merges (split-K, for parallelism when tiles are few).

    - `min_split_keys`: a split covers at least this many keys of the longest request;
    - `max_splits`: at most this many splits (also the split count a CUDA graph is captured with, for
      the context's longest request);
    - `target_programs`: a step whose tiles already make this many programs is not split.
    """

    min_split_keys: int = 512
    max_splits: int = 16
    target_programs: int = 264

    def __post_init__(self) -> None:
        for name in ("min_split_keys", "max_splits", "target_programs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"split_policy.{name}", "an int >= 1", value)

    def splits(self, max_keys: int, programs: int) -> int:
        """Splits for a step whose longest request has `max_keys` keys and whose tiles make `programs`
        programs without splitting: 1 when `programs` reaches `target_programs`, else as many as fill
        the target, capped by `max_splits` and by `max_keys / min_split_keys`; at least 1.

        Example (defaults): splits(32768, 8) == 16 (capped); splits(2048, 8) == 4 (512 keys each);
        splits(32768, 300) == 1 (enough programs already); splits(100, 8) == 1.
        """
        if programs >= self.target_programs:
            return 1
        return max(
            1, min(self.max_splits, cdiv(max_keys, self.min_split_keys), cdiv(self.target_programs, max(programs, 1)))
        )


@dataclass(frozen=True)
class TileGeometry:
    """Query rows of one tile (see the module docstring). `block_m` = rows (a power of two >= 16),
    `heads_per_slice` = q heads of one KV head per tile, `slices` = tiles across the group,
    `block_t` = new tokens per tile."""

    block_m: int
    heads_per_slice: int
    slices: int
    block_t: int


def tile_geometry(group: int, decode: bool, on_gpu: bool) -> TileGeometry:
    """The tile shape for a group of `group` q heads per KV head: in DECODE one token per request, so
    the rows are the group's heads (up to 64, padded to >= 16); in extend-like steps 64 rows on a GPU (16
    under the interpreter, which runs programs one after another) filled with as many tokens as the
    heads leave room for.

    Example: tile_geometry(4, decode=False, on_gpu=True) == TileGeometry(64, 4, 1, 16);
    tile_geometry(4, decode=True, on_gpu=True) == TileGeometry(16, 4, 1, 4) (3 of the 4 token slots of
    a decode tile stay empty); tile_geometry(96, decode=True, on_gpu=True) == TileGeometry(64, 64, 2, 1).
    """
    if group < 1:
        raise InvalidArgumentError("group", "q heads per KV head >= 1", group)
    hps = min(group, 64)
    rows = 16 if decode or not on_gpu else 64
    block_m = max(rows, next_power_of_2(hps))
    return TileGeometry(block_m=block_m, heads_per_slice=hps, slices=cdiv(group, hps), block_t=block_m // hps)
