"""AITER's attention operators (the four attn-aiter calls) in plain torch, from their documentation.

Nothing here ran on an AMD GPU or was compared with AITER: every function follows the documented
contract (arguments, shapes, index layouts, masks) as read from

- [PA] `aiter.paged_attention_ragged` (ROCm/aiter `op_tests/test_pa_ragged.py`, `csrc/include/
  attention_ragged.h`): decode over a paged cache addressed by CSR page lists - `kv_indptr` `[bs + 1]`
  (page offsets), `kv_page_indices` (page ids), `kv_last_page_lens` `[bs]` (tokens in each last page,
  1..block_size); caches "NHD" `[blocks, block_size, Hkv, D]` or "HND" `[blocks, Hkv, block_size, D]`;
  the sequence is cut into partitions of `partition_size` (256) tokens, `max_num_partitions` of them
  at most, and a byte `workspace_buffer` holds the partial outputs (`[bs, H, partitions, D]` in the
  output dtype) and two float32 `[bs, H, partitions]` statistics; `partition_size % block_size == 0`.
- [VARLEN] `aiter.flash_attn_varlen_func` (aiter/ops/mha.py; the AITER README and `op_tests/test_mla.py`):
  FlashAttention-2's ragged API - q `[total_q, H, D]`, k `[total_k, Hkv, D]`, v `[total_k, Hkv, Dv]`,
  int32 `cu_seqlens_q` / `cu_seqlens_k` `[b + 1]`, `max_seqlen_q` / `max_seqlen_k` bounds; `causal`
  aligns the mask to the bottom right (query i of a sequence with Lq queries and Lk keys sees keys
  j <= i + Lk - Lq, the reference in test_mla.py: `tril(diagonal=s_k - s_q)`).
- [MLA] `aiter.mla.mla_decode_fwd` / `mla_prefill_fwd` (aiter/mla.py; AMD's "MLA decoding kernel of the
  AITER library" tutorial; `op_tests/test_mla.py`): q `[total_q, H, kv_lora_rank + rope]`, `kv_buffer`
  viewed 4-D `[pages, page_size, nhead_kv, kv_lora_rank + rope]`, `o` `[total_q, H, Dv]` whose Dv first
  channels of the latent are the value; CSR `qo_indptr`, `kv_indptr` / `kv_indices` (page ids) and
  `kv_last_page_lens`, `max_seqlen_q`; causal from the bottom right (`torch_mla_extend`). Two forms of
  `mla_decode_fwd` exist: with `page_size, nhead_kv` after `max_seqlen_q` (current) and without
  (earlier releases); `sm_scale` is therefore passed by keyword. `logit_cap` > 0 is refused
  ("not support yet"). The decode kernel serves 1..4 queries per sequence (test_mla.py: "decode_qlen
  = 1, 2, 3, 4"); the absorbed prefill kernel is "limited to q extend < 160" (AITER README), read here
  as at most 159 queries per sequence; both serve 16..128 query heads in multiples of 16 (the
  tested "nhead16, nhead128" and SGLang's head padding).

Where the documents leave a case open, the emulation takes the strict reading and raises
`EmulatedOpError` (an input the kernel may reject must not pass silently here): int32 index tensors,
`k_scale` / `v_scale` of 1 with kv_cache_dtype "auto", every sequence with at least one key and no more
queries than keys, the head counts above. Arithmetic: scores and softmax in float32, output cast to
the output tensor's dtype. The tests' float64 reference is written independently.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from attn_core.ops.masked_values import masked_pv

#: tokens per partition of the ROCm paged-attention kernel [PA]
PARTITION_SIZE = 256
#: queries per sequence the MLA decode kernel serves [MLA]
MLA_DECODE_MAX_Q = 4
#: queries per sequence the absorbed MLA prefill kernel serves ("q extend < 160") [MLA]
MLA_PREFILL_MAX_Q = 159
#: query-head counts the MLA kernels serve: multiples of 16 up to 128 [MLA]
MLA_HEADS = frozenset(range(16, 129, 16))


class EmulatedOpError(RuntimeError):
    """An input the documented operator does not accept (the GPU would raise or misbehave)."""


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise EmulatedOpError(msg)


def _int32(name: str, x: torch.Tensor, length: Optional[int] = None) -> list[int]:
    _need(
        isinstance(x, torch.Tensor) and x.dtype == torch.int32,
        f"{name} must be an int32 tensor, got {getattr(x, 'dtype', x)}",
    )
    _need(x.dim() == 1, f"{name} must be 1-D, got {tuple(x.shape)}")
    if length is not None:
        _need(x.shape[0] == length, f"{name} must have {length} entries, got {x.shape[0]}")
    return [int(v) for v in x.tolist()]


def _indptr(name: str, x: torch.Tensor) -> list[int]:
    ptr = _int32(name, x)
    _need(len(ptr) >= 2 and ptr[0] == 0, f"{name} must start at 0 and have bs + 1 >= 2 entries, got {ptr}")
    _need(all(b >= a for a, b in zip(ptr, ptr[1:])), f"{name} must be non-decreasing, got {ptr}")
    return ptr


def attend(q, k, v, visible, scale: float, logit_cap: float = 0.0) -> torch.Tensor:
    """q `[Sq, H, D]`, k `[Sk, Hkv, D]`, v `[Sk, Hkv, Dv]`, visible bool `[Sq, Sk]` -> float32 `[Sq, H, Dv]`
    (GQA: query head h reads KV head h // (H / Hkv); a row without a visible key is 0)."""
    h, hkv = q.shape[1], k.shape[1]
    _need(h % hkv == 0, f"query heads {h} must be a multiple of KV heads {hkv}")
    g = h // hkv
    qf = q.float().transpose(0, 1)
    kf = k.float().transpose(0, 1).repeat_interleave(g, 0)
    vf = v.float().transpose(0, 1).repeat_interleave(g, 0)
    s = (qf @ kf.transpose(1, 2)) * scale
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    s = s.masked_fill(~visible[None], float("-inf"))
    return masked_pv(torch.softmax(s, -1), vf, visible).transpose(0, 1)


def bottom_right_causal(sq: int, sk: int) -> torch.Tensor:
    """bool `[sq, sk]`: query i sees key j iff j <= i + sk - sq. Example: (2, 3) -> [[T, T, F], [T, T, T]]."""
    return torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)


