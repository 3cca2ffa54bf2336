"""`build_step`: one forward step of running requests, from how many new tokens each runs.

The engine says, per request, how many new tokens it runs this step (a prefill chunk, one decode
token, or its draft tokens); `build_step` allocates exactly those tokens' slots (`RequestPool.extend`:
page-aware, all or nothing), writes them into the requests' rows and returns a `ForwardBatch` with
every field derived: lengths (host and device), offsets, `out_cache_loc`, positions and the mode.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from attn_core.batching.positions import extend_start_loc_from_lens, positions_from_lens
from attn_core.contract.backend import AttentionBackend
from attn_core.contract.batch import ForwardBatch, SpecInfo
from attn_core.contract.capabilities import Feature
from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.engine.requests import Request, RequestPool, token_count

#: the modes `build_step` builds; the plain three are inferred, the speculative two are asked for.
STEP_MODES = (
    ForwardMode.DECODE,
    ForwardMode.MIXED,
    ForwardMode.EXTEND,
    ForwardMode.TARGET_VERIFY,
    ForwardMode.DRAFT_EXTEND,
)


def step_mode(prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> ForwardMode:
    """The mode of a step whose request r runs extend_lens[r] new tokens after prefix_lens[r] cached
    ones: DECODE when every request runs one token after cached ones, MIXED when such decodes share the
    step with prefill chunks, EXTEND otherwise (prefills and chunks only).

    Worked example: ([7, 3], [1, 1]) -> DECODE; ([7, 0], [1, 5]) -> MIXED; ([0, 16], [5, 16]) -> EXTEND;
    ([0], [1]) -> EXTEND (a one-token prompt is a prefill: nothing is cached).
    """
    decode = [p > 0 and e == 1 for p, e in zip(prefix_lens, extend_lens)]
    if all(decode):
        return ForwardMode.DECODE
    return ForwardMode.MIXED if any(decode) else ForwardMode.EXTEND


def chain_verify_mask(prefix_len: int, num_draft: int) -> torch.Tensor:
    """bool `[num_draft, prefix_len + num_draft]`: the verify mask of a draft chain (topk 1), where draft
    token i sees the prefix and draft tokens 0..i.

    Worked example: chain_verify_mask(1, 2) -> [[True, True, False], [True, True, True]].
    """
    mask = torch.ones(num_draft, prefix_len + num_draft, dtype=torch.bool)
    mask[:, prefix_len:] = torch.ones(num_draft, num_draft, dtype=torch.bool).tril()
    return mask


def build_step(
    requests: RequestPool,
    work: Sequence[tuple[Request, int]],
    *,
    mode: Union[ForwardMode, str, None] = None,
    custom_masks: Optional[Sequence[torch.Tensor]] = None,
    attn_backend: Optional[AttentionBackend] = None,
) -> ForwardBatch:
    """The batch of one step: `work` lists `(request, new_tokens)` in the order the engine lays out
    q/k/v (request after request). Allocates the new tokens' slots and advances each request's kv_len.

    `mode` None infers DECODE / MIXED / EXTEND (`step_mode`); TARGET_VERIFY (the same number of draft
    tokens for every request; `custom_masks`, one bool `[n, kv_len + n]` per request, default
    `chain_verify_mask`) and DRAFT_EXTEND are asked for. A chain of drafts needs no mask: with
    `custom_masks` None and an `attn_backend` that does not declare `Feature.CUSTOM_MASK`, the batch
    carries none (`spec_info.custom_mask` None: causal over prefix and drafts, the same keys the chain mask
    gives), so such a backend can verify chains. Raises `InvalidArgumentError` for bad work
    (nothing allocated) and `KVCacheError` when slots run out (nothing changes).

    The batch remembers its requests as they are now (`batch.request_guard`): once one of them is freed,
    truncated, forked or given another step, `init_forward_metadata` refuses the batch
    (`StaleRequestError`). New token counts must be integers >= 1 (`InvalidArgumentError` naming
    `work[i] new_tokens`; 2.5 is refused, not run as 2).

    Worked example: requests A (kv_len 5) and B (new), work [(A, 1), (B, 3)] -> MIXED, seq_lens [6, 3],
    extend_prefix_lens [5, 0], extend_seq_lens [1, 3], extend_start_loc [0, 1], positions [5, 0, 1, 2].
    """
    reqs = [r for r, _ in work]
    if not reqs:
        raise InvalidArgumentError("work", "at least one (request, new_tokens) pair", 0)
    counts = [token_count(f"work[{i}] new_tokens", n, minimum=1) for i, (_, n) in enumerate(work)]
    for i, r in enumerate(reqs):
        requests.check_live(r, f"work[{i}]")
    if len({id(r) for r in reqs}) != len(reqs):
        raise InvalidArgumentError("work", "each request at most once", [r.rid for r in reqs][:16])
    prefix = [r.kv_len for r in reqs]
    mode = step_mode(prefix, counts) if mode is None else ForwardMode.parse(mode)
    if mode not in STEP_MODES:
        raise InvalidArgumentError("mode", f"one of {[m.name for m in STEP_MODES]}", mode.name)
    if mode.is_decode() and set(counts) != {1}:
        raise InvalidArgumentError("work", "new_tokens == 1 for every DECODE request", counts)
    masks, chain_without_mask = None, False
    if mode.is_target_verify():
        if len(set(counts)) != 1:
            raise InvalidArgumentError(
                "work", "the same number of draft tokens for every TARGET_VERIFY request", counts
            )
        takes_masks = attn_backend is None or attn_backend.capabilities.supports(Feature.CUSTOM_MASK)
        chain_without_mask = custom_masks is None and not takes_masks  # causal over prefix and drafts
        if not chain_without_mask:
            masks = _verify_masks(prefix, counts[0], custom_masks)

    out_cache_loc = requests.extend(reqs, counts)
    device = requests.req_to_token_pool.device
    bs, total = len(reqs), sum(counts)
    lens_cpu = torch.tensor([prefix, counts], dtype=torch.int32)
    seq_lens_cpu = lens_cpu.sum(0, dtype=torch.int32)
    lens = torch.cat([lens_cpu, seq_lens_cpu[None]]).to(device)
    batch = ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        req_pool_indices=torch.tensor([r.row for r in reqs], dtype=torch.int64).to(device),
        seq_lens=lens[2],
        seq_lens_cpu=seq_lens_cpu,
        seq_lens_sum=int(seq_lens_cpu.sum()),
        out_cache_loc=out_cache_loc.to(device),
        positions=positions_from_lens(lens[0], lens[1], total),
        req_to_token_pool=requests.req_to_token_pool,
        token_to_kv_pool=requests.token_to_kv_pool,
        attn_backend=attn_backend,
        request_guard=requests.guard(reqs),
    )
    if mode.is_extend():
        batch.extend_prefix_lens, batch.extend_prefix_lens_cpu = lens[0], lens_cpu[0]
        batch.extend_seq_lens, batch.extend_seq_lens_cpu = lens[1], lens_cpu[1]
        batch.extend_start_loc = extend_start_loc_from_lens(lens[1])
        batch.extend_num_tokens = total
    if chain_without_mask:
        batch.spec_info = SpecInfo(num_draft_tokens=counts[0])
    elif masks is not None:
        indptr = torch.zeros(bs + 1, dtype=torch.int64)
        indptr[1:] = torch.tensor([m.numel() for m in masks]).cumsum(0)
        batch.spec_info = SpecInfo(
            num_draft_tokens=counts[0],
            custom_mask=torch.cat([m.reshape(-1) for m in masks]).to(device),
            mask_indptr=indptr.to(device),
        )
    return batch


def _verify_masks(prefix: list[int], n: int, custom_masks) -> list[torch.Tensor]:
    if custom_masks is None:
        return [chain_verify_mask(p, n) for p in prefix]
    if len(custom_masks) != len(prefix):
        raise InvalidArgumentError("custom_masks", f"one mask per request ({len(prefix)})", len(custom_masks))
    for i, (m, p) in enumerate(zip(custom_masks, prefix)):
        if tuple(m.shape) != (n, p + n) or m.dtype != torch.bool:
            raise InvalidArgumentError(f"custom_masks[{i}]", f"bool of shape {(n, p + n)}", (tuple(m.shape), m.dtype))
    return [m.cpu() for m in custom_masks]
