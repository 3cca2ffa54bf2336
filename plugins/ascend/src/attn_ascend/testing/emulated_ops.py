"""The torch_npu attention operators attn-ascend calls, written in plain torch from their documentation.

Nothing here runs on an NPU or was checked against one: every function follows the documented
contract (shapes, layouts, mask modes, block tables, host-side lengths) as read from

- [FIA-6.0] Ascend Extension for PyTorch 6.0.0, `torch_npu.npu_fused_infer_attention_score`
  (hiascend.com/document/detail/zh/Pytorch/600/apiref/apilist/ptaoplist_000837.html): keyword
  `scale_value`, no `query_rope` / `key_rope`.
- [FIA-7.0] Ascend Extension for PyTorch 7.0.0, same operator
  (hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/ptaoplist_001232.html): keyword `scale`,
  `query_rope` / `key_rope` for MLA.
- [FA-sparse] `torch_npu.npu_fusion_attention` (same releases, ptaoplist_000850): the `sparse_mode`
  table (0 defaultMask, 1 allMask, 2 leftUpCausal, 3 rightDownCausal, 4 band) and the compressed
  2048x2048 mask those modes take; TND lengths are cumulative ("2 2 2 2 2" is passed as 2 4 6 8 10).
- [ATB-PA] CANN 8.2.RC1 ATB PagedAttention (hiascend.com/document/detail/zh/CANNCommunityEdition/82RC1/
  API/ascendtbapi/ascendtb_01_0206.html), behind `torch_npu._npu_paged_attention` and its MLA variant:
  query `[num_tokens, num_head, head_size]`, block tables int32 `[num_tokens, max_blocks]` on the
  device, context lengths int32 `[batch]` on the host.
- `torch_npu._npu_reshape_and_cache` (ATB ReshapeAndCache): key/value `[T, H, D]` into caches
  `[num_blocks, block_size, H, D]` at int32 slot ids `[T]`.

Where the documents leave a case open, the emulation picks the strict reading and raises
`EmulatedOpError` (an input the operator may reject must not pass silently here), and says so below:
block sizes (multiples of 16; at most 128 for the paged-attention operators, at most 512 for the
fused-infer operator), host-side context lengths, contiguous queries, int32 index tensors, the
compressed mask's exact pattern. A query row that sees no key gets output 0 (and LSE +inf), the
documented behaviour of fully masked rows.

Arithmetic: scores and softmax in float32 (the operators accumulate in float32), output cast to the
query's dtype. `reference64` in the tests is the independent float64 oracle.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Optional, Sequence

import torch

#: side of the compressed causal mask the causal and band sparse modes take [FA-sparse]
COMPRESSED_MASK_SIZE = 2048
#: largest block the paged-attention operators take (and the block granularity of every paged op)
PAGED_ATTENTION_MAX_BLOCK = 128
FIA_MAX_BLOCK = 512
BLOCK_ALIGN = 16
_BIG = 2147483647


class EmulatedOpError(RuntimeError):
    """An input the documented operator does not accept (the NPU would raise or misbehave)."""


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise EmulatedOpError(msg)


def compressed_causal_mask(device=None) -> torch.Tensor:
    """The mask sparse modes 2, 3 and 4 take: bool `[2048, 2048]`, True (masked) strictly above the
    diagonal. Example: its top-left 3x3 corner is [[F, T, T], [F, F, T], [F, F, F]]."""
    n = COMPRESSED_MASK_SIZE
    return torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)


#: id -> (weak reference, version) of masks already found to be the compressed causal mask
_checked_masks: dict[int, tuple[weakref.ref, int]] = {}


def _check_compressed_mask(mask: Optional[torch.Tensor], mode: int) -> None:
    _need(mask is not None, f"sparse_mode={mode} needs atten_mask, the compressed 2048x2048 causal mask")
    _need(
        tuple(mask.shape) == (COMPRESSED_MASK_SIZE,) * 2,
        f"sparse_mode={mode} takes a 2048x2048 atten_mask, got {tuple(mask.shape)}",
    )
    seen = _checked_masks.get(id(mask))
    if seen is not None and seen[0]() is mask and seen[1] == mask._version:
        return  # this very tensor, unchanged since it was checked
    want = compressed_causal_mask(mask.device)
    _need(
        torch.equal(mask.to(torch.bool), want),
        f"sparse_mode={mode}: atten_mask is not the compressed causal mask (True above the diagonal)",
    )
    _checked_masks[id(mask)] = (weakref.ref(mask), mask._version)


def _check_block(block_size: int, limit: int, what: str) -> None:
    _need(
        0 < block_size <= limit and block_size % BLOCK_ALIGN == 0,
        f"{what}: block size must be a multiple of {BLOCK_ALIGN} in [{BLOCK_ALIGN}, {limit}], got {block_size}",
    )


def _check_int32(name: str, x: torch.Tensor) -> None:
    _need(x.dtype == torch.int32, f"{name} must be int32, got {x.dtype}")


def _visible(
    sq: int, skv: int, mode: int, pre_tokens: int, next_tokens: int, mask: Optional[torch.Tensor]
) -> torch.Tensor:
    """Bool `[sq, skv]`: may query i see key j, for one batch entry [FA-sparse].

    0 (defaultMask): `mask` (True = masked) when given, and the band i - pre_tokens <= j <= i + next_tokens;
    1 (allMask): `mask` alone; 2 (leftUpCausal): j <= i; 3 (rightDownCausal): j <= i + skv - sq;
    4 (band): i + skv - sq - pre_tokens <= j <= i + skv - sq + next_tokens.
    Example: sq=2, skv=4, mode 3 -> [[T, T, T, F], [T, T, T, T]]."""
    i = torch.arange(sq)[:, None]
    j = torch.arange(skv)[None, :]
    if mode in (0, 1):
        ok = torch.ones(sq, skv, dtype=torch.bool)
        if mode == 0:
            ok &= (j >= i - pre_tokens) & (j <= i + next_tokens)
        if mask is not None:
            ok &= ~mask.to(torch.bool).cpu()[:sq, :skv]
        else:
            _need(mode == 0, "sparse_mode=1 (allMask) needs atten_mask")
        return ok
    if mode == 2:
        return j <= i
    if mode == 3:
        return j <= i + (skv - sq)
    if mode == 4:
        d = i + (skv - sq)
        return (j >= d - pre_tokens) & (j <= d + next_tokens)
    raise EmulatedOpError(f"sparse_mode={mode} is not emulated (modes 0-4 are)")


def _attend(q, k, v, visible, scale, q_rope=None, k_rope=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[Sq, N, D]`, k `[Skv, Nkv, D]`, v `[Skv, Nkv, Dv]`, visible `[Sq, Skv]` -> out float32
    `[Sq, N, Dv]`, lse float32 `[Sq, N]` (rows without a visible key: out 0, lse +inf)."""
    n, nkv = q.shape[1], k.shape[1]
    _need(n % nkv == 0, f"num_heads {n} must be a multiple of num_key_value_heads {nkv}")
    g = n // nkv
    qf = q.float().transpose(0, 1)  # [N, Sq, D]
    kf = k.float().transpose(0, 1).repeat_interleave(g, 0)
    vf = v.float().transpose(0, 1).repeat_interleave(g, 0)
    s = qf @ kf.transpose(1, 2)
    if q_rope is not None:
        s = s + q_rope.float().transpose(0, 1) @ k_rope.float().transpose(0, 1).repeat_interleave(g, 0).transpose(1, 2)
    s = s * scale
    vis = visible.to(s.device)[None]
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, -1)  # [N, Sq]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = p @ vf
    lse = torch.where(vis.any(-1), lse, torch.full_like(lse, float("inf")))
    return out.transpose(0, 1), lse.transpose(0, 1)


