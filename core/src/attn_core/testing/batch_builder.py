"""A test fixture: one self-contained `ForwardBatch` from request shapes, with fresh request rows and
slots for the prefix too (as if cached by earlier steps; their K/V is whatever the pool holds), released
whole by `release_forward_batch`. Used by tests, the conformance kit and benchmarks.

Engines do not use it (it cannot continue a request): they keep `attn_core.RequestPool` handles across
steps and build each step with `attn_core.build_step` (see docs/engine-authors.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from attn_core.batching.positions import extend_start_loc_from_lens, positions_from_lens
from attn_core.contract.batch import ForwardBatch, SpecInfo, batch_field
from attn_core.contract.errors import InvalidArgumentError, KVCacheError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.memory.pools import check_pool_matches


@dataclass(frozen=True)
class RequestShape:
    """One request of a step: `prefix_len` tokens already cached, `extend_len` new tokens,
    `encoder_len` encoder tokens (encoder-decoder models only)."""

    prefix_len: int
    extend_len: int
    encoder_len: int = 0


RequestLike = Union[RequestShape, Sequence[int]]


def _shapes(requests: Sequence[RequestLike]) -> list[RequestShape]:
    out = [r if isinstance(r, RequestShape) else RequestShape(*r) for r in requests]
    for i, r in enumerate(out):
        if r.prefix_len < 0 or r.extend_len < 0 or r.encoder_len < 0:
            raise InvalidArgumentError(f"requests[{i}]", "non-negative prefix, extend and encoder lengths", r)
    return out


def _check_mode(mode: ForwardMode, reqs: list[RequestShape]) -> None:
    if mode.is_no_tokens():
        if reqs:
            raise InvalidArgumentError("requests", f"no requests for {mode.name}", len(reqs))
        return
    if not reqs:
        raise InvalidArgumentError("requests", f"at least one request for {mode.name}", 0)
    if mode.is_decode() and any(r.extend_len != 1 for r in reqs):
        raise InvalidArgumentError("requests", "extend_len == 1 for every DECODE request", [r.extend_len for r in reqs])
    if mode.is_target_verify():
        lens = {r.extend_len for r in reqs}
        if len(lens) != 1 or 0 in lens:
            raise InvalidArgumentError(
                "requests", "the same extend_len (draft tokens) >= 1 for every TARGET_VERIFY request", sorted(lens)
            )


def random_tree_mask(prefix_len: int, num_draft: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """A verify mask `[num_draft, prefix_len + num_draft]` for a random draft tree: every draft token
    sees the whole prefix, itself and its ancestors (token i's parent is a random earlier token or
    the prefix)."""
    mask = torch.zeros(num_draft, prefix_len + num_draft, dtype=torch.bool)
    mask[:, :prefix_len] = True
    for i in range(num_draft):
        parent = int(torch.randint(-1, i, (1,), generator=generator)) if i else -1
        if parent >= 0:
            mask[i, prefix_len:] = mask[parent, prefix_len:]
        mask[i, prefix_len + i] = True
    return mask


def build_forward_batch(
    mode: Union[ForwardMode, str],
    requests: Sequence[RequestLike],
    *,
    req_to_token_pool,
    allocator,
    token_to_kv_pool=None,
    custom_masks: Optional[Sequence[torch.Tensor]] = None,
    generator: Optional[torch.Generator] = None,
    attn_backend=None,
) -> ForwardBatch:
    """Allocate and describe one step of `requests`, each `(prefix_len, extend_len[, encoder_len])`.

    The prefix (and encoder) tokens get slots too, as if cached by earlier steps; their KV contents are
    whatever the pool holds. TARGET_VERIFY batches get `custom_masks` (one `[extend_len, seq_len]` bool
    per request) or random tree masks. Raises `KVCacheError` (allocating nothing) when rows or slots run
    out. Release with `release_forward_batch`.
    """
    mode = ForwardMode.parse(mode)
    reqs = _shapes(requests)
    _check_mode(mode, reqs)
    if token_to_kv_pool is not None:
        check_pool_matches(token_to_kv_pool, allocator)
    device = req_to_token_pool.device
    bs = len(reqs)
    max_len = req_to_token_pool.max_context_len
    for i, r in enumerate(reqs):
        if r.encoder_len + r.prefix_len + r.extend_len > max_len:
            raise InvalidArgumentError(f"requests[{i}]", f"encoder + prefix + extend <= max_context_len={max_len}", r)

    masks = _verify_masks(reqs, custom_masks, generator) if mode.is_target_verify() else None

    rows = req_to_token_pool.alloc(bs)
    if rows is None:
        raise KVCacheError(f"out of request rows: need {bs}, {req_to_token_pool.available_size()} free")
    cached_lens = [r.encoder_len + r.prefix_len for r in reqs]
    total_lens = [c + r.extend_len for c, r in zip(cached_lens, reqs)]
    cached = allocator.alloc_extend([0] * bs, cached_lens, [0] * bs)
    new = None
    if cached is not None:
        cached_cpu = cached.cpu()
        ends = torch.tensor(cached_lens).cumsum(0)
        last_loc = [int(cached_cpu[e - 1]) if c else 0 for e, c in zip(ends.tolist(), cached_lens)]
        new = allocator.alloc_extend(cached_lens, total_lens, last_loc)
        if new is None:
            allocator.free(cached)
    if new is None:
        req_to_token_pool.free(rows)
        raise KVCacheError(
            f"out of KV slots: need {sum(total_lens)} tokens (page_size {allocator.page_size}), "
            f"{allocator.available_size()} slots free"
        )

    new_cpu = new.cpu()
    c_off = n_off = 0
    enc_out: list[torch.Tensor] = []
    for row, r, c in zip(rows, reqs, cached_lens):
        req_to_token_pool.write(row, 0, cached_cpu[c_off : c_off + c])
        req_to_token_pool.write(row, c, new_cpu[n_off : n_off + r.extend_len])
        if r.prefix_len == 0 and r.encoder_len:
            enc_out.append(cached_cpu[c_off : c_off + r.encoder_len])
        c_off += c
        n_off += r.extend_len

    def dev(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    seq_lens_cpu = torch.tensor([r.prefix_len + r.extend_len for r in reqs], dtype=torch.int32)
    prefix = dev([r.prefix_len for r in reqs], torch.int32)
    extend = dev([r.extend_len for r in reqs], torch.int32)
    num_tokens = sum(r.extend_len for r in reqs)
    batch = ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        req_pool_indices=dev(rows, torch.int64),
        seq_lens=seq_lens_cpu.to(device),
        seq_lens_cpu=seq_lens_cpu,
        seq_lens_sum=int(seq_lens_cpu.sum()),
        out_cache_loc=new.to(device),
        positions=positions_from_lens(prefix, extend, num_tokens),
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool=token_to_kv_pool,
        attn_backend=attn_backend,
    )
    if mode.is_extend():
        batch.extend_prefix_lens = prefix
        batch.extend_prefix_lens_cpu = prefix.cpu()
        batch.extend_seq_lens = extend
        batch.extend_seq_lens_cpu = extend.cpu()
        batch.extend_start_loc = extend_start_loc_from_lens(extend)
        batch.extend_num_tokens = num_tokens
    if any(r.encoder_len for r in reqs):
        batch.encoder_lens_cpu = torch.tensor([r.encoder_len for r in reqs], dtype=torch.int32)
        batch.encoder_lens = batch.encoder_lens_cpu.to(device)
        batch.encoder_out_cache_loc = (torch.cat(enc_out) if enc_out else torch.empty(0, dtype=torch.int64)).to(device)
    if masks is not None:
        sizes = torch.tensor([m.numel() for m in masks], dtype=torch.int64)
        indptr = torch.zeros(bs + 1, dtype=torch.int64)
        indptr[1:] = sizes.cumsum(0)
        batch.spec_info = SpecInfo(
            num_draft_tokens=reqs[0].extend_len,
            custom_mask=torch.cat([m.reshape(-1) for m in masks]).to(device),
            mask_indptr=indptr.to(device),
        )
    return batch


def _verify_masks(reqs, custom_masks, generator) -> list[torch.Tensor]:
    """The given verify masks, checked, or random tree masks."""
    num_draft = reqs[0].extend_len
    if custom_masks is None:
        custom_masks = [random_tree_mask(r.prefix_len, num_draft, generator) for r in reqs]
    if len(custom_masks) != len(reqs):
        raise InvalidArgumentError("custom_masks", f"one mask per request ({len(reqs)})", len(custom_masks))
    for i, (m, r) in enumerate(zip(custom_masks, reqs)):
        want = (num_draft, r.prefix_len + num_draft)
        if tuple(m.shape) != want or m.dtype != torch.bool:
            raise InvalidArgumentError(f"custom_masks[{i}]", f"bool of shape {want}", (tuple(m.shape), m.dtype))
    return [m.cpu() for m in custom_masks]


def release_forward_batch(batch: ForwardBatch, allocator) -> None:
    """Free the request rows and every KV slot (encoder, prefix and new) of the batch's requests."""
    if batch.batch_size == 0:
        return
    pool = batch_field(batch.req_to_token_pool, "req_to_token_pool")
    rows = batch.req_pool_indices.cpu()
    lens = batch.seq_lens_cpu.clone()
    if batch.encoder_lens_cpu is not None:
        lens += batch.encoder_lens_cpu
    slots = [pool.req_to_token[int(r), : int(n)].cpu() for r, n in zip(rows, lens)]
    allocator.free(torch.cat(slots).to(torch.int64))
    pool.free(rows.tolist())
