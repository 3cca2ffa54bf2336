"""A stand-in for the three FlashInfer wrappers the MHA backend uses, computed plainly in float64 on the
CPU, so the backend's wiring (which key lists, query layouts and masks each layer gets planned with) can
be tested without FlashInfer or a GPU. It models FlashInfer's documented semantics as the backend relies
on them: plans keep references to the index arrays (the backend writes the page ids after planning); a
request's keys are read from its pages (`indptr`, page ids, `last_page_len`); causal and
`window_left` are placed relative to the *end* of the request's keys (query i of n over L keys sits at
position L - n + i); `logits_soft_cap` c maps a scaled logit s to c * tanh(s / c); the LSE is base 2;
`run` writes into `out` / `lse` when given (and returns them); the paged wrappers' `k_scale` joins the
softmax scale and `v_scale` multiplies the output (an fp8 cache); a paged prefill plan's `custom_mask`
(per request a row-major bool `[q_len, kv_len]`, concatenated) replaces the causal mask; the ragged wrapper
runs only at head dims that are multiples of 64, as FlashInfer's FA2 prefill kernels (flashinfer#4299).
Its `plan` / `run` take keyword arguments only (0.7 deprecates positional ones; 0.6.6 takes both).
`mla.BatchMLAPagedAttentionWrapper` stands in for the MLA paged wrapper of flashinfer 0.6.6, down to the
internals `replan.mla` / `replan.mla_run` call (`_cached_module.plan` / `.run` with the compiled
functions' argument lists, `_kv_indices_buf`, `_causal`, `_page_size`, `_sm_scale`): its plan runs a plain port of
FlashInfer's MLA scheduler and writes the work list into the int workspace (`mla_schedule`), its run
executes the work list the int workspace holds on a stand-in GPU of `NUM_SM` multiprocessors, reading
the page ids from `_kv_indices_buf` when it runs (natural-log LSE with `return_lse_base_on_e`), so a
work list written elsewhere (`attn_flashinfer.mla_works`, on the device) runs the same way.
It says nothing about FlashInfer's kernels themselves: the GPU tests (test_gpu.py, test_gpu_mla.py) do.
`installed(...)` puts a fresh copy of this stand-in in place of `flashinfer` while a block runs (this
plugin's conftest and attn-trtllm-mla's CPU wiring tests use it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import pathlib
import sys
import types

import torch

__version__ = "0.0-fake"
LOG2E = 1.0 / math.log(2.0)


class _Wrapper:
    def __init__(self, workspace, kv_layout="NHD", **kw):
        self.kv_layout = kv_layout
        self.plan_args = None

    def _common(self, kw):
        self.window_left = kw.get("window_left", -1)
        self.cap = kw.get("logits_soft_cap") or 0.0
        self.scale = kw["sm_scale"]


def _pages_keys(pages, indptr, indices, last, r, ps, layout):
    """K and V of request r `[L, H, D]` (float64) from its pages."""
    k_pages, v_pages = pages
    ids = indices[int(indptr[r]) : int(indptr[r + 1])].long().cpu()
    n = ids.numel()
    if n == 0:
        h, d = (k_pages.shape[2], k_pages.shape[3]) if layout == "NHD" else (k_pages.shape[1], k_pages.shape[3])
        return torch.zeros(0, h, d, dtype=torch.float64), torch.zeros(0, h, d, dtype=torch.float64)
    if layout == "NHD":
        k, v = k_pages[ids].reshape(n * ps, *k_pages.shape[2:]), v_pages[ids].reshape(n * ps, *v_pages.shape[2:])
    else:
        k = k_pages[ids].transpose(1, 2).reshape(n * ps, k_pages.shape[1], k_pages.shape[3])
        v = v_pages[ids].transpose(1, 2).reshape(n * ps, v_pages.shape[1], v_pages.shape[3])
    length = (n - 1) * ps + int(last[r])
    return k[:length].double(), v[:length].double()


def _attend(w, q, k, v, causal, k_scale=1.0, v_scale=1.0, mask=None):
    """q `[n, Hq, D]` over k/v `[L, Hkv, D]` (float64): output `[n, Hq, D]`, base-2 LSE `[n, Hq]`; `mask`
    (bool `[n, L]`) replaces the causal mask when given."""
    n, hq, _ = q.shape
    L, hkv = k.shape[0], k.shape[1]
    kk, vv = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1) * v_scale
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * (w.scale * k_scale)
    if w.cap > 0:
        s = w.cap * torch.tanh(s / w.cap)
    pos_q = torch.arange(n)[:, None] + (L - n)
    pos_k = torch.arange(L)[None, :]
    ok = torch.ones(n, L, dtype=torch.bool)
    if mask is not None:
        ok &= mask
    elif causal:
        ok &= pos_k <= pos_q
    if w.window_left >= 0:
        ok &= pos_k >= pos_q - w.window_left
    s = s.masked_fill(~ok[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, n], natural
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("hqk,khd->qhd", p, vv)
    return o, (lse * LOG2E).transpose(0, 1)


def _result(o, lse, q, out, lse_out, return_lse):
    """FlashInfer's return convention: into `out` / `lse_out` when given, else new tensors."""
    o = o.to(q.dtype) if out is None else out.copy_(o)
    lse = lse.float() if lse_out is None else lse_out.copy_(lse)
    return (o, lse) if return_lse else o


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, indptr, indices, last_page_len, hq, hkv, d, page_size, **kw):
        self._common(kw)
        self.indptr, self.indices, self.last, self.ps = indptr.cpu(), indices, last_page_len.cpu(), page_size

    def run(self, q, pages, return_lse=False, out=None, lse=None, k_scale=1.0, v_scale=1.0):
        assert q.shape[0] == self.indptr.numel() - 1, "one query per planned request"
        outs, lses = [], []
        for r in range(self.indptr.numel() - 1):
            k, v = _pages_keys(pages, self.indptr, self.indices, self.last, r, self.ps, self.kv_layout)
            o, l2 = _attend(self, q[r : r + 1], k, v, False, k_scale, v_scale)
            outs.append(o), lses.append(l2)
        return _result(torch.cat(outs), torch.cat(lses), q, out, lse, return_lse)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def plan(
        self, qo_indptr, indptr, indices, last_page_len, hq, hkv, d, page_size, custom_mask=None, causal=False, **kw
    ):
        self.mask = None if custom_mask is None else custom_mask.cpu().to(torch.bool)
        self._common(kw)
        self.qo, self.causal = qo_indptr.cpu(), causal
        self.indptr, self.indices, self.last, self.ps = indptr.cpu(), indices, last_page_len.cpu(), page_size

    def run(self, q, pages, return_lse=False, out=None, lse=None, k_scale=1.0, v_scale=1.0):
        assert q.shape[0] == int(self.qo[-1]), "q rows as planned"
        o = torch.zeros(q.shape, dtype=torch.float64)
        l2 = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
        at = 0  # a custom mask: per request a row-major bool [q_len, kv_len], concatenated
        for r in range(self.qo.numel() - 1):
            a, b = int(self.qo[r]), int(self.qo[r + 1])
            k, v = _pages_keys(pages, self.indptr, self.indices, self.last, r, self.ps, self.kv_layout)
            mask = None
            if self.mask is not None:
                mask = self.mask[at : at + (b - a) * k.shape[0]].view(b - a, k.shape[0])
                at += (b - a) * k.shape[0]
            o[a:b], l2[a:b] = _attend(self, q[a:b], k, v, self.causal, k_scale, v_scale, mask)
        assert self.mask is None or at == self.mask.numel(), "a custom mask of sum(q_len * kv_len) entries"
        return _result(o, l2, q, out, lse, return_lse)