def _pages_to_tokens(cache_tokens: torch.Tensor, pages: list[int], length: int, block: int) -> torch.Tensor:
    """Rows 0..length-1 of a sequence whose pages are `pages`, from a token-major cache `[blocks, block, ...]`."""
    _need(
        all(0 <= p < cache_tokens.shape[0] for p in pages),
        f"page ids out of range [0, {cache_tokens.shape[0]}): {pages}",
    )
    idx = torch.tensor(pages, dtype=torch.long, device=cache_tokens.device)
    return cache_tokens[idx].reshape(len(pages) * block, *cache_tokens.shape[2:])[:length]


def _csr_lengths(indptr: list[int], last: list[int], block: int) -> list[int]:
    """Tokens of each sequence from its page count and last-page fill."""
    lens = []
    for b, n in enumerate(last):
        pages = indptr[b + 1] - indptr[b]
        _need(pages >= 1, f"sequence {b} has no page (every sequence needs a key)")
        _need(1 <= n <= block, f"kv_last_page_lens[{b}] = {n} must be in [1, {block}]")
        lens.append((pages - 1) * block + n)
    return lens


def pa_workspace_bytes(
    num_seqs: int, num_heads: int, max_num_partitions: int, head_size: int, out_itemsize: int
) -> int:
    """Bytes [PA]'s workspace holds: partial outputs in the output dtype plus two float32 statistics."""
    cells = num_seqs * num_heads * max_num_partitions
    return cells * head_size * out_itemsize + 2 * cells * 4


