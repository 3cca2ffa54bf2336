"""A Triton helper every attention kernel's masked tiles share: keys a row does not see add exactly nothing
to it, whatever their values hold (docs/design.md §3.2).

A tile's P·V adds p · v for every key of the tile and every row, and 0 · Inf = NaN: a key masked for one
row (p = 0) but visible to another in the same tile (a causal diagonal, a window edge, a verify mask)
turns the first row's output into NaN when its V holds Inf or NaN. `finite_values` zeroes the V entries
that are not finite before the product and says which rows *see* such a key, so the kernel can give those
rows NaN (their exact output is not finite either). Used by attn-triton's extend / verify / MLA kernels
and attn-sparse's ranged kernel. Importing this module imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def finite_values(v, ok):
    """A masked tile's values `v` [N, DV] with every entry that is not finite (Inf, NaN) set to 0, and
    `seen` [M] int32: 1 for the rows of `ok` [M, N] (which row sees which key) that see a key whose
    values held one. The tile's P·V then adds exactly nothing for a key a row does not see (p = 0 times
    a zero, never 0 · Inf = NaN), and the caller gives a row that does see one NaN. Example: v rows
    [1, 2], [inf, 0]; ok [[T, F], [T, T]] -> v [[1, 2], [0, 0]], seen [0, 1]."""
    finite = tl.abs(v.to(tl.float32)) < float("inf")  # False for NaN too
    bad_key = tl.max(tl.where(finite, 0, 1), 1)
    seen = tl.max(tl.where(ok & (bad_key[None, :] != 0), 1, 0), 1)
    return tl.where(finite, v, tl.zeros_like(v)), seen
