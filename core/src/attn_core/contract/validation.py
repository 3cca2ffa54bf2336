"""The one batch validation of attn-core, run by `AttentionBackend.init_forward_metadata` for every
backend before its `build_forward_metadata` (so before any kernel and any KV write), plus the dtype
rule `forward` applies to q/k/v.

Levels (`BackendContext.validation`):

- "basic" (the default): every check that reads only Python numbers, tensor metadata (dtype, shape,
  device) and the batch's host copies (`seq_lens_cpu`, `extend_*_cpu`, `encoder_lens_cpu`). No device
  work and no host-device sync; a handful of small CPU reductions (measured cost: docs/performance.md).
  On an accelerator the device tensors are then checked on the device by the step check
  (`attn_core.ops.step_checks`, one launch, no sync; faults surface at the next step as
  `DeviceFaultError`).
- "full": "basic", then the device tensors too: one device-to-host copy of the batch's index tensors
  and of a few counts computed on the device (one sync per step, in `init_forward_metadata`, never in
  `forward`), and the backend's `poll_device_fault()`. Its device work gathers the batch's table rows up
  to the longest request (bs x max(seq_lens) entries, a few bytes each, freed at once). Tests and the
  conformance kit use it; an engine may turn it on to debug a crash or a wrong answer.
- On the CPU (the context's device), "basic" runs "full" (`effective_level`): the device tensors *are*
  host memory, there is no sync to avoid, so every batch gets every check before any write.

Accepted integer widths (one rule for every backend):

- indices (`req_pool_indices`, `out_cache_loc`, `encoder_out_cache_loc`, `spec_info.mask_indptr`):
  int32 or int64 (`positions` is the engine's, not read by attention, not checked);
- lengths and offsets on the device (`seq_lens`, `extend_seq_lens`, `extend_prefix_lens`,
  `extend_start_loc`, `encoder_lens`): int32 only (an int64 `seq_lens` is refused on every backend
  alike, never converted behind the engine's back);
- host copies (`*_cpu`): int32 or int64, on the CPU.

Rules ("basic" unless marked full):

- every field the mode needs is present: extend-like modes need `extend_seq_lens`, `extend_prefix_lens`,
  `extend_start_loc` (device), `extend_seq_lens_cpu`, `extend_prefix_lens_cpu` and `extend_num_tokens`;
  `encoder_lens` comes with `encoder_lens_cpu`;
- shapes: `[bs]` per request, `[num_tokens]` per token, `mask_indptr` `[bs + 1]`;
- lengths >= 0, DECODE `seq_lens` >= 1; `seq_lens_sum` == sum(`seq_lens_cpu`); extend-like modes:
  prefix + extend == `seq_lens` per request and the extend lengths sum to `extend_num_tokens`;
- encoder + decoder length <= the `req_to_token` width;
- TARGET_VERIFY with a custom mask: a flat bool mask of exactly sum(q_len * seq_len) entries;
- the KV pool's dtype and page size are the context's;
- full: every device tensor equals its host copy (`seq_lens`, extend lengths, encoder lengths),
  `extend_start_loc` and `mask_indptr` are the offsets the lengths imply, `req_pool_indices` lie in the
  table, `out_cache_loc` (and `encoder_out_cache_loc`) lie in [1, num_slots) (slot 0 is the reserved
  dummy) without duplicates, every new token's `out_cache_loc` is the slot `req_to_token` gives its
  position (a slot of another request or position is refused), and every key a request attends to has
  a slot in [1, num_slots) (a key the engine never wrote reads slot 0). (A row may appear twice, as
  decode context parallelism's local batches read one request at two lengths; each token still writes
  only its own position's slot, once.)
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from attn_core.contract.batch import ForwardBatch, SpecInfo, batch_field
from attn_core.contract.errors import InvalidArgumentError, InvalidBatchError

BASIC = "basic"
FULL = "full"
#: the accepted values of `BackendContext.validation`
VALIDATION_LEVELS = (BASIC, FULL)

_INDEX_DTYPES = (torch.int32, torch.int64)


def effective_level(ctx) -> str:
    """The level a step of a backend on `ctx` is validated at: "full" on a CPU device (no sync to
    avoid), the context's `validation` elsewhere. `effective_level(BackendContext(device="cpu", ...))`
    is "full" whatever `validation` says."""
    return FULL if ctx.device.type == "cpu" else ctx.validation


# the reductions of the host copies (ufunc.reduce skips the Python layers of ndarray.min/max/sum)
_MIN, _MAX, _SUM, _ANY = np.minimum.reduce, np.maximum.reduce, np.add.reduce, np.logical_or.reduce
#: batches of at most this many requests run per-step host loops as Python lists, not numpy calls
#: (`attn_core.ops.kv_indices.host_page_offsets`, whose loop writes into numpy, ~0.3 µs an entry)
SMALL_HOST_BATCH = 16
#: batches of at most this many requests get their host length statistics as a Python list
#: (`host_length_stats`: builtins only, ~40 ns an entry)
HOST_STATS_LIST_MAX = 512


def host_length_stats(lengths: torch.Tensor) -> tuple[int, int, int]:
    """(min, max, sum) of a host int32/int64 tensor `[bs]` (bs >= 1) as Python ints; the sum does not wrap.

    Per-step host time: up to `HOST_STATS_LIST_MAX` entries one `tolist()` and Python's min/max/sum, above
    that a numpy view and three `ufunc.reduce` calls. Alone in a loop the numpy calls are cheaper from ~64
    entries on (~3.5 µs against the list's ~10 µs at 256, H200 host); inside a graph step they were not:
    at bs 256 the list path made `CudaGraphRunner.run` 0.84 × as long as the numpy path (H200, 2026-11-29,
    docs/dev/perf-notebook.md "Host time of a graph step"), the numpy calls' cold code paths costing tens of µs
    between the step's other work. Example: `host_length_stats(torch.tensor([5, 2, 9]))` is `(2, 9, 16)`."""
    if lengths.shape[0] <= HOST_STATS_LIST_MAX:
        values = lengths.tolist()
        return min(values), max(values), sum(values)
    a = lengths.numpy()
    return int(_MIN(a)), int(_MAX(a)), int(_SUM(a, dtype=np.int64))


def check_forward_batch(
    b: ForwardBatch, req_to_token: torch.Tensor, kv_pool, ctx, level: str = BASIC, padding_seq_len: Optional[int] = None
) -> None:
    """Raise `InvalidBatchError` (naming the field) unless batch `b` follows the rules of the module
    docstring for a backend on `ctx.device` with this request table and KV pool. `level` "basic"
    costs no device sync; "full" costs one. `padding_seq_len` (CUDA-graph runs only): requests in row 0
    with that seq_len are graph padding rows (`graph_padding`, as a graph-shaped DCP step carries them),
    exempt from the duplicate-row and key checks (they read row 0), and any token whose slot is the
    dummy 0 may write it (padding rows, tokens another DCP rank stores): a write there harms nothing."""
    if not isinstance(b.batch_size, int) or b.batch_size < 0:
        raise InvalidBatchError("forward_batch.batch_size", "an int >= 0", b.batch_size)
    if b.forward_mode.is_no_tokens():
        return
    _check_pools(req_to_token, kv_pool, ctx)
    longest = _check_host(b, req_to_token.shape[1], ctx.device)
    if level == FULL:
        _check_device(b, req_to_token, kv_pool.num_slots, longest, padding_seq_len)


def check_forward_dtypes(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor], ctx) -> None:
    """q (and the new tokens' k/v when given) must be in the context's dtype: the KV pool holds
    `ctx.kv_dtype`, and a backend computes the (dtype, kv_dtype) pair the context declared (construction
    refused the pair unless the backend declares `Feature.MIXED_KV_DTYPE`)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x is not None and x.dtype != ctx.dtype:
            raise InvalidArgumentError(name, f"dtype {ctx.dtype} (the context's dtype)", x.dtype)


# ---- basic: tensor metadata and host copies -------------------------------------------------------
def check_kv_pool(kv_pool, ctx, where: str = "token_to_kv_pool") -> None:
    """Raise `InvalidArgumentError` unless the KV pool has the context's layout: its dtype, page size,
    head count and head dim, and its class (MLA pool for MLA). Run at construction on the context's
    pool and per step on the batch's."""
    if kv_pool.dtype != ctx.kv_dtype:
        raise InvalidArgumentError(f"{where}.dtype", f"the context's kv_dtype {ctx.kv_dtype}", kv_pool.dtype)
    if kv_pool.page_size != ctx.page_size:
        raise InvalidArgumentError(f"{where}.page_size", f"the context's page_size {ctx.page_size}", kv_pool.page_size)
    want = (1, ctx.head_dim) if ctx.is_mla else (ctx.num_kv_heads, ctx.head_dim)
    if (kv_pool.head_num, kv_pool.head_dim) != want:
        raise InvalidArgumentError(
            where, f"(heads, head_dim) = {want} as in the context", (kv_pool.head_num, kv_pool.head_dim)
        )
    if ctx.is_mla != hasattr(kv_pool, "kv_lora_rank"):
        raise InvalidArgumentError(
            where, "an MLATokenToKVPool for MLA, an MHATokenToKVPool otherwise", type(kv_pool).__name__
        )