def _gather_pages(cache: torch.Tensor, table_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Rows 0..length-1 of one sequence from a paged cache `[blocks, block_size, ...]`."""
    n = -(-length // block_size)
    pages = table_row[:n].long().cpu()
    _need(
        bool(((pages >= 0) & (pages < cache.shape[0])).all()),
        f"block table entries out of range [0, {cache.shape[0]}): {pages.tolist()}",
    )
    return cache[pages.to(cache.device)].reshape(n * block_size, *cache.shape[2:])[:length]


def _check_host_lengths(name: str, x, batch: int) -> list[int]:
    if isinstance(x, torch.Tensor):
        _need(x.device.type == "cpu", f"{name} must be a host (CPU) tensor, got one on {x.device}")
        _check_int32(name, x)
        x = x.tolist()
    x = [int(v) for v in x]
    _need(len(x) == batch, f"{name} must have {batch} entries, got {len(x)}")
    _need(all(v >= 0 for v in x), f"{name} must be non-negative, got {x}")
    return x


# ---- ATB ReshapeAndCache ---------------------------------------------------------------------------
def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices) -> None:
    """Write token t's key/value `[T, H, D]` / `[T, H, Dv]` into row `slot_indices[t]` of the paged
    caches `[num_blocks, block_size, H, D]` (slot = block * block_size + offset); int32 slot ids.
    In place; returns None. Example: slot 37 with block_size 16 is block 2, offset 5."""
    _check_int32("slot_indices", slot_indices)
    _need(key.dim() == 3 and value.dim() == 3, "key and value must be [T, H, D]")
    for name, x, cache in (("key", key, key_cache), ("value", value, value_cache)):
        _need(cache.dim() == 4, f"{name}_cache must be [num_blocks, block_size, H, D], got {tuple(cache.shape)}")
        _need(
            tuple(x.shape[1:]) == tuple(cache.shape[2:]),
            f"{name} {tuple(x.shape)} does not match {name}_cache {tuple(cache.shape)}",
        )
        _need(x.dtype == cache.dtype, f"{name} dtype {x.dtype} != {name}_cache dtype {cache.dtype}")
        _need(x.shape[0] == slot_indices.shape[0], f"{name} has {x.shape[0]} rows for {slot_indices.shape[0]} slots")
    slots = slot_indices.long()
    limit = key_cache.shape[0] * key_cache.shape[1]
    _need(bool(((slots >= 0) & (slots < limit)).all()), f"slot_indices out of range [0, {limit})")
    key_cache.flatten(0, 1)[slots] = key
    value_cache.flatten(0, 1)[slots] = value


# ---- ATB PagedAttention -----------------------------------------------------------------------------
def _paged(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table, context_lens, out, v_dim):
    _need(query.is_contiguous(), "query must be contiguous")
    _need(
        query.dim() == 3 and query.shape[1] == num_heads,
        f"query must be [num_tokens, {num_heads}, D], got {tuple(query.shape)}",
    )
    _need(
        key_cache.dim() == 4 and key_cache.shape[2] == num_kv_heads,
        f"key_cache must be [blocks, block_size, {num_kv_heads}, D]",
    )
    _check_block(key_cache.shape[1], PAGED_ATTENTION_MAX_BLOCK, "paged attention")
    _check_int32("block_table", block_table)
    t = query.shape[0]
    _need(
        block_table.dim() == 2 and block_table.shape[0] == t,
        f"block_table must be [{t}, max_blocks], got {tuple(block_table.shape)}",
    )
    lens = _check_host_lengths("context_lens", context_lens, t)
    _need(tuple(out.shape) == (t, num_heads, v_dim), f"out must be [{t}, {num_heads}, {v_dim}], got {tuple(out.shape)}")
    bs = key_cache.shape[1]
    _need(
        all(-(-n // bs) <= block_table.shape[1] for n in lens),
        "a context length needs more blocks than block_table has columns",
    )
    for i, n in enumerate(lens):
        k = _gather_pages(key_cache, block_table[i], n, bs)
        v = _gather_pages(value_cache, block_table[i], n, bs)[..., :v_dim]
        o, _ = _attend(query[i : i + 1], k, v, torch.ones(1, n, dtype=torch.bool), scale_value)
        out[i] = o[0].to(out.dtype)


def _npu_paged_attention(
    *, query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table, context_lens, out
) -> None:
    """Decode attention [ATB-PA]: query token i `[num_tokens, num_heads, D]` attends to the first
    `context_lens[i]` tokens of its paged K/V (`[num_blocks, block_size, num_kv_heads, D]`, page ids in
    `block_table[i]`), GQA by head groups, softmax(scale_value * q.k) v written to `out`
    `[num_tokens, num_heads, Dv]`. context_lens int32 on the host."""
    _paged(
        query,
        key_cache,
        value_cache,
        num_kv_heads,
        num_heads,
        scale_value,
        block_table,
        context_lens,
        out,
        value_cache.shape[-1],
    )


def _npu_paged_attention_mla(
    *, query, key_cache, num_kv_heads, num_heads, scale_value, block_table, context_lens, mla_vheadsize, out
) -> None:
    """MLA decode [ATB-PA, "mla" case]: one cache `[num_blocks, block_size, num_kv_heads, kv_lora_rank +
    rope]` serves as key (all channels) and value (its first `mla_vheadsize` channels); query
    `[num_tokens, num_heads, kv_lora_rank + rope]`, `out` `[num_tokens, num_heads, mla_vheadsize]`."""
    _need(
        0 < mla_vheadsize <= key_cache.shape[-1], f"mla_vheadsize {mla_vheadsize} must be in (0, {key_cache.shape[-1]}]"
    )
    _paged(
        query, key_cache, key_cache, num_kv_heads, num_heads, scale_value, block_table, context_lens, out, mla_vheadsize
    )


# ---- FusedInferAttentionScore ------------------------------------------------------------------------
def _split_query(query, layout: str, num_heads: int, actual_q):
    """Per batch entry: the query rows `[Sq, N, D]` and how to write its output back."""
    if layout == "TND":
        _need(
            query.dim() == 3 and query.shape[1] == num_heads,
            f"TND query must be [T, {num_heads}, D], got {tuple(query.shape)}",
        )
        _need(actual_q is not None, "input_layout TND needs actual_seq_lengths (cumulative query lengths)")
        ends = [int(v) for v in actual_q]
        _need(len(ends) > 0, "TND actual_seq_lengths must name at least one sequence")
        _need(
            all(b >= a for a, b in zip([0] + ends, ends)),
            f"TND actual_seq_lengths must be cumulative (non-decreasing), got {ends}",
        )
        _need(ends[-1] == query.shape[0], f"TND actual_seq_lengths must end at T={query.shape[0]}, got {ends[-1]}")
        return [(query[a:b], (a, b)) for a, b in zip([0] + ends[:-1], ends)]
    if layout == "BSH":
        _need(query.dim() == 3 and query.shape[2] % num_heads == 0, "BSH query must be [B, S, num_heads * D]")
        query = query.view(query.shape[0], query.shape[1], num_heads, -1)
    elif layout == "BNSD":
        _need(query.dim() == 4 and query.shape[1] == num_heads, f"BNSD query must be [B, {num_heads}, S, D]")
        query = query.transpose(1, 2)
    elif layout == "BSND":
        _need(query.dim() == 4 and query.shape[2] == num_heads, f"BSND query must be [B, S, {num_heads}, D]")
    else:
        raise EmulatedOpError(f"input_layout {layout!r} is not emulated (TND, BSH, BSND, BNSD are)")
    b, s = query.shape[0], query.shape[1]
    lens = [s] * b if actual_q is None else [int(v) for v in actual_q]
    _need(
        len(lens) == b and all(0 <= n <= s for n in lens),
        f"actual_seq_lengths must be {b} lengths <= S={s}, got {lens}",
    )
    return [(query[i, : lens[i]], (i, lens[i])) for i in range(b)]


def _kv_for(i, key, value, key_rope, layout, num_kv, paged, block_table, block_size, kv_lens, dense_bounds):
    """Key, value (and key rope) rows `[Skv, Nkv, D]` of batch entry i."""
    if paged:
        n = kv_lens[i]
        k = _gather_pages(key, block_table[i], n, block_size)
        v = _gather_pages(value, block_table[i], n, block_size)
        kr = None if key_rope is None else _gather_pages(key_rope, block_table[i], n, block_size)
        heads = [None if x is None else x.reshape(n, num_kv, x.shape[-1] // num_kv) for x in (k, v, kr)]
        return heads[0], heads[1], heads[2]
    if layout == "TND":
        a, b = dense_bounds[i]
        return key[a:b], value[a:b], None if key_rope is None else key_rope[a:b]

    def rows(x):
        if x is None:
            return None
        if layout == "BSH":
            x = x.view(x.shape[0], x.shape[1], num_kv, -1)
        elif layout == "BNSD":
            x = x.transpose(1, 2)
        n = x.shape[1] if kv_lens is None else kv_lens[i]
        return x[i, :n]

    return rows(key), rows(value), rows(key_rope)


def _fia(
    query,
    key,
    value,
    *,
    scale,
    atten_mask=None,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    block_table=None,
    num_heads=1,
    pre_tokens=_BIG,
    next_tokens=_BIG,
    input_layout="BSH",
    num_key_value_heads=0,
    sparse_mode=0,
    inner_precise=0,
    block_size=0,
    softmax_lse_flag=False,
    query_rope=None,
    key_rope=None,
    antiquant_mode=0,
    antiquant_scale=None,
):
    _need(antiquant_scale is None, "antiquant (int8 KV) is not emulated")
    _need(query.is_contiguous(), "query must be contiguous")
    _need(query.dtype in (torch.float16, torch.bfloat16), f"query dtype must be float16 or bfloat16, got {query.dtype}")
    _need(key.dtype == query.dtype and value.dtype == query.dtype, "key/value dtype must match the query's")
    num_kv = num_key_value_heads or num_heads
    _need((query_rope is None) == (key_rope is None), "query_rope and key_rope come together")
    parts = _split_query(query, input_layout, num_heads, actual_seq_lengths)
    rope_parts = (
        None
        if query_rope is None
        else _split_query(query_rope.contiguous(), input_layout, num_heads, actual_seq_lengths)
    )
    batch = len(parts)
    paged = block_table is not None
    dense_bounds = None
    kv_lens = None
    if paged:
        _check_int32("block_table", block_table)
        _need(block_table.dim() == 2 and block_table.shape[0] == batch, f"block_table must be [{batch}, max_blocks]")
        _check_block(block_size, FIA_MAX_BLOCK, "fused infer attention (paged)")
        _need(
            key.dim() == 3 and key.shape[1] == block_size,
            f"paged key must be [blocks, {block_size}, num_kv_heads * D], got {tuple(key.shape)}",
        )
        _need(actual_seq_lengths_kv is not None, "paged KV needs actual_seq_lengths_kv (per-sequence lengths)")
        kv_lens = _check_host_lengths("actual_seq_lengths_kv", actual_seq_lengths_kv, batch)
        _need(
            all(-(-n // block_size) <= block_table.shape[1] for n in kv_lens),
            "a KV length needs more blocks than block_table has",
        )
    elif input_layout == "TND":
        _need(
            actual_seq_lengths_kv is not None, "input_layout TND needs actual_seq_lengths_kv (cumulative key lengths)"
        )
        ends = [int(v) for v in actual_seq_lengths_kv]
        _need(
            len(ends) == batch and ends[-1] == key.shape[0],
            "TND actual_seq_lengths_kv must be cumulative and end at the key rows",
        )
        dense_bounds = list(zip([0] + ends[:-1], ends))
    elif actual_seq_lengths_kv is not None:
        kv_lens = [int(v) for v in actual_seq_lengths_kv]
    if sparse_mode in (2, 3, 4):
        _check_compressed_mask(atten_mask, sparse_mode)
    dv = None
    outs = []
    for i, (q, where) in enumerate(parts):
        k, v, kr = _kv_for(
            i, key, value, key_rope, input_layout, num_kv, paged, block_table, block_size, kv_lens, dense_bounds
        )
        mask = None
        if sparse_mode in (0, 1) and atten_mask is not None:
            mask = (
                atten_mask
                if atten_mask.dim() == 2
                else atten_mask.reshape(-1, *atten_mask.shape[-2:])[i if atten_mask.shape[0] > 1 else 0]
            )
        vis = _visible(q.shape[0], k.shape[0], sparse_mode, pre_tokens, next_tokens, mask)
        o, lse = _attend(q, k, v, vis, scale, None if rope_parts is None else rope_parts[i][0], kr)
        dv = o.shape[-1]
        outs.append((o, lse, where))
    return _assemble(query, input_layout, num_heads, dv if dv is not None else value.shape[-1], outs, softmax_lse_flag)


def _assemble(query, layout, num_heads, dv, outs, with_lse):
    """Outputs in the query's layout (TND `[T, N, Dv]`, BSND `[B, S, N, Dv]`, BSH `[B, S, N*Dv]`,
    BNSD `[B, N, S, Dv]`) and LSE float32 (`[T, N, 1]` for TND, `[B, N, S, 1]` otherwise; empty when
    softmax_lse_flag is False). Rows past a sequence's actual length are 0."""
    if layout == "TND":
        out = torch.zeros(query.shape[0], num_heads, dv, dtype=query.dtype, device=query.device)
        lse = torch.full((query.shape[0], num_heads, 1), float("inf"), device=query.device)
        for o, ls, (a, b) in outs:
            out[a:b], lse[a:b, :, 0] = o.to(out.dtype), ls
    else:
        b = query.shape[0]
        s = query.shape[2] if layout == "BNSD" else query.shape[1]
        out = torch.zeros(b, s, num_heads, dv, dtype=query.dtype, device=query.device)
        lse = torch.full((b, num_heads, s, 1), float("inf"), device=query.device)
        for o, ls, (i, n) in outs:
            out[i, :n], lse[i, :, :n, 0] = o.to(out.dtype), ls.transpose(0, 1)
        out = {"BSND": out, "BSH": out.reshape(b, s, num_heads * dv), "BNSD": out.transpose(1, 2).contiguous()}[layout]
    return out, (lse if with_lse else torch.empty(0, device=query.device))


