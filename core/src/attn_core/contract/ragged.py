"""The ragged op's batch (`RaggedBatch`) and its checks: attention over packed sequences without a KV
cache, each sequence attending only within itself (vision towers, encoders, a cache-less prefill).

Layout: the sequences' tokens are packed one after another; sequence i owns rows
cu_seqlens[i] … cu_seqlens[i+1]-1 of q `[T, Hq, D]` (or `[T, Hq·D]`) and of k / v `[T, Hkv, D]`, T =
cu_seqlens[-1]. Non-causal by default (every row sees every row of its sequence); `causal=True` lets the
row at offset i of its sequence see offsets <= i. The output is `[T, Hq·D]` in q's dtype, the optional
LSE `[T, Hq]` float32 natural log (docs/design.md §3.2).

Per step (e.g. one vision-tower forward over a set of images) an engine builds one `RaggedBatch`
(`ragged_batch` from host lengths, or `ragged_batch_from_cu_seqlens` from a device tensor: one sync),
calls `backend.init_ragged_metadata(batch)` once, then `backend.ragged_attention(q, k, v, batch)` for
every layer; a backend plans once in `build_ragged_metadata` and runs thin per layer, as in the paged path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from attn_core.contract.capabilities import Feature
from attn_core.contract.context import BackendContext
from attn_core.contract.errors import InvalidArgumentError, InvalidBatchError


@dataclass(eq=False)
class RaggedBatch:
    """Packed sequences: `cu_seqlens` int32 `[n + 1]` on the device (0, then the running total of the
    lengths), its host copy `cu_seqlens_cpu` (CPU, int32 or int64), `max_seqlen` the longest length (host
    int), `causal` whether a row sees only the rows before it in its sequence (default: every row)."""

    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    max_seqlen: int
    causal: bool = False

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens_cpu.shape[0] - 1

    @property
    def num_tokens(self) -> int:
        """Rows of q / k / v the batch packs (cu_seqlens[-1])."""
        return int(self.cu_seqlens_cpu[-1]) if self.cu_seqlens_cpu.shape[0] else 0

    @property
    def seq_lens_cpu(self) -> torch.Tensor:
        """int64 `[n]`: each sequence's length, on the host."""
        c = self.cu_seqlens_cpu.to(torch.int64)
        return c[1:] - c[:-1]

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device


def ragged_context(
    device: Union[str, torch.device],
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    return_lse: bool = False,
    validation: str = "basic",
) -> BackendContext:
    """A context for the ragged op alone (a vision tower's): `Feature.RAGGED` (and `Feature.LSE_OUTPUT` with
    `return_lse`), no paged forward mode, no pools, so backends match it on `Capabilities.ragged_head_dims`.

    Example: `create_backend("triton", ragged_context("cuda", torch.bfloat16, 16, 16, 80))`."""
    features = {Feature.RAGGED} | ({Feature.LSE_OUTPUT} if return_lse else set())
    return BackendContext(
        device=device,
        dtype=dtype,
        num_q_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        forward_modes=frozenset(),
        features=frozenset(features),
        validation=validation,
    )


def ragged_batch(
    seq_lens: Union[Sequence[int], torch.Tensor], device: Union[str, torch.device], causal: bool = False
) -> RaggedBatch:
    """A `RaggedBatch` of sequences of these (host) lengths: one host→device copy, no sync.

    Example: `ragged_batch([3, 0, 2], "cpu")` has cu_seqlens [0, 3, 3, 5], max_seqlen 3, num_tokens 5."""
    lens = torch.as_tensor(seq_lens if not isinstance(seq_lens, torch.Tensor) else seq_lens.cpu(), dtype=torch.int64)
    if lens.dim() != 1 or (lens.numel() and int(lens.min()) < 0):
        raise InvalidArgumentError("seq_lens", "a 1-D list of lengths >= 0", lens.tolist())
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=cu[1:])
    return RaggedBatch(cu.to(device, non_blocking=True), cu, int(lens.max()) if lens.numel() else 0, bool(causal))


