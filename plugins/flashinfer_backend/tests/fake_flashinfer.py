"""A stand-in for the three FlashInfer wrappers the MHA backend uses, computed plainly in float64 on the
CPU, so the backend's wiring (which key lists, query layouts and masks each layer gets planned with) can
be tested without FlashInfer or a GPU. It models FlashInfer's documented semantics as the backend relies
on them: plans keep references to the index arrays (the backend writes the page ids after planning); a
request's keys are read from its pages (`indptr`, page ids, `last_page_len`); causal and
`window_left` are placed relative to the *end* of the request's keys (query i of n over L keys sits at
position L - n + i); `logits_soft_cap` c maps a scaled logit s to c * tanh(s / c); the LSE is base 2;
`run` writes into `out` / `lse` when given (and returns them); the paged wrappers' `k_scale` joins the
softmax scale and `v_scale` multiplies the output (an fp8 cache).
`mla.BatchMLAPagedAttentionWrapper` stands in for the MLA paged wrapper of flashinfer 0.6.6, down to the
internals `replan.mla` / `replan.mla_run` call (`_cached_module.plan` / `.run` with the compiled
functions' argument lists, `_kv_indices_buf`, `_causal`, `_page_size`, `_sm_scale`): its plan keeps host
copies of the offsets and key counts as the plan info, its run reads the page ids from `_kv_indices_buf`
when it runs (natural-log LSE with `return_lse_base_on_e`).
It says nothing about FlashInfer's kernels themselves: the GPU tests (test_gpu.py, test_gpu_mla.py) do.
"""

from __future__ import annotations

import math
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


def _attend(w, q, k, v, causal, k_scale=1.0, v_scale=1.0):
    """q `[n, Hq, D]` over k/v `[L, Hkv, D]` (float64): output `[n, Hq, D]`, base-2 LSE `[n, Hq]`."""
    n, hq, _ = q.shape
    L, hkv = k.shape[0], k.shape[1]
    kk, vv = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1) * v_scale
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * (w.scale * k_scale)
    if w.cap > 0:
        s = w.cap * torch.tanh(s / w.cap)
    pos_q = torch.arange(n)[:, None] + (L - n)
    pos_k = torch.arange(L)[None, :]
    ok = torch.ones(n, L, dtype=torch.bool)
    if causal:
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
    def plan(self, qo_indptr, indptr, indices, last_page_len, hq, hkv, d, page_size, custom_mask=None, causal=False, **kw):
        if custom_mask is not None:
            raise NotImplementedError("the fake models no custom mask")
        self._common(kw)
        self.qo, self.causal = qo_indptr.cpu(), causal
        self.indptr, self.indices, self.last, self.ps = indptr.cpu(), indices, last_page_len.cpu(), page_size

    def run(self, q, pages, return_lse=False, out=None, lse=None, k_scale=1.0, v_scale=1.0):
        assert q.shape[0] == int(self.qo[-1]), "q rows as planned"
        o = torch.zeros(q.shape, dtype=torch.float64)
        l2 = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
        for r in range(self.qo.numel() - 1):
            a, b = int(self.qo[r]), int(self.qo[r + 1])
            k, v = _pages_keys(pages, self.indptr, self.indices, self.last, r, self.ps, self.kv_layout)
            o[a:b], l2[a:b] = _attend(self, q[a:b], k, v, self.causal, k_scale, v_scale)
        return _result(o, l2, q, out, lse, return_lse)


class BatchPrefillWithRaggedKVCacheWrapper(_Wrapper):
    def plan(self, qo_indptr, kv_indptr, hq, hkv, d, causal=False, **kw):
        self._common(kw)
        self.qo, self.kv, self.causal = qo_indptr.cpu(), kv_indptr.cpu(), causal

    def run(self, q, k, v, return_lse=False, out=None, lse=None):
        assert q.shape[0] == int(self.qo[-1]) and k.shape[0] == int(self.kv[-1]), "q / k rows as planned"
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


class _MLAModule:
    """The compiled MLA functions' argument lists (flashinfer 0.6.6's `plan` / `run` of the MLA module)."""

    def plan(self, float_ws, int_ws, pinned_ws, qo_indptr, kv_indptr, kv_lens, num_heads, head_dim_o, causal):
        for a in (qo_indptr, kv_indptr, kv_lens):
            assert a.device.type == "cpu" and a.dtype == torch.int32, "host int32 arrays"
        return (qo_indptr.clone(), kv_indptr.clone(), kv_lens.clone(), causal)

    def run(
        self, float_ws, int_ws, plan_info, q_nope, q_pe, ckv, kpe, kv_indices, out, lse, mask_mode, num_heads, page_size, sm_scale, base_e
    ):
        qo, kv_indptr, kv_lens, planned_causal = plan_info
        assert mask_mode == int(planned_causal), "the mask mode of the plan"
        assert q_nope.shape[0] == int(qo[-1]) and q_nope.shape[1] == num_heads, "q rows as planned"
        for r in range(qo.numel() - 1):
            a, b = int(qo[r]), int(qo[r + 1])
            ids = kv_indices[int(kv_indptr[r]) : int(kv_indptr[r + 1])].long()
            L = int(kv_lens[r])
            c = ckv[ids].reshape(-1, ckv.shape[-1])[:L].double()
            p = kpe[ids].reshape(-1, kpe.shape[-1])[:L].double()
            s = (torch.einsum("qhd,kd->hqk", q_nope[a:b].double(), c) + torch.einsum("qhd,kd->hqk", q_pe[a:b].double(), p)) * sm_scale
            n = b - a
            if mask_mode == 1:
                ok = torch.arange(L)[None, :] <= torch.arange(n)[:, None] + (L - n)
                s = s.masked_fill(~ok[None], float("-inf"))
            ln = torch.logsumexp(s, dim=-1)  # [H, n]
            out[a:b] = torch.einsum("hqk,kd->qhd", torch.exp(s - ln[..., None]).nan_to_num(0.0), c).to(out.dtype)
            if lse is not None:
                lse[a:b] = (ln if base_e else ln * LOG2E).transpose(0, 1).float()


class BatchMLAPagedAttentionWrapper:
    def __init__(
        self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None, kv_indices=None, kv_len_arr=None, backend="auto"
    ):
        self._float_workspace_buffer = float_workspace_buffer
        self._int_workspace_buffer = self._pin_memory_int_workspace_buffer = None
        self._use_cuda_graph = use_cuda_graph
        self._qo_indptr_buf, self._kv_indptr_buf, self._kv_indices_buf, self._kv_len_arr_buf = qo_indptr, kv_indptr, kv_indices, kv_len_arr
        self._backend = "fake"
        self.public_plans = 0

    def plan(
        self,
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
            None, None, None, qo_indptr.cpu(), kv_indptr.cpu(), kv_len_arr.cpu(), num_heads, head_dim_ckv, causal
        )

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False, return_lse_base_on_e=False):
        out = torch.empty_like(q_nope) if out is None else out
        assert out.shape == q_nope.shape, "out shaped as q_nope"
        if return_lse and lse is None:
            lse = torch.empty(q_nope.shape[:2], dtype=torch.float32)
        self._cached_module.run(
            self._float_workspace_buffer, self._int_workspace_buffer, self._plan_info, q_nope, q_pe, ckv_cache, kpe_cache,
            self._kv_indices_buf, out, lse if return_lse else None, int(self._causal), q_nope.shape[1], self._page_size,
            self._sm_scale, return_lse_base_on_e,
        )  # fmt: skip
        return (out, lse) if return_lse else out


mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=BatchMLAPagedAttentionWrapper)