# ---- [PA] paged_attention_ragged ----------------------------------------------------------------------
def paged_attention_ragged(
    out,
    workspace_buffer,
    query,
    key_cache,
    value_cache,
    scale,
    kv_indptr,
    kv_page_indices,
    kv_last_page_lens,
    block_size,
    max_num_partitions,
    alibi_slopes,
    kv_cache_dtype,
    kv_cache_layout,
    logits_soft_cap,
    k_scale,
    v_scale,
    fp8_out_scale,
    partition_size=PARTITION_SIZE,
) -> None:
    """Decode [PA]: query row b `[num_seqs, H, D]` attends to the keys of its pages
    `kv_page_indices[kv_indptr[b]:kv_indptr[b + 1]]` (the last one filled to `kv_last_page_lens[b]`);
    softmax(scale * q.k) v written to `out` `[num_seqs, H, D]`. Returns None."""
    _need(alibi_slopes is None and fp8_out_scale is None, "alibi slopes and fp8 output are not emulated")
    _need(kv_cache_dtype == "auto", f"kv_cache_dtype {kv_cache_dtype!r} is not emulated ('auto' is)")
    _need(
        query.dim() == 3 and query.is_contiguous(),
        f"query must be a contiguous [num_seqs, H, D], got {tuple(query.shape)}",
    )
    bs, h, d = query.shape
    _need(kv_cache_layout in ("NHD", "HND"), f"kv_cache_layout must be 'NHD' or 'HND', got {kv_cache_layout!r}")
    if kv_cache_layout == "HND":
        key_cache, value_cache = key_cache.transpose(1, 2), value_cache.transpose(1, 2)
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        _need(
            c.dim() == 4 and c.shape[1] == block_size and c.shape[3] == d,
            f"{name} must be {kv_cache_layout} with block {block_size}, D {d}",
        )
        _need(c.dtype == query.dtype, f"{name} dtype {c.dtype} != query dtype {query.dtype}")
    _need(
        partition_size % block_size == 0,
        f"partition_size {partition_size} must be a multiple of block_size {block_size}",
    )
    _need(
        tuple(out.shape) == (bs, h, d) and out.dtype == query.dtype,
        f"out must be {(bs, h, d)} {query.dtype}, got {tuple(out.shape)}",
    )
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        _need(
            isinstance(s, torch.Tensor) and s.dtype == torch.float32 and s.numel() == 1,
            f"{name} must be a float32 tensor of one value",
        )
        _need(float(s) == 1.0, f"{name} must be 1 with kv_cache_dtype 'auto' (scales apply to fp8 caches)")
    ptr = _indptr("kv_indptr", kv_indptr)
    _need(len(ptr) == bs + 1, f"kv_indptr must have num_seqs + 1 = {bs + 1} entries, got {len(ptr)}")
    pages = _int32("kv_page_indices", kv_page_indices)
    _need(len(pages) >= ptr[-1], f"kv_page_indices has {len(pages)} entries for {ptr[-1]} pages")
    lens = _csr_lengths(ptr, _int32("kv_last_page_lens", kv_last_page_lens, bs), block_size)
    _need(
        max_num_partitions >= math.ceil(max(lens) / partition_size),
        f"max_num_partitions {max_num_partitions} < the longest sequence's",
    )
    need = pa_workspace_bytes(bs, h, max_num_partitions, d, out.element_size())
    have = workspace_buffer.numel() * workspace_buffer.element_size()
    _need(have >= need, f"workspace_buffer holds {have} bytes, needs {need}")
    for b in range(bs):
        k = _pages_to_tokens(key_cache, pages[ptr[b] : ptr[b + 1]], lens[b], block_size)
        v = _pages_to_tokens(value_cache, pages[ptr[b] : ptr[b + 1]], lens[b], block_size)
        o = attend(
            query[b : b + 1], k, v, torch.ones(1, lens[b], dtype=torch.bool, device=k.device), scale, logits_soft_cap
        )
        out[b] = o[0].to(out.dtype)