def ragged_batch_from_cu_seqlens(
    cu_seqlens: torch.Tensor, causal: bool = False, max_seqlen: Optional[int] = None
) -> RaggedBatch:
    """A `RaggedBatch` over an existing cumulative-lengths tensor (int32, on the device the op runs on), its
    host copy made here (one device→host sync; build the batch once per step, not per layer).

    Example: cu_seqlens [0, 4, 9] → lengths 4 and 5, max_seqlen 5."""
    if (
        not isinstance(cu_seqlens, torch.Tensor)
        or cu_seqlens.dim() != 1
        or cu_seqlens.dtype not in (torch.int32, torch.int64)
    ):
        found = cu_seqlens if not isinstance(cu_seqlens, torch.Tensor) else (cu_seqlens.dtype, tuple(cu_seqlens.shape))
        raise InvalidArgumentError("cu_seqlens", "a 1-D int32 tensor [n + 1]", found)
    host = cu_seqlens.cpu()
    lens = host[1:].to(torch.int64) - host[:-1].to(torch.int64)
    longest = int(lens.max()) if lens.numel() else 0
    return RaggedBatch(
        cu_seqlens.to(torch.int32), host, longest if max_seqlen is None else int(max_seqlen), bool(causal)
    )


def check_ragged_batch(batch: RaggedBatch, device: torch.device, full: bool = False) -> None:
    """Raise `InvalidBatchError` naming the field unless `batch` is sound on `device`: cu_seqlens int32
    `[n + 1]` (n >= 0) on `device`, its host copy int32/int64 of the same length on the CPU, starting at 0
    and non-decreasing, max_seqlen >= every length. Host copy only (no sync) unless `full`: then also the
    device tensor against the host copy (one sync).

    Example: cu_seqlens_cpu [0, 3, 2] raises (lengths must be >= 0); [0, 3, 5] with max_seqlen 2 raises."""
    if not isinstance(batch, RaggedBatch):
        raise InvalidArgumentError("ragged", "a RaggedBatch (attn_core.contract.ragged)", type(batch).__name__)
    cu, host = batch.cu_seqlens, batch.cu_seqlens_cpu
    if (
        not isinstance(cu, torch.Tensor)
        or cu.dtype != torch.int32
        or cu.dim() != 1
        or cu.numel() < 1
        or cu.device != device
    ):
        found = (cu.dtype, tuple(cu.shape), cu.device) if isinstance(cu, torch.Tensor) else cu
        raise InvalidBatchError("ragged.cu_seqlens", f"an int32 tensor [n + 1] on {device}", found)
    if (
        not isinstance(host, torch.Tensor)
        or host.dtype not in (torch.int32, torch.int64)
        or host.shape != cu.shape
        or host.device.type != "cpu"
    ):
        found = (host.dtype, tuple(host.shape), host.device) if isinstance(host, torch.Tensor) else host
        raise InvalidBatchError("ragged.cu_seqlens_cpu", f"an int32/int64 CPU tensor of shape {tuple(cu.shape)}", found)
    h = host.to(torch.int64)
    lens = h[1:] - h[:-1]
    if int(h[0]) != 0 or (lens.numel() and int(lens.min()) < 0):
        raise InvalidBatchError("ragged.cu_seqlens_cpu", "0, then non-decreasing offsets", h.tolist())
    longest = int(lens.max()) if lens.numel() else 0
    if not isinstance(batch.max_seqlen, int) or batch.max_seqlen < longest:
        raise InvalidBatchError("ragged.max_seqlen", f"an int >= the longest sequence ({longest})", batch.max_seqlen)
    if full and not torch.equal(cu.cpu().to(torch.int64), h):
        raise InvalidBatchError("ragged.cu_seqlens", f"the values of its host copy {h.tolist()}", cu.cpu().tolist())


def ragged_heads(
    name: str, x, rows: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`x` as `[rows, heads, dim]` (itself, or a view of `[rows, heads · dim]`), or `InvalidArgumentError`
    naming `name` for another type, shape, dtype or device.

    Example: a `[10, 64]` tensor with rows 10, heads 4, dim 16 gives a `[10, 4, 16]` view."""
    if not isinstance(x, torch.Tensor):
        raise InvalidArgumentError(name, f"a tensor [{rows}, {heads}, {dim}]", None if x is None else type(x).__name__)
    if x.dtype != dtype:
        raise InvalidArgumentError(name, f"dtype {dtype} (the context's dtype)", x.dtype)
    if x.device != device:
        raise InvalidArgumentError(name, f"a tensor on {device}", x.device)
    if tuple(x.shape) == (rows, heads, dim):
        return x
    if tuple(x.shape) == (rows, heads * dim):
        return x.reshape(rows, heads, dim)
    raise InvalidArgumentError(name, f"shape ({rows}, {heads}, {dim}) or ({rows}, {heads * dim})", tuple(x.shape))


__all__ = [
    "RaggedBatch",
    "check_ragged_batch",
    "ragged_batch",
    "ragged_batch_from_cu_seqlens",
    "ragged_context",
    "ragged_heads",
]