class BatchPrefillWithRaggedKVCacheWrapper(_Wrapper):
    def plan(self, qo_indptr, kv_indptr, hq, hkv, d, causal=False, **kw):
        self._common(kw)
        self.qo, self.kv, self.causal, self.head_dim = qo_indptr.cpu(), kv_indptr.cpu(), causal, d

    def run(self, q, k, v, return_lse=False, out=None, lse=None):
        assert q.shape[0] == int(self.qo[-1]) and k.shape[0] == int(self.kv[-1]), "q / k rows as planned"
        assert q.shape[-1] == k.shape[-1] == v.shape[-1] == self.head_dim, "q / k / v at the planned head dim"
        assert self.head_dim % 64 == 0, "FA2 prefill kernels serve head dims that are multiples of 64 (flashinfer#4299)"
        o = torch.zeros(q.shape, dtype=torch.float64)
        l2 = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
        for r in range(self.qo.numel() - 1):
            a, b, c, e = int(self.qo[r]), int(self.qo[r + 1]), int(self.kv[r]), int(self.kv[r + 1])
            o[a:b], l2[a:b] = _attend(self, q[a:b], k[c:e].double(), v[c:e].double(), self.causal)
        return _result(o, l2, q, out, lse, return_lse)


def _merge_state_in_place(o, lse, o2, lse2):
    """Merge (o2, lse2) into (o, lse), base-2 LSEs (FlashInfer's `merge_state_in_place`)."""
    m = torch.maximum(lse, lse2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp2(lse - m), torch.exp2(lse2 - m)
    tot = w1 + w2
    out = (o.double() * w1[..., None] + o2.double() * w2[..., None]) / tot.clamp_min(1e-300)[..., None]
    o.copy_(out.to(o.dtype))
    lse.copy_((torch.log2(tot) + m).float())


cascade = types.SimpleNamespace(merge_state_in_place=_merge_state_in_place)


#: the stand-in GPU's multiprocessors, as FlashInfer's MLA scheduler reads them
NUM_SM = 6
_MLA_ARRAYS = (  # name, entries ("w": one per work, 16384; "m": one per multiprocessor), in allocation order
    ("q_indptr", "w"),
    ("kv_indptr", "w"),
    ("partial_indptr", "w"),
    ("m_start", "m"),
    ("m_end", "m"),
    ("mp_start", "m"),
    ("mp_end", "m"),
    ("m_stride", "m"),
    ("q_len", "w"),
    ("kv_len", "w"),
    ("q_start", "w"),
    ("kv_start", "w"),
    ("kv_end", "w"),
    ("work_indptr", "w"),
)


def _mla_offsets(num_sm):
    """Byte offsets of the MLA int workspace's arrays (16-byte aligned, one after another) and its size."""
    out, end = {}, 0
    for name, kind in _MLA_ARRAYS:
        end = -(-end // 16) * 16
        out[name] = end
        end += 4 * (16384 if kind == "w" else num_sm)
    return out, end


def mla_schedule(qo_indptr, kv_indptr, kv_lens, num_heads, causal, num_sm=NUM_SM):
    """flashinfer 0.6.6's MLA host scheduler (`MLAPlan`), plainly: returns (cluster size, the arrays by
    name, as Python lists: works cluster by cluster, then the merge entries padded with zeros to num_sm)."""
    bs = len(kv_lens)
    qo_lens = [qo_indptr[i + 1] - qo_indptr[i] for i in range(bs)]
    cs = 2 if sum(n * num_heads for n in qo_lens) // bs > 64 else 1
    clusters, tile = num_sm // cs, 64 * cs

    def keys(n, kv, t, tiles):  # a tile's keys: causal tiles stop at their last query's keys
        if not causal or t + 1 == tiles:
            return kv
        return max(min(kv - n + -(-((t + 1) * tile) // num_heads), kv), 0)

    tiles = [-(-(n * num_heads) // tile) for n in qo_lens]
    total = sum(keys(qo_lens[i], kv_lens[i], t, tiles[i]) for i in range(bs) for t in range(tiles[i]))
    share = max(-(-total // clusters), 1)
    limit = (
        32
        if share <= 8
        else 64
        if share <= 16
        else 128
        if share <= 32
        else 192
        if share <= 64
        else -(-share // 256) * 256
    )
    load = [(0.0, c) for c in range(clusters)]  # FlashInfer's min-heap of (cost, cluster)
    per = [[] for _ in range(clusters)]
    merge, partial_rows = [], 0
    for i in range(bs):
        n, packed = qo_lens[i], qo_lens[i] * num_heads
        for t in reversed(range(tiles[i])):
            left = keys(n, kv_lens[i], t, tiles[i])
            split = left > limit
            rows = min(tile, packed - t * tile)
            if split:
                per_entry = -(-rows // max(left * cs // limit, 1))
                base = qo_indptr[i] * num_heads + t * tile
                for lo in range(0, rows, per_entry):
                    end = partial_rows + -(-left // limit) * rows
                    merge.append((base + lo, base + min(lo + per_entry, rows), partial_rows + lo, end, rows))
            start, empty = 0, left == 0
            while left > 0 or empty:
                load.sort()
                cost, c = load[0]
                part = min(left, limit)
                load[0] = (cost + 2 * tile + part, c)
                per[c].append(
                    (
                        qo_indptr[i],
                        kv_indptr[i],
                        partial_rows if split else -1,
                        n,
                        kv_lens[i],
                        t * tile,
                        start,
                        start + part,
                    )
                )
                if split:
                    partial_rows += rows
                left -= part
                start += part
                if empty:
                    break
    assert len(merge) <= num_sm
    works = [w for c in range(clusters) for w in per[c]]
    arrays = {
        name: [w[k] for w in works]
        for k, name in enumerate(
            ("q_indptr", "kv_indptr", "partial_indptr", "q_len", "kv_len", "q_start", "kv_start", "kv_end")
        )
    }
    arrays["work_indptr"] = [sum(len(p) for p in per[:c]) for c in range(clusters + 1)]
    merge += [(0, 0, 0, 0, 0)] * (num_sm - len(merge))
    for k, name in enumerate(("m_start", "m_end", "mp_start", "mp_end", "m_stride")):
        arrays[name] = [m[k] for m in merge]
    return cs, arrays


class _MLAModule:
    """The compiled MLA functions' argument lists and workspace conventions (flashinfer 0.6.6's `plan` /
    `run` of the MLA module): `plan` writes the work list into the int workspace and returns the 18-number
    plan info; `run` executes whatever work list the int workspace holds, plainly in float64, as the
    persistent kernel does (clusters' works, then the merges), and checks that every output row is
    written exactly once and every partial row inside the partial buffer."""

    def plan(self, float_ws, int_ws, pinned_ws, qo_indptr, kv_indptr, kv_lens, num_heads, head_dim_o, causal):
        for a in (qo_indptr, kv_indptr, kv_lens):
            assert a.device.type == "cpu" and a.dtype == torch.int32, "host int32 arrays"
        cs, arrays = mla_schedule(qo_indptr.tolist(), kv_indptr.tolist(), kv_lens.tolist(), num_heads, causal)
        offsets, size = _mla_offsets(NUM_SM)
        assert int_ws.dtype == torch.uint8 and int_ws.numel() >= size, "an int workspace of the scheduler's size"
        words = int_ws.view(torch.int32)
        for name, values in arrays.items():
            o = offsets[name] // 4
            words[o : o + len(values)] = torch.tensor(values, dtype=torch.int32)
        clusters = NUM_SM // cs
        partial_o = 2 * clusters * 64 * cs * 2 * head_dim_o
        return (cs, clusters, *offsets.values(), 0, -(-partial_o // 16) * 16)

    def run(
        self,
        float_ws,
        int_ws,
        plan_info,
        q_nope,
        q_pe,
        ckv,
        kpe,
        kv_indices,
        out,
        lse,
        mask_mode,
        num_heads,
        page_size,
        sm_scale,
        base_e,
    ):
        cs, clusters = int(plan_info[0]), int(plan_info[1])
        words = int_ws.view(torch.int32)
        a = {name: words[int(off) // 4 :] for (name, _), off in zip(_MLA_ARRAYS, plan_info[2:16])}
        tile, H = 64 * cs, num_heads
        cap = 2 * clusters * tile  # partial rows the float workspace holds
        p_o = torch.full((cap, out.shape[-1]), float("nan"), dtype=torch.float64)
        p_lse = torch.full((cap,), float("nan"), dtype=torch.float64)
        written = torch.zeros(q_nope.shape[0], H, dtype=torch.int64)
        fin_o = torch.zeros(q_nope.shape[0], H, out.shape[-1], dtype=torch.float64)
        fin_lse = torch.zeros(q_nope.shape[0], H, dtype=torch.float64)
        for y in range(clusters):
            for w in range(int(a["work_indptr"][y]), int(a["work_indptr"][y + 1])):
                q0, kvp, part, n, L, q_start, lo, hi = (
                    int(a[k][w])
                    for k in (
                        "q_indptr",
                        "kv_indptr",
                        "partial_indptr",
                        "q_len",
                        "kv_len",
                        "q_start",
                        "kv_start",
                        "kv_end",
                    )
                )
                ids = kv_indices[kvp : kvp + -(-L // page_size)].long()
                c = ckv[ids].reshape(-1, ckv.shape[-1])[:L].double()
                pe = kpe[ids].reshape(-1, kpe.shape[-1])[:L].double()
                for p in range(q_start, min(q_start + tile, n * H)):  # the tile's packed rows (query, head)
                    qi, h = divmod(p, H)
                    k = torch.arange(lo, hi)
                    if mask_mode == 1:
                        k = k[k <= L - n + qi]
                    s = (c[k] @ q_nope[q0 + qi, h].double() + pe[k] @ q_pe[q0 + qi, h].double()) * sm_scale
                    ln = torch.logsumexp(s, 0) if k.numel() else torch.tensor(float("-inf"), dtype=torch.float64)
                    o = (
                        torch.exp(s - ln).nan_to_num(0.0) @ c[k]
                        if k.numel()
                        else torch.zeros(c.shape[-1], dtype=torch.float64)
                    )
                    if part == -1:
                        fin_o[q0 + qi, h], fin_lse[q0 + qi, h] = o, ln
                        written[q0 + qi, h] += 1
                    else:
                        row = part + p - q_start
                        assert 0 <= row < cap, "partial rows inside the float workspace's partial buffer"
                        p_o[row], p_lse[row] = o, ln
        for m in range(NUM_SM):  # the merge entries
            start, end, p_start, p_end, stride = (
                int(a[k][m]) for k in ("m_start", "m_end", "mp_start", "mp_end", "m_stride")
            )
            for local in range(end - start):
                qi, h = divmod(start + local, H)
                rows = list(range(p_start + local, p_end, stride))
                assert rows and all(0 <= r < cap for r in rows), "merged partial rows inside the partial buffer"
                ls = p_lse[rows]
                top = torch.logsumexp(ls, 0)
                wts = torch.exp(ls - top).nan_to_num(0.0)
                fin_o[qi, h] = (wts[:, None] * p_o[rows]).sum(0) / wts.sum() if wts.sum() > 0 else 0.0
                fin_lse[qi, h] = top
                written[qi, h] += 1
        assert bool((written == 1).all()), "every output row written exactly once"
        out.copy_(fin_o.to(out.dtype))
        if lse is not None:
            lse.copy_((fin_lse if base_e else fin_lse * LOG2E).float())


class BatchMLAPagedAttentionWrapper:
    def __init__(
        self,
        float_workspace_buffer,
        use_cuda_graph=False,
        qo_indptr=None,
        kv_indptr=None,
        kv_indices=None,
        kv_len_arr=None,
        backend="auto",
    ):
        self._float_workspace_buffer = float_workspace_buffer
        self._int_workspace_buffer = torch.zeros(1 << 20, dtype=torch.uint8)
        self._pin_memory_int_workspace_buffer = torch.zeros(1 << 20, dtype=torch.uint8)
        self._use_cuda_graph = use_cuda_graph
        self._qo_indptr_buf, self._kv_indptr_buf, self._kv_indices_buf, self._kv_len_arr_buf = (
            qo_indptr,
            kv_indptr,
            kv_indices,
            kv_len_arr,
        )
        self._backend = "fake"
        self.public_plans = 0

    def plan(  # keyword-only: FlashInfer 0.7 deprecates positional MLA arguments, so the backend passes none
        self,
        *,
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_len_arr,
        num_heads,
        head_dim_ckv,
        head_dim_kpe,
        page_size,
        causal,
        sm_scale,
        q_data_type,
        kv_data_type,
    ):
        self._cached_module = _MLAModule()
        self.public_plans += 1
        if self._use_cuda_graph:
            self._qo_indptr_buf.copy_(qo_indptr)
            self._kv_indptr_buf.copy_(kv_indptr)
            self._kv_indices_buf[: len(kv_indices)].copy_(kv_indices)
            self._kv_len_arr_buf.copy_(kv_len_arr)
        else:
            self._kv_indices_buf = kv_indices
        self._causal, self._page_size, self._sm_scale = causal, page_size, sm_scale
        self._plan_info = self._cached_module.plan(
            self._float_workspace_buffer,
            self._int_workspace_buffer,
            self._pin_memory_int_workspace_buffer,
            qo_indptr.cpu(),
            kv_indptr.cpu(),
            kv_len_arr.cpu(),
            num_heads,
            head_dim_ckv,
            causal,
        )

    def run(
        self, *, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False, return_lse_base_on_e=False
    ):
        out = torch.empty_like(q_nope) if out is None else out
        assert out.shape == q_nope.shape, "out shaped as q_nope"
        if return_lse and lse is None:
            lse = torch.empty(q_nope.shape[:2], dtype=torch.float32)
        self._cached_module.run(
            self._float_workspace_buffer,
            self._int_workspace_buffer,
            self._plan_info,
            q_nope,
            q_pe,
            ckv_cache,
            kpe_cache,
            self._kv_indices_buf,
            out,
            lse if return_lse else None,
            int(self._causal),
            q_nope.shape[1],
            self._page_size,
            self._sm_scale,
            return_lse_base_on_e,
        )
        return (out, lse) if return_lse else out


mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=BatchMLAPagedAttentionWrapper)


#: the modules that import flashinfer (re-imported over the stand-in while it is installed)
USERS = (
    "attn_flashinfer.plans",
    "attn_flashinfer.planner",
    "attn_flashinfer.mixed",
    "attn_flashinfer.backend",
    "attn_flashinfer.mla_plans",
    "attn_flashinfer.mla_prefill",
    "attn_flashinfer.mla_backend",
)


@contextlib.contextmanager
def installed(users: tuple[str, ...] = ()):
    """A fresh copy of this stand-in installed as `flashinfer` (and the modules in USERS + `users`, which
    import it, re-imported over it) while the block runs; sys.modules restored after. Yields the copy."""
    spec = importlib.util.spec_from_file_location("fake_flashinfer", pathlib.Path(__file__))
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    replaced = ("flashinfer", "flashinfer.cascade", "flashinfer.mla", *USERS, *users)
    saved = {name: sys.modules.pop(name, None) for name in replaced}
    sys.modules.update({"flashinfer": fake, "flashinfer.cascade": fake.cascade, "flashinfer.mla": fake.mla})
    try:
        yield fake
    finally:
        for name in replaced:
            sys.modules.pop(name, None)
            package, _, attr = name.rpartition(".")
            if saved[name] is not None:
                sys.modules[name] = saved[name]
            elif package in sys.modules and hasattr(sys.modules[package], attr):
                delattr(sys.modules[package], attr)  # a later import sees flashinfer missing again