def _check_pools(req_to_token: torch.Tensor, kv_pool, ctx) -> None:
    if req_to_token.device != ctx.device:
        raise InvalidBatchError("forward_batch.req_to_token_pool", f"a table on {ctx.device}", req_to_token.device)
    if kv_pool is not ctx.token_to_kv_pool:  # the context's was checked at construction
        check_kv_pool(kv_pool, ctx, "forward_batch.token_to_kv_pool")


def _device_tensor(
    name: str, x, shape: tuple[int, ...], device: torch.device, dtypes: tuple[torch.dtype, ...]
) -> torch.Tensor:
    # one expression for the valid case (per-step host time), the diagnosis only when it fails
    if isinstance(x, torch.Tensor) and x.dtype in dtypes and x.shape == shape and x.device == device:
        return x
    if not isinstance(x, torch.Tensor):
        raise InvalidBatchError(
            f"forward_batch.{name}", f"a tensor of shape {shape}", None if x is None else type(x).__name__
        )
    if x.dtype not in dtypes:
        raise InvalidBatchError(f"forward_batch.{name}", f"dtype in {[str(d) for d in dtypes]}", x.dtype)
    if tuple(x.shape) != shape:
        raise InvalidBatchError(f"forward_batch.{name}", f"shape {shape}", tuple(x.shape))
    if x.device != device:
        raise InvalidBatchError(f"forward_batch.{name}", f"a tensor on {device}", x.device)
    return x


