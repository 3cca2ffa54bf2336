"""`CpuAmxBackend`: paged decode / extend attention on CPU, reading K/V in place from the pool.

Per step `build_forward_metadata` keeps the batch's host tables (request rows, lengths, q offsets, the
verify mask) and checks every visible slot once. Per layer `forward` writes the new K/V into the pool
and calls one C++ kernel that plans work items (request x KV head x token block, KV-split when there
are too few items for the threads), runs them on torch's thread pool and merges the splits by LSE.
A MIXED step is one call too: running its decodes and its prefill chunks as two calls measured no
faster (the work items are the same either way; docs/dev/perf-notebook.md "MIXED steps").

Extra memory of one call (independent of the cached context length):
    threads x scratch (fixed by the head dims, under 1 MiB per thread at head_dim 128)
    + split partials: min(max_splits x T x Hq, 8 x threads x 256) rows of (Dv + 1) x 4 B (splits are
      made only when there are fewer than 4 work items per thread)
    + the output `[T, Hq, Dv]` (and LSE).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

from attn_core.contract.backend import AttentionBackend
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.context import dtype_name
from attn_core.contract.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    KVCacheError,
    UnsupportedFeatureError,
)
from attn_core.memory.pools import kv_scales
from attn_cpu_amx import isa as cpu_isa
from attn_cpu_amx.build import load_kernels
from attn_cpu_amx.spec import CAPABILITIES, MAX_HEAD_DIM


@dataclass
class _Metadata:
    """Host tables of one step (all CPU, contiguous)."""

    req_rows: torch.Tensor  # [bs] int64 rows of req_to_token
    seq_lens: torch.Tensor  # [bs] int32 keys per request (new tokens included)
    q_lens: torch.Tensor  # [bs] int32 new tokens per request
    q_starts: torch.Tensor  # [bs] int32 first q row of each request
    req_to_token: torch.Tensor
    num_tokens: int
    mask: Optional[torch.Tensor] = None  # flattened bool verify mask
    mask_indptr: Optional[torch.Tensor] = None  # [bs + 1] int64


class CpuAmxBackend(AttentionBackend[_Metadata]):
    """CPU attention on AMX / AVX-512 / portable kernels.

    Options: `isa` ("auto", "amx", "avx512", "portable"; default $ATTN_CPU_AMX_ISA or auto),
    `max_splits` (KV splits per work item, bounds the partial-output memory), `min_split_keys` (keys
    per split at least).
    """

    name = "cpu_amx"
    capabilities = CAPABILITIES

    def __init__(self, ctx, *, isa: Optional[str] = None, max_splits: int = 16, min_split_keys: int = 256, **options):
        # device, dtypes, head_dim, page size and arch: refused by the base class from CAPABILITIES
        super().__init__(ctx, **options)  # unknown options: InvalidArgumentError
        if ctx.v_head_dim % 16 or ctx.v_head_dim > MAX_HEAD_DIM:
            raise InvalidArgumentError("ctx.v_head_dim", f"a multiple of 16 up to {MAX_HEAD_DIM}", ctx.v_head_dim)
        if not isinstance(max_splits, int) or max_splits < 1:
            raise InvalidArgumentError("max_splits", "an int >= 1", max_splits)
        if not isinstance(min_split_keys, int) or min_split_keys < 1:
            raise InvalidArgumentError("min_split_keys", "an int >= 1", min_split_keys)
        path, reason = cpu_isa.choose_path(cpu_isa.requested_path(isa))
        if path is None:
            raise BackendUnavailableError(self.name, reason)
        self.path = path
        #: the kernels this backend's calls run (amx -> avx512 for float32 or head dims not multiple of 32)
        self.kernel_path = cpu_isa.kernel_path(
            path, dtype_name(ctx.dtype), dtype_name(ctx.kv_dtype), ctx.head_dim, ctx.v_head_dim
        )
        self._path_id = cpu_isa.PATH_IDS[self.kernel_path]
        self.max_splits = max_splits
        self.min_split_keys = min_split_keys
        #: (work items, KV-split groups, widest item in rows) of the last forward call (diagnostics)
        self.last_plan: tuple[int, int, int] = (0, 0, 0)
        self._ops = load_kernels()

    # ---- metadata --------------------------------------------------------------------------
    def build_forward_metadata(self, forward_batch: ForwardBatch) -> _Metadata:
        b = forward_batch
        r2t = self.req_to_token(b)
        kv_pool = self.kv_pool(b)
        if b.encoder_lens_cpu is not None and bool(b.encoder_lens_cpu.any()):
            raise UnsupportedFeatureError(self.name, "encoder-decoder batches (cross attention)")
        bs = b.batch_size
        seq_lens = b.seq_lens_cpu.to(torch.int32).contiguous()
        if b.forward_mode.is_decode():
            q_lens = torch.ones(bs, dtype=torch.int32)
            q_starts = torch.arange(bs, dtype=torch.int32)
        else:
            q_lens = b.extend_seq_lens_cpu.to(torch.int32).contiguous()
            q_starts = (torch.cumsum(q_lens, 0, dtype=torch.int32) - q_lens).contiguous()
        req_rows = b.req_pool_indices.to("cpu", torch.int64).contiguous()
        # lengths were validated by the base class; the C++ check guards every visible slot (any level)
        bad = self._ops.check_slots(r2t, req_rows, seq_lens, kv_pool.num_slots)
        if bad:
            raise KVCacheError(f"req_to_token: {bad}")
        meta = _Metadata(req_rows, seq_lens, q_lens, q_starts, r2t, b.num_tokens)
        spec = b.spec_info
        if b.forward_mode.is_target_verify() and spec is not None and spec.custom_mask is not None:
            meta.mask = spec.custom_mask.to("cpu", torch.bool).contiguous()
            meta.mask_indptr = spec.mask_indptr.to("cpu", torch.int64).contiguous()
            need = meta.mask_indptr[:bs] + q_lens.to(torch.int64) * seq_lens.to(torch.int64)
            if meta.mask_indptr.numel() < bs or bool((need > meta.mask.numel()).any()):
                raise InvalidArgumentError(
                    "spec_info.custom_mask", "one [q_len, seq_len] mask per request", meta.mask.numel()
                )
        return meta

    # ---- attention ---------------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **extras)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **extras)

    def _forward(self, q, k, v, layer, batch, save_kv_cache, sinks=None, return_lse=False):
        meta: _Metadata = self.forward_metadata
        if sinks is not None and (sinks.device.type != "cpu" or not sinks.dtype.is_floating_point):
            raise InvalidArgumentError("sinks", "a floating-point CPU tensor", (sinks.device, sinks.dtype))
        k_scale, v_scale = kv_scales(layer, self.kv_pool(batch))  # core's scale check (typed error), before any write
        pool = self.save_kv(k, v, layer, batch) if save_kv_cache else self.kv_pool(batch)
        T, hq = q.shape[0], layer.num_q_heads
        out = torch.empty((T, hq, layer.v_head_dim), dtype=q.dtype)
        lse = torch.empty((T, hq), dtype=torch.float32) if return_lse else None
        if T:
            self.last_plan = _typed_kernel_checks(
                self._ops.attention,
                q.contiguous(),
                pool.get_key_buffer(layer.layer_id),
                pool.get_value_buffer(layer.layer_id),
                out,
                lse,
                meta.req_to_token,
                meta.req_rows,
                meta.seq_lens,
                meta.q_lens,
                meta.q_starts,
                meta.mask,
                meta.mask_indptr,
                None if sinks is None else sinks.to(torch.float32).contiguous(),
                layer.scaling * k_scale,
                v_scale,
                layer.logit_cap,
                layer.sliding_window_size or 0,
                self._path_id,
                self.max_splits,
                self.min_split_keys,
            )
        o = out.view(T, hq * layer.v_head_dim)
        return (o, lse) if return_lse else o


_KERNEL_CHECK = re.compile(
    r"^(?P<argument>[^:]+): (?:expected (?P<expected>.*?)(?:, found (?P<found>.*))?|(?P<other>.*))$"
)


def _typed_kernel_checks(kernel, *args):
    """Call a C++ kernel; a check it refuses (TORCH_CHECK_VALUE: a ValueError "argument: expected ...")
    becomes an `InvalidArgumentError` naming the argument.

    Worked example: "req_rows: row out of range" -> InvalidArgumentError("req_rows", "a value the C++
    kernel accepts", "row out of range"); "q: expected contiguous heads" -> argument "q", expected
    "contiguous heads"."""
    try:
        return kernel(*args)
    except ValueError as exc:
        raise kernel_check_error(str(exc)) from exc


def kernel_check_error(message: str) -> InvalidArgumentError:
    """The `InvalidArgumentError` of one C++ check message (its first line; see `_typed_kernel_checks`)."""
    line = message.strip().splitlines()[0] if message.strip() else "no message"
    m = _KERNEL_CHECK.match(line)
    if m is None:
        return InvalidArgumentError("cpu_amx kernel arguments", "what the C++ kernel checks", line)
    if m["expected"] is not None:
        return InvalidArgumentError(m["argument"], m["expected"], m["found"] or "something else")
    return InvalidArgumentError(m["argument"], "a value the C++ kernel accepts", m["other"])