# ---- [VARLEN] flash_attn_varlen_func -------------------------------------------------------------------
def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    bias=None,
    alibi_slopes=None,
    deterministic=False,
    return_lse=False,
    return_attn_probs=False,
    block_table=None,
):
    """Ragged attention [VARLEN]: sequence b's queries `q[cu_q[b]:cu_q[b+1]]` over its keys
    `k[cu_k[b]:cu_k[b+1]]`, causal from the bottom right when `causal`. Returns out `[total_q, H, Dv]`
    in q's dtype (`return_lse` is not emulated: attn-aiter does not ask for it)."""
    _need(
        dropout_p == 0.0 and bias is None and alibi_slopes is None and block_table is None,
        "dropout, bias, alibi, block_table not emulated",
    )
    _need(tuple(window_size) == (-1, -1), f"window_size {window_size} is not emulated ((-1, -1) is)")
    _need(not return_attn_probs and not return_lse, "return_lse / return_attn_probs are not emulated")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _need(x.dim() == 3, f"{name} must be [tokens, heads, dim], got {tuple(x.shape)}")
        _need(
            x.dtype in (torch.float16, torch.bfloat16) and x.dtype == q.dtype,
            f"{name} must be fp16/bf16 like q, got {x.dtype}",
        )
    _need(
        k.shape[0] == v.shape[0] and k.shape[1] == v.shape[1] and k.shape[2] == q.shape[2],
        "k/v rows, heads or head dim disagree",
    )
    cq, ck = _indptr("cu_seqlens_q", cu_seqlens_q), _indptr("cu_seqlens_k", cu_seqlens_k)
    _need(len(cq) == len(ck), f"cu_seqlens_q and cu_seqlens_k name {len(cq) - 1} and {len(ck) - 1} sequences")
    _need(
        cq[-1] == q.shape[0] and ck[-1] == k.shape[0],
        f"cu_seqlens end at {cq[-1]}/{ck[-1]}, tensors have {q.shape[0]}/{k.shape[0]} rows",
    )
    qlens = [b - a for a, b in zip(cq, cq[1:])]
    klens = [b - a for a, b in zip(ck, ck[1:])]
    _need(
        max_seqlen_q >= max(qlens) and max_seqlen_k >= max(klens),
        "max_seqlen_q / max_seqlen_k below a sequence's length",
    )
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    for b, (lq, lk) in enumerate(zip(qlens, klens)):
        if lq == 0:
            continue
        vis = bottom_right_causal(lq, lk) if causal else torch.ones(lq, lk, dtype=torch.bool)
        o = attend(q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]], vis.to(q.device), scale)
        out[cq[b] : cq[b + 1]] = o.to(q.dtype)
    return out