def _host_tensor(name: str, x, bs: int) -> torch.Tensor:
    if isinstance(x, torch.Tensor) and x.dtype in _INDEX_DTYPES and x.shape == (bs,) and x.is_cpu:
        return x
    if not isinstance(x, torch.Tensor):
        raise InvalidBatchError(
            f"forward_batch.{name}", f"a CPU tensor of shape ({bs},)", None if x is None else type(x).__name__
        )
    if x.dtype not in _INDEX_DTYPES or tuple(x.shape) != (bs,) or x.device.type != "cpu":
        found = (x.dtype, tuple(x.shape), x.device)
        raise InvalidBatchError(f"forward_batch.{name}", f"an int32/int64 CPU tensor of shape ({bs},)", found)
    return x


def _check_host(b: ForwardBatch, width: int, device: torch.device) -> int:
    """The "basic" rules; returns the longest encoder + decoder length of the batch (0 when empty)."""
    bs = b.batch_size
    per_req = (bs,)
    mode = b.forward_mode
    decode = mode.is_decode()
    _device_tensor("req_pool_indices", b.req_pool_indices, per_req, device, _INDEX_DTYPES)
    _device_tensor("seq_lens", b.seq_lens, per_req, device, (torch.int32,))
    seq = _host_tensor("seq_lens_cpu", b.seq_lens_cpu, bs)
    if decode:
        T = bs
    else:
        n_new = b.extend_num_tokens
        if not isinstance(n_new, int) or n_new < 0:
            raise InvalidBatchError("forward_batch.extend_num_tokens", f"an int >= 0 for {mode.name}", n_new)
        T = n_new
    _device_tensor("out_cache_loc", b.out_cache_loc, (T,), device, _INDEX_DTYPES)
    if not isinstance(b.seq_lens_sum, int):
        raise InvalidBatchError("forward_batch.seq_lens_sum", "an int", type(b.seq_lens_sum).__name__)

    enc = None
    if b.encoder_lens is not None or b.encoder_lens_cpu is not None:
        _device_tensor("encoder_lens", b.encoder_lens, per_req, device, (torch.int32,))
        enc = _host_tensor("encoder_lens_cpu", b.encoder_lens_cpu, bs)
    if b.encoder_out_cache_loc is not None:
        n = b.encoder_out_cache_loc.shape[0] if b.encoder_out_cache_loc.dim() == 1 else -1
        _device_tensor("encoder_out_cache_loc", b.encoder_out_cache_loc, (n,), device, _INDEX_DTYPES)

    if decode:
        q_lens = prefix = None
    else:
        for name in ("extend_seq_lens", "extend_prefix_lens", "extend_start_loc"):
            _device_tensor(name, getattr(b, name), per_req, device, (torch.int32,))
        q_lens = _host_tensor("extend_seq_lens_cpu", b.extend_seq_lens_cpu, bs)
        prefix = _host_tensor("extend_prefix_lens_cpu", b.extend_prefix_lens_cpu, bs)

    if bs == 0:
        if b.seq_lens_sum != 0 or T != 0:
            raise InvalidBatchError("forward_batch.seq_lens_sum", "0 tokens for an empty batch", (b.seq_lens_sum, T))
        return 0

    # the lengths: min / max / sum of the host copy (`host_length_stats`: a list for small batches, numpy
    # reductions above, no int32 wrap-around); the other host copies by numpy reductions
    lo, hi, total = host_length_stats(seq)
    if lo < (1 if decode else 0):
        raise InvalidBatchError("forward_batch.seq_lens_cpu", f"lengths >= {1 if decode else 0} for {mode.name}", lo)
    if total != b.seq_lens_sum:
        raise InvalidBatchError("forward_batch.seq_lens_sum", f"sum(seq_lens_cpu) = {total}", b.seq_lens_sum)
    longest = hi
    if enc is not None or q_lens is not None:
        seq_np = seq.numpy()
    if enc is not None:
        enc_np = enc.numpy()
        if int(_MIN(enc_np)) < 0:
            raise InvalidBatchError("forward_batch.encoder_lens_cpu", "lengths >= 0", int(_MIN(enc_np)))
        longest = int(_MAX(seq_np.astype(np.int64) + enc_np))
    if longest > width:
        raise InvalidBatchError(
            "forward_batch.seq_lens", f"encoder + decoder lengths <= the req_to_token width {width}", longest
        )
    if q_lens is not None and prefix is not None:
        q_np, prefix_np = q_lens.numpy(), prefix.numpy()
        if int(_MIN(q_np)) < 0 or int(_MIN(prefix_np)) < 0:
            found = (q_lens.tolist(), prefix.tolist())
            raise InvalidBatchError("forward_batch.extend_seq_lens_cpu", "extend and prefix lengths >= 0", found)
        # seq - extend (not extend + prefix): both >= 0 here, so no int32 wrap-around
        if _ANY(seq_np - q_np != prefix_np):
            lens = (q_lens.tolist(), prefix.tolist(), seq.tolist())
            raise InvalidBatchError(
                "forward_batch.extend_seq_lens_cpu", "prefix + extend lengths == seq_lens per request", lens
            )
        q_total = int(_SUM(q_np, dtype=np.int64))
        if q_total != T:
            raise InvalidBatchError(
                "forward_batch.extend_seq_lens_cpu", f"lengths summing to extend_num_tokens = {T}", q_total
            )
    spec = b.spec_info
    if mode.is_target_verify() and spec is not None and spec.custom_mask is not None and q_lens is not None:
        _check_verify_mask(spec, spec.custom_mask, bs, seq, q_lens, device)
    return longest


