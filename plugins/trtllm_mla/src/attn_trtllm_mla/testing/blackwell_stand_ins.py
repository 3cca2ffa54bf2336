"""Float64 stand-ins of the Blackwell kernels `trtllm_mha` and `cutlass_mla` call, written from their
documented semantics, and backend classes that run on the CPU through them. Nothing here ran on a Blackwell
GPU or was compared with the real kernels (`tests/test_blackwell_gpu.py` does that on one).

- `trtllm_decode(kwargs)` / `trtllm_context(kwargs)`: FlashInfer's `trtllm_batch_decode_with_kv_cache` /
  `trtllm_batch_context_with_kv_cache` (their documented parameters; see `attn_trtllm_mla.mha_args`): a pair
  of HND caches, int32 block tables and key counts, bottom-right causal attention, `window_left`, per-head
  sink logits in the denominator, scores × `bmm1_scale`, output × `bmm2_scale`; the workspace must be zero
  the first time a kernel sees it.
- `cutlass_mla_decode(...)` / `cutlass_mla_get_workspace_size(...)`: sgl-kernel's CUTLASS MLA decode
  (`sgl_kernel/attention.py`): q_nope `[B, H, 512]`, q_pe `[B, H, 64]`, a `[pages, page, 576]` latent cache,
  int32 key counts and `[B, block_num]` page table with block_num > 0 and a multiple of 128 / page; at most
  128 heads; output `[B, H, 512]` (the latent's first 512 channels are the value). The workspace size
  formula here is the stand-in's own (the real one is the library's): only its use is checked - every call
  gets at least what the size function returned for its table width and batch.

Every stand-in checks the argument names it receives against the documented signature (`DOCUMENTED_*`).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from types import SimpleNamespace
from typing import Optional

import torch

from attn_core.ops.masked_values import masked_pv

#: parameters of FlashInfer's trtllm_batch_decode_with_kv_cache (docs.flashinfer.ai)
DOCUMENTED_DECODE = frozenset(
    "query kv_cache workspace_buffer block_tables seq_lens max_seq_len bmm1_scale bmm2_scale window_left out out_dtype "
    "o_sf_scale o_sf_vec_size sinks kv_layout enable_pdl backend q_len_per_req o_scale mask max_q_len cum_seq_lens_q "
    "skip_softmax_threshold_scale_factor".split()
)
#: parameters of FlashInfer's trtllm_batch_context_with_kv_cache (docs.flashinfer.ai)
DOCUMENTED_CONTEXT = frozenset(
    "query kv_cache workspace_buffer block_tables seq_lens max_q_len max_kv_len bmm1_scale bmm2_scale batch_size "
    "cum_seq_lens_q cum_seq_lens_kv window_left out out_dtype o_sf_scale o_sf_vec_size kv_layout enable_pdl sinks "
    "skip_softmax_threshold_scale_factor".split()
)


class StandInError(AssertionError):
    """An argument the documented kernel does not accept."""


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise StandInError(msg)


class _Workspaces:
    """Remembers the workspaces a kernel has seen (by address, while the memory there is the same allocation:
    a weak reference to its storage, which views share and which dies with it, so a new buffer that happens to
    get a freed one's address is new): one must be all zero on its first use."""

    def __init__(self):
        self.seen: dict[int, weakref.ref] = {}

    def check(self, ws: torch.Tensor) -> None:
        _need(ws.dtype == torch.uint8, "workspace_buffer must be uint8")
        storage = ws.untyped_storage()
        known = self.seen.get(ws.data_ptr())
        if known is None or known() is not storage:
            _need(not bool(ws.any()), "workspace_buffer must be initialized to 0 before its first use")
            self.seen[ws.data_ptr()] = weakref.ref(storage)


def _attend64(q, k, v, visible, scale: float, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """float64: q `[Sq, H, D]`, k `[Sk, Hkv, D]`, v `[Sk, Hkv, Dv]`, visible `[Sq, Sk]` -> `[Sq, H, Dv]`."""
    g = q.shape[1] // k.shape[1]
    kf = k.double().repeat_interleave(g, 1)
    vf = v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kf) * scale
    s = s.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(-1, s.shape[1], 1)], -1)
    p = torch.softmax(s, -1)
    if sinks is not None:
        p = p[..., :-1]
    return masked_pv(p, vf.transpose(0, 1), visible).transpose(0, 1)


def _visible(q_len: int, n: int, window_left: int) -> torch.Tensor:
    """bool `[q_len, n]`: query t of a request with n keys (position n - q_len + t) sees keys j <= its position,
    and with window_left >= 0 also j >= position - window_left."""
    pos = torch.arange(n - q_len, n)[:, None]
    j = torch.arange(n)[None, :]
    vis = j <= pos
    return vis & (j >= pos - window_left) if window_left >= 0 else vis