# ---- [MLA] mla_decode_fwd / mla_prefill_fwd ------------------------------------------------------------
def _mla(
    q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, sm_scale, logit_cap, max_q, what
):
    _need(logit_cap <= 0, f"{what}: logit_cap={logit_cap} is not supported")
    _need(
        kv_buffer.dim() == 4,
        f"{what}: kv_buffer must be viewed 4-D [pages, page_size, nhead_kv, D], got {tuple(kv_buffer.shape)}",
    )
    _, page, nkv, dq = kv_buffer.shape
    _need(nkv == 1, f"{what}: nhead_kv must be 1, got {nkv}")
    _need(q.dim() == 3 and q.shape[2] == dq, f"{what}: q must be [total_q, H, {dq}], got {tuple(q.shape)}")
    _need(
        q.dtype in (torch.float16, torch.bfloat16) and kv_buffer.dtype == q.dtype,
        f"{what}: q and kv_buffer must be bf16/fp16 alike",
    )
    t, h = q.shape[0], q.shape[1]
    _need(h in MLA_HEADS, f"{what}: {h} query heads (the kernels serve {sorted(MLA_HEADS)})")
    _need(
        o.dim() == 3 and o.shape[0] == t and o.shape[1] == h and 0 < o.shape[2] <= dq,
        f"{what}: o must be [{t}, {h}, Dv <= {dq}]",
    )
    qo, kp = _indptr("qo_indptr", qo_indptr), _indptr("kv_indptr", kv_indptr)
    _need(
        len(qo) == len(kp) and qo[-1] == t, f"{what}: qo_indptr must end at {t} and name as many sequences as kv_indptr"
    )
    pages = _int32("kv_indices", kv_indices)
    _need(len(pages) >= kp[-1], f"{what}: kv_indices has {len(pages)} entries for {kp[-1]} pages")
    lens = _csr_lengths(kp, _int32("kv_last_page_lens", kv_last_page_lens, len(qo) - 1), page)
    qlens = [b - a for a, b in zip(qo, qo[1:])]
    _need(max(qlens) <= max_seqlen_q, f"{what}: max_seqlen_q {max_seqlen_q} below a sequence's {max(qlens)} queries")
    _need(max(qlens) <= max_q, f"{what}: {max(qlens)} queries in a sequence (this kernel serves at most {max_q})")
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(dq)
    dv = o.shape[2]
    for b, (lq, lk) in enumerate(zip(qlens, lens)):
        if lq == 0:
            continue
        _need(lq <= lk, f"{what}: sequence {b} has {lq} queries for {lk} keys")
        kv = _pages_to_tokens(kv_buffer, pages[kp[b] : kp[b + 1]], lk, page)
        vis = bottom_right_causal(lq, lk).to(q.device)
        o[qo[b] : qo[b + 1]] = attend(q[qo[b] : qo[b + 1]], kv, kv[..., :dv], vis, scale).to(o.dtype)
    lse = torch.empty(t, 1, h, 1, dtype=torch.float32, device=q.device)  # returned, not used by attn-aiter
    return o.view(t, 1, h, dv), lse


def make_mla_decode_fwd(with_page_size: bool = True):
    """`mla_decode_fwd` in one of its two documented forms: `with_page_size` adds `page_size, nhead_kv`
    after `max_seqlen_q` (current aiter/mla.py); without them, `sm_scale` follows `max_seqlen_q` (earlier
    releases and AMD's tutorial). Returns (logits, lse); writes `o`."""

    def current(
        q,
        kv_buffer,
        o,
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_last_page_lens,
        max_seqlen_q,
        page_size=1,
        nhead_kv=1,
        sm_scale=None,
        logit_cap=0.0,
        num_kv_splits=None,
        **experts,
    ):
        _need(
            page_size == kv_buffer.shape[1] and nhead_kv == kv_buffer.shape[2],
            "page_size / nhead_kv disagree with kv_buffer",
        )
        _need(not experts, f"arguments not emulated: {sorted(experts)}")
        return _mla(
            q,
            kv_buffer,
            o,
            qo_indptr,
            kv_indptr,
            kv_indices,
            kv_last_page_lens,
            max_seqlen_q,
            sm_scale,
            logit_cap,
            MLA_DECODE_MAX_Q,
            "mla_decode_fwd",
        )

    def earlier(
        q,
        kv_buffer,
        o,
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_last_page_lens,
        max_seqlen_q,
        sm_scale=None,
        logit_cap=0.0,
        num_kv_splits=None,
    ):
        return _mla(
            q,
            kv_buffer,
            o,
            qo_indptr,
            kv_indptr,
            kv_indices,
            kv_last_page_lens,
            max_seqlen_q,
            sm_scale,
            logit_cap,
            MLA_DECODE_MAX_Q,
            "mla_decode_fwd",
        )

    fn = current if with_page_size else earlier
    fn.__name__ = "mla_decode_fwd"
    return fn


def mla_prefill_fwd(
    q,
    kv_buffer,
    o,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_lens,
    max_seqlen_q,
    sm_scale=None,
    logit_cap=0.0,
    num_kv_splits=None,
):
    """Absorbed MLA prefill [MLA]: as `mla_decode_fwd`, for up to 159 queries per sequence."""
    return _mla(
        q,
        kv_buffer,
        o,
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_last_page_lens,
        max_seqlen_q,
        sm_scale,
        logit_cap,
        MLA_PREFILL_MAX_Q,
        "mla_prefill_fwd",
    )