def _copy_out(result, out: Sequence[torch.Tensor]) -> None:
    o, lse = result
    _need(len(out) == 2, "out must be [attention_out, softmax_lse]")
    _need(
        tuple(out[0].shape) == tuple(o.shape) or out[0].numel() == o.numel(),
        f"out[0] has shape {tuple(out[0].shape)}, expected {tuple(o.shape)}",
    )
    out[0].view(o.shape).copy_(o)
    if lse.numel() and out[1].numel() == lse.numel():
        out[1].view(lse.shape).copy_(lse)


def make_fused_infer_attention_score(scale_keyword: str = "scale", rope: bool = True):
    """The operator as one release documents it: `scale_keyword` "scale" and `rope` True follow
    [FIA-7.0]; "scale_value" and False follow [FIA-6.0]. The function has the `.out` variant
    (`out=[attention_out, softmax_lse]`, `workspace=` from `_npu_fused_infer_attention_score_get_max_workspace`)
    as an attribute, as torch_npu's op packet does; both return / fill (attention_out, softmax_lse)."""

    def call(query, key, value, **kw):
        if scale_keyword not in kw and ("scale" in kw or "scale_value" in kw):
            raise TypeError(
                f"npu_fused_infer_attention_score() got an unexpected keyword (this release names it {scale_keyword!r})"
            )
        if not rope and ("query_rope" in kw or "key_rope" in kw):
            raise TypeError(
                "npu_fused_infer_attention_score() got an unexpected keyword 'query_rope' (not in this release)"
            )
        kw["scale"] = kw.pop(scale_keyword, 1.0)
        return _fia(query, key, value, **kw)

    def out_variant(query, key, value, *, workspace=None, out, **kw):
        _copy_out(call(query, key, value, **kw), out)
        return out

    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ("query", "key", "value")]
    keywords = [
        "atten_mask",
        "actual_seq_lengths",
        "actual_seq_lengths_kv",
        "block_table",
        "num_heads",
        scale_keyword,
        "pre_tokens",
        "next_tokens",
        "input_layout",
        "num_key_value_heads",
        "sparse_mode",
        "inner_precise",
        "block_size",
        "softmax_lse_flag",
        "antiquant_mode",
        "antiquant_scale",
    ] + (["query_rope", "key_rope"] if rope else [])
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in keywords]
    call.__signature__ = inspect.Signature(params)
    call.__name__ = "npu_fused_infer_attention_score"
    call.out = out_variant
    return call


def _npu_fused_infer_attention_score_get_max_workspace(query, key, value, **kw) -> torch.Tensor:
    """The workspace the `.out` variant takes (its size is the NPU's business; here an empty byte tensor)."""
    return torch.empty(0, dtype=torch.uint8, device=query.device)