def _pages(cache: torch.Tensor, row: torch.Tensor, n: int, page: int) -> torch.Tensor:
    """The first n tokens `[n, Hkv, D]` of a request from an HND cache `[pages, Hkv, page, D]`."""
    used = -(-n // page)
    ids = row[:used].long()
    _need(bool(((ids >= 0) & (ids < cache.shape[0])).all()), f"block table entries out of range: {ids.tolist()}")
    return cache[ids].permute(0, 2, 1, 3).reshape(used * page, cache.shape[1], cache.shape[3])[:n]


def _check_common(kw: dict, documented: frozenset, ws: _Workspaces) -> tuple:
    _need(set(kw) <= documented, f"arguments outside the documented signature: {sorted(set(kw) - documented)}")
    q, (kc, vc) = kw["query"], kw["kv_cache"]
    _need(q.dim() == 3, "query must be [tokens, heads, head_dim]")
    _need(
        kc.dim() == 4 and kc.shape == vc.shape and kc.shape[3] == q.shape[2],
        "kv_cache must be two HND [pages, Hkv, page, D]",
    )
    _need(kc.dtype == q.dtype == vc.dtype, "query and caches must share a dtype")
    _need(q.shape[1] % kc.shape[1] == 0, "query heads must be a multiple of KV heads")
    _need(not (kc.shape[1] == 1 and kc.stride(1) == kc.stride(2)), "degenerate stride on the size-1 head dimension")
    tables, lens = kw["block_tables"], kw["seq_lens"]
    _need(tables.dtype == torch.int32 and lens.dtype == torch.int32, "block_tables and seq_lens must be int32")
    _need(tables.dim() == 2 and lens.shape == (tables.shape[0],), "block_tables [bs, width] and seq_lens [bs]")
    page = kc.shape[2]
    _need(int(lens.max()) <= tables.shape[1] * page if lens.numel() else True, "a request has more keys than its table")
    ws.check(kw["workspace_buffer"])
    sinks = kw.get("sinks")
    if sinks is not None:
        _need(sinks.dtype == torch.float32 and sinks.shape == (q.shape[1],), "sinks must be float32 [num_heads]")
    return q, kc, vc, tables, lens, page, sinks


_DECODE_WS, _CONTEXT_WS = _Workspaces(), _Workspaces()


def trtllm_decode(kw: dict) -> torch.Tensor:
    """`trtllm_batch_decode_with_kv_cache` in float64 (see the module docstring). Returns `[bs * q_len, H, D]`."""
    q, kc, vc, tables, lens, page, sinks = _check_common(kw, DOCUMENTED_DECODE, _DECODE_WS)
    q_len = kw.get("q_len_per_req", 1) or 1
    bs = tables.shape[0]
    _need(q.shape[0] == bs * q_len, f"query has {q.shape[0]} rows for {bs} requests of {q_len}")
    _need(int(lens.max()) <= kw["max_seq_len"], "max_seq_len below a request's key count")
    out = torch.zeros(q.shape[0], q.shape[1], vc.shape[3], dtype=torch.float64)
    for b in range(bs):
        n = int(lens[b])
        _need(n >= q_len, f"request {b} has {n} keys for {q_len} queries")
        k, v = _pages(kc, tables[b], n, page), _pages(vc, tables[b], n, page)
        rows = slice(b * q_len, (b + 1) * q_len)
        out[rows] = _attend64(q[rows], k, v, _visible(q_len, n, kw.get("window_left", -1)), kw["bmm1_scale"], sinks)
    return (out * kw["bmm2_scale"]).to(kw.get("out_dtype") or q.dtype)


def trtllm_context(kw: dict) -> torch.Tensor:
    """`trtllm_batch_context_with_kv_cache` in float64. Returns `[T, H, D]`."""
    q, kc, vc, tables, lens, page, sinks = _check_common(kw, DOCUMENTED_CONTEXT, _CONTEXT_WS)
    n_req = kw["batch_size"]
    cq, ck = kw["cum_seq_lens_q"], kw["cum_seq_lens_kv"]
    _need(cq.dtype == torch.int32 and ck.dtype == torch.int32, "cum_seq_lens must be int32")
    _need(tables.shape[0] == n_req and cq.shape == (n_req + 1,) and ck.shape == (n_req + 1,), "batch_size disagrees")
    cq, ck = cq.tolist(), ck.tolist()
    _need(cq[0] == 0 and cq[-1] == q.shape[0], "cum_seq_lens_q must run from 0 to the query rows")
    _need([b - a for a, b in zip(ck, ck[1:])] == lens.tolist(), "cum_seq_lens_kv must be the running sum of seq_lens")
    out = torch.zeros(q.shape[0], q.shape[1], vc.shape[3], dtype=torch.float64)
    for b in range(n_req):
        ql, n = cq[b + 1] - cq[b], int(lens[b])
        _need(0 < ql <= kw["max_q_len"] and n <= kw["max_kv_len"] and ql <= n, f"request {b}: {ql} queries, {n} keys")
        k, v = _pages(kc, tables[b], n, page), _pages(vc, tables[b], n, page)
        rows = slice(cq[b], cq[b + 1])
        out[rows] = _attend64(q[rows], k, v, _visible(ql, n, kw.get("window_left", -1)), kw["bmm1_scale"], sinks)
    return (out * kw["bmm2_scale"]).to(kw.get("out_dtype") or q.dtype)


# ---- CUTLASS MLA (sgl-kernel) ----------------------------------------------------------------------------
def cutlass_mla_get_workspace_size(
    max_seq_len: int, num_batches: int, sm_count: int = 0, num_kv_splits: int = 1
) -> int:
    """The stand-in's workspace size: 1 KiB per (request, 128-token block of max_seq_len) plus 4 KiB."""
    _need(max_seq_len > 0 and num_batches > 0, "max_seq_len and num_batches must be > 0")
    return num_batches * math.ceil(max_seq_len / 128) * 1024 + 4096


def cutlass_mla_decode(q_nope, q_pe, kv_c_and_k_pe_cache, seq_lens, page_table, workspace, sm_scale, num_kv_splits=1):
    """sgl-kernel's `cutlass_mla_decode` in float64 (see the module docstring): `[B, H, 512]` in q's dtype."""
    _need(q_nope.dim() == 3 and q_pe.dim() == 3 and kv_c_and_k_pe_cache.dim() == 3, "q_nope, q_pe, cache must be 3-D")
    bq, h, dn = q_nope.shape
    _need(q_pe.shape[:2] == (bq, h) and dn == 512 and q_pe.shape[2] == 64, "q_nope [B, H, 512], q_pe [B, H, 64]")
    _, page, dc = kv_c_and_k_pe_cache.shape
    _need(dc == 576, "the cache's last dimension must be 512 + 64")
    _need(h <= 128, f"at most 128 heads, got {h}")
    _need(page_table.dim() == 2 and page_table.shape[0] == bq, "page_table must be [B, block_num]")
    block_num = page_table.shape[1]
    _need(
        block_num > 0 and block_num % (128 // page) == 0 and 128 % page == 0, f"block_num {block_num} for page {page}"
    )
    _need(q_nope.dtype in (torch.float16, torch.bfloat16), "fp16 / bf16 only")
    _need(q_nope.dtype == q_pe.dtype == kv_c_and_k_pe_cache.dtype, "q_nope, q_pe, cache share a dtype")
    _need(seq_lens.dtype == torch.int32 and page_table.dtype == torch.int32, "seq_lens and page_table must be int32")
    need = cutlass_mla_get_workspace_size(block_num * page, bq, 0, num_kv_splits)
    _need(
        workspace.dtype == torch.uint8 and workspace.numel() >= need, f"workspace of {workspace.numel()} B < {need} B"
    )
    q = torch.cat([q_nope, q_pe], -1)
    out = torch.zeros(bq, h, 512, dtype=torch.float64)
    cache = kv_c_and_k_pe_cache.unsqueeze(1)  # [pages, 1, page, 576]: one KV head, HND
    for b in range(bq):
        n = int(seq_lens[b])
        _need(0 < n <= block_num * page, f"request {b} has {n} keys for a table of {block_num * page}")
        kv = _pages(cache, page_table[b], n, page)
        out[b] = _attend64(q[b : b + 1], kv, kv[..., :512], torch.ones(1, n, dtype=torch.bool), sm_scale, None)[0]
    return out.to(q_nope.dtype)


# ---- vendor namespaces and CPU classes ---------------------------------------------------------------------
def trtllm_mha_vendor() -> SimpleNamespace:
    """Stands in for `attn_trtllm_mla.mha_kernels`; `calls` lists the kernels called ("decode" / "context")."""
    calls: list[str] = []

    def decode(kw):
        calls.append("decode")
        return trtllm_decode(kw)

    def context(kw):
        calls.append("context")
        return trtllm_context(kw)

    return SimpleNamespace(
        decode=decode,
        context=context,
        calls=calls,
        new_workspace=lambda device: torch.zeros(1024, dtype=torch.uint8, device=device),
    )


def cutlass_mla_vendor() -> SimpleNamespace:
    """Stands in for `attn_trtllm_mla.cutlass_kernels`; `calls` lists each decode call's (batch, block_num)."""
    calls: list[tuple[int, int]] = []

    def decode(q_nope, q_pe, cache, seq_lens, page_table, workspace, sm_scale):
        calls.append(tuple(page_table.shape))
        return cutlass_mla_decode(q_nope, q_pe, cache, seq_lens, page_table, workspace, sm_scale)

    return SimpleNamespace(
        decode=decode,
        workspace_size=lambda max_seq_len, bs: cutlass_mla_get_workspace_size(max_seq_len, bs),
        calls=calls,
    )


def cpu_backend_class(backend_class: type, vendor: SimpleNamespace) -> type:
    """`backend_class` declaring the CPU (the test-only device shim) and calling `vendor` instead of the GPU
    kernels; everything else - plans, block tables, workspaces, scales, graph buffers - is the real class's."""
    caps = dataclasses.replace(
        backend_class.capabilities, devices=frozenset({"cpu"}), min_compute_capability=None, max_compute_capability=None
    )
    return type(
        "CPU" + backend_class.__name__,
        (backend_class,),
        {"capabilities": caps, "vendor": vendor, "__module__": __name__},
    )