def _check_verify_mask(
    spec: SpecInfo, mask: torch.Tensor, bs: int, seq: torch.Tensor, q_lens: torch.Tensor, device: torch.device
) -> None:
    want = int((q_lens.to(torch.int64) * seq).sum())
    if mask.dtype != torch.bool or mask.dim() != 1 or mask.device != device:
        found = (mask.dtype, tuple(mask.shape), mask.device)
        raise InvalidBatchError("forward_batch.spec_info.custom_mask", f"a flat bool tensor on {device}", found)
    if mask.numel() != want:
        raise InvalidBatchError(
            "forward_batch.spec_info.custom_mask", f"{want} entries (sum of q_len * seq_len)", mask.numel()
        )
    _device_tensor("spec_info.mask_indptr", spec.mask_indptr, (bs + 1,), device, _INDEX_DTYPES)


# ---- full: the device tensors (one sync) ----------------------------------------------------------
def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """[0, x0, x0+x1, ...] (len(x) + 1 entries), int64. Example: [2, 0, 3] -> [0, 2, 2, 5]."""
    out = torch.zeros(x.numel() + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(x.to(torch.int64), 0, out=out[1:])
    return out


def _check_device(
    b: ForwardBatch, r2t: torch.Tensor, num_slots: int, longest: int, padding_seq_len: Optional[int] = None
) -> None:
    """One device-to-host copy of the batch's index tensors and of two counts computed on the device
    (keys reading a slot outside [1, num_slots); new tokens whose slot is not the table's), then host
    comparisons against the batch's host copies (checked by `_check_host`; `longest` is what it
    returned). Every device gather clamps its indices, so a bad batch cannot make this read out of
    bounds."""
    bs, T, dev = b.batch_size, b.out_cache_loc.shape[0], r2t.device
    if bs == 0:
        return
    rows = r2t.shape[0]
    width = max(longest, 1)  # columns any request attends to (<= the table width, checked)
    i64 = torch.int64
    rpi = b.req_pool_indices.to(i64)
    seq = b.seq_lens.to(i64)
    enc = b.encoder_lens.to(i64) if b.encoder_lens is not None else torch.zeros_like(seq)
    decode = b.forward_mode.is_decode()
    q_lens = torch.ones_like(seq) if decode else batch_field(b.extend_seq_lens, "extend_seq_lens").to(i64)
    q_host = None if decode else batch_field(b.extend_seq_lens_cpu, "extend_seq_lens_cpu").to(i64)
    table = r2t[:, :width][rpi.clamp(0, rows - 1)]  # [bs, width]
    pad = torch.zeros_like(rpi, dtype=torch.bool) if padding_seq_len is None else (rpi == 0) & (seq == padding_seq_len)
    # keys each request attends to: columns [0, enc + seq) of its row (graph padding rows: none checked)
    cols = torch.arange(width, device=dev)
    visible = (cols[None, :] < (enc + seq)[:, None]) & ~pad[:, None]
    bad_keys = (visible & ((table < 1) | (table >= num_slots))).sum()
    # new token t of request r (its i-th) sits at column enc + seq - q_len + i
    t = torch.arange(T, device=dev)
    if q_host is None:  # DECODE, one token each: token r is request r's
        req, first = t, t
    else:  # the host copy gives the token count of each request (checked to sum to T): no sync
        req = torch.repeat_interleave(torch.arange(bs, device=dev), q_host.to(dev), output_size=T)
        first = (torch.cumsum(q_host, 0) - q_host).to(dev)[req]
    col = ((enc + seq - q_lens)[req] + t - first).clamp(0, width - 1)
    loc = b.out_cache_loc.to(i64)
    pad_tok = (loc == 0) & (padding_seq_len is not None)  # graph runs: a token may write the dummy slot
    foreign = ((table[req, col].to(i64) != loc) & ~pad_tok).sum()
    parts = [rpi, seq, loc, bad_keys[None], foreign[None], pad_tok.to(i64)]
    if b.encoder_lens is not None:
        parts.append(enc)
    if q_host is not None:
        prefix_lens = batch_field(b.extend_prefix_lens, "extend_prefix_lens")
        parts += [q_lens, prefix_lens.to(i64), batch_field(b.extend_start_loc, "extend_start_loc").to(i64)]
    enc_loc = b.encoder_out_cache_loc
    if enc_loc is not None:
        parts.append(enc_loc.to(i64))
    spec = b.spec_info
    has_mask = b.forward_mode.is_target_verify() and spec is not None and spec.custom_mask is not None
    mask_indptr = spec.mask_indptr if has_mask and spec is not None else None
    if mask_indptr is not None:
        parts.append(mask_indptr.to(i64))
    flat = torch.cat(parts).cpu()  # the one sync

    def take(n: int) -> torch.Tensor:
        nonlocal flat
        head, flat = flat[:n], flat[n:]
        return head

    rpi_h, seq_h, loc_h, (bad_keys_h, foreign_h) = take(bs), take(bs), take(T), take(2).tolist()
    pad_tok_h = take(T).bool()  # graph runs: tokens writing the dummy slot (exempt from the slot checks)
    if int(rpi_h.min()) < 0 or int(rpi_h.max()) >= rows:
        raise InvalidBatchError("forward_batch.req_pool_indices", f"rows in [0, {rows})", _quote(rpi_h.tolist()))
    _same("seq_lens", seq_h, b.seq_lens_cpu)
    if b.encoder_lens is not None:
        _same("encoder_lens", take(bs), batch_field(b.encoder_lens_cpu, "encoder_lens_cpu"))
    if q_host is not None:
        _same("extend_seq_lens", take(bs), q_host)
        _same("extend_prefix_lens", take(bs), batch_field(b.extend_prefix_lens_cpu, "extend_prefix_lens_cpu"))
        _same("extend_start_loc", take(bs), _exclusive_cumsum(q_host)[:-1])
    _check_slots("out_cache_loc", loc_h[~pad_tok_h], num_slots)
    if enc_loc is not None:
        _check_slots("encoder_out_cache_loc", take(enc_loc.shape[0]), num_slots)
    if mask_indptr is not None and q_host is not None:
        _same("spec_info.mask_indptr", take(bs + 1), _exclusive_cumsum(q_host * b.seq_lens_cpu))
    if bad_keys_h:
        expected = f"a slot in [1, {num_slots}) for every key the batch attends to"
        raise InvalidBatchError("forward_batch.req_to_token_pool", expected, f"{bad_keys_h} keys without one")
    if foreign_h:
        expected = "for every new token the slot req_to_token holds at its position"
        raise InvalidBatchError("forward_batch.out_cache_loc", expected, f"{foreign_h} tokens with another slot")


def _quote(values: list, limit: int = 16) -> str:
    """A list for an error message, cut after `limit` entries. Example: _quote([1, 2, 3], 2) is "[1, 2, ...]"."""
    if len(values) <= limit:
        return str(values)
    return str(values[:limit])[:-1] + ", ...]"


def _same(name: str, device_copy: torch.Tensor, host_copy: torch.Tensor) -> None:
    if not torch.equal(device_copy, host_copy.to(torch.int64)):
        same_shape = device_copy.shape == host_copy.shape
        bad = int((device_copy != host_copy.to(torch.int64)).nonzero()[0]) if same_shape else None
        where = "" if bad is None else f" (first differing request {bad})"
        expected = f"the values of its host copy {_quote(host_copy.tolist())}{where}"
        raise InvalidBatchError(f"forward_batch.{name}", expected, _quote(device_copy.tolist()))


def _check_slots(name: str, slots: torch.Tensor, num_slots: int) -> None:
    if slots.numel() == 0:
        return
    lo, hi = (int(x) for x in torch.aminmax(slots))
    if lo < 1 or hi >= num_slots:
        raise InvalidBatchError(
            f"forward_batch.{name}", f"slots in [1, {num_slots}) (slot 0 is the reserved dummy)", (lo, hi)
        )
    if torch.unique(slots).numel() != slots.numel():
        raise InvalidBatchError(f"forward_batch.{name}", "distinct slots (one per new token)", "a slot used twice")
