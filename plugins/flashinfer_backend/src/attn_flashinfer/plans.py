"""Every call into FlashInfer's wrappers: construction (eager or CUDA-graph mode), plan and run.

FlashInfer fixes the sliding window, the logit cap and the softmax scale at plan time, so a plan
belongs to one `LayerKey`; all layers with the same key share it. A `Plan` is the set of wrappers one
key needs in one step, already planned:

- decode: the paged decode wrapper (tensor-core path, good for GQA) over each request's keys;
- ragged: the ragged prefill wrapper over the new tokens (causal), optionally with
- paged: the paged prefill wrapper over cached keys (the prefix, the whole sequence, or the encoder
  tokens); when both ragged and paged are set the two partial results are merged by their LSEs.

Which way a wrapper is planned (the `lean` flag): FlashInfer's public `plan` the first time, for masked plans, for
CUDA-graph prefill wrappers and with `lean_replan=False`; otherwise `replan.py`'s lean re-plan (eager
wrappers after their first plan, and CUDA-graph decode replay).

fp8 KV caches (float8_e4m3fn): the decode and paged wrappers are planned with the cache's dtype and read
it with the layer's `k_scale` / `v_scale` (FlashInfer folds k_scale into the softmax scale and multiplies
the output by v_scale). The ragged wrapper's FA2 path takes no scales, so it is planned in the query
dtype and given the new tokens as the cache holds them (`attn_core.memory.fp8.as_cached`).

FlashInfer's LSE is log base 2 (`log2 sum 2^(s*log2 e)`); `run` converts it to natural log at the edge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from flashinfer import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
)
from flashinfer.cascade import merge_state_in_place

from attn_core.contract.errors import InvalidArgumentError
from attn_flashinfer import replan
from attn_flashinfer.fp8 import cache_run_kwargs, ragged_inputs, ragged_kv_dtype
from attn_flashinfer.indices import PagedKV, QueryLayout
from attn_flashinfer.steps import Dims, GraphBuffers, LayerKey

LN2 = math.log(2.0)
#: FlashInfer's FA2 kernels: one JIT build serves decode (tensor cores), paged and ragged prefill.
KERNEL_BACKEND = "fa2"


@dataclass
class Plan:
    """The planned wrappers of one LayerKey in one step (see the module docstring); `path` names them
    (e.g. "decode", "ragged + paged prefix", "paged (tree mask)")."""

    path: str
    page_size: int = 1  # page granularity of the paged / decode wrapper's key list
    decode: Optional[BatchDecodeWithPagedKVCacheWrapper] = None
    ragged: Optional[BatchPrefillWithRaggedKVCacheWrapper] = None
    paged: Optional[BatchPrefillWithPagedKVCacheWrapper] = None

    @property
    def reads_new_kv(self) -> bool:
        """Whether `run` reads the new tokens' K/V from its k / v arguments (the ragged pass), not the cache."""
        return self.ragged is not None

    def check_new_kv(self, k: Optional[torch.Tensor], mode_name: str) -> None:
        """A typed error when the plan has a ragged pass (which reads the new tokens' K/V) and `k` is None."""
        if self.ragged is not None and k is None:
            expected = f"the new tokens' keys and values for {mode_name} (the ragged pass reads them)"
            raise InvalidArgumentError("k", expected, None)

    def run(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        return_lse: bool,
        kv_layout: str = "NHD",
        scales: tuple[float, float] = (1.0, 1.0),
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Attention of q `[T, Hq, D]` under this plan: output `[T, Hq, D]` and, with return_lse, the
        natural-log LSE `[T, Hq]` float32. k/v: the new tokens `[T, Hkv, D]` (ragged pass only);
        k_cache/v_cache: one layer's pool, NHD `[num_slots, Hkv, D]` viewed as pages without a copy, or HND
        `[num_pages, Hkv, page_size, D]` read as it is (the plan's page size is then the pool's); `scales`:
        the (k, v) dequantization factors of the pool (`attn_core.memory.kv_scales`)."""
        o, lse = self.attend(q, k, v, k_cache, v_cache, return_lse, kv_layout, scales)
        return o, (lse * LN2 if return_lse else None)

    def attend(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        want_lse: bool,
        kv_layout: str = "NHD",
        scales: tuple[float, float] = (1.0, 1.0),
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """`run` with FlashInfer's base-2 LSE (None unless `want_lse`), written into `out` `[T, Hq, D]` and
        `lse` `[T, Hq]` float32 when given (views of a larger output: a split MIXED step's two parts,
        `mixed.py`), else into new tensors."""
        cache_kw = cache_run_kwargs(scales)
        into = {} if out is None else {"out": out}
        if want_lse and lse is not None:
            into["lse"] = lse
        if self.ragged is not None:
            k, v = ragged_inputs(k, v, k_cache.dtype, scales, q.dtype)
        if self.decode is not None or self.paged is not None:
            ps = self.page_size
            if kv_layout == "HND":
                pages = (k_cache, v_cache)
            else:
                pages = (k_cache.view(-1, ps, *k_cache.shape[1:]), v_cache.view(-1, ps, *v_cache.shape[1:]))
        if self.decode is not None:
            return _split(self.decode.run(q, pages, return_lse=want_lse, **into, **cache_kw), want_lse)
        if self.ragged is not None and self.paged is not None:
            o, lse = self.ragged.run(q, k, v, return_lse=True, **into)
            o_prefix, lse_prefix = self.paged.run(q, pages, return_lse=True, **cache_kw)
            merge_state_in_place(o, lse, o_prefix, lse_prefix)
            return o, (lse if want_lse else None)
        if self.ragged is not None:
            return _split(self.ragged.run(q, k, v, return_lse=want_lse, **into), want_lse)
        return _split(self.paged.run(q, pages, return_lse=want_lse, **into, **cache_kw), want_lse)


def new_decode_wrapper(
    workspace: torch.Tensor, graph: Optional[GraphBuffers] = None, kv_layout: str = "NHD"
) -> BatchDecodeWithPagedKVCacheWrapper:
    if graph is None:
        return BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout, use_tensor_cores=True, backend=KERNEL_BACKEND)
    return BatchDecodeWithPagedKVCacheWrapper(
        workspace,
        kv_layout,
        use_cuda_graph=True,
        use_tensor_cores=True,
        paged_kv_indptr_buffer=graph.kv_indptr,
        paged_kv_indices_buffer=graph.kv_indices,
        paged_kv_last_page_len_buffer=graph.last_page_len,
        backend=KERNEL_BACKEND,
    )


def new_paged_wrapper(
    workspace: torch.Tensor, graph: Optional[GraphBuffers] = None, kv_layout: str = "NHD"
) -> BatchPrefillWithPagedKVCacheWrapper:
    if graph is None:
        return BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout, backend=KERNEL_BACKEND)
    return BatchPrefillWithPagedKVCacheWrapper(
        workspace,
        kv_layout,
        use_cuda_graph=True,
        qo_indptr_buf=graph.qo_indptr,
        paged_kv_indptr_buf=graph.kv_indptr,
        paged_kv_indices_buf=graph.kv_indices,
        paged_kv_last_page_len_buf=graph.last_page_len,
        custom_mask_buf=graph.custom_mask,
        mask_indptr_buf=graph.mask_indptr,
        backend=KERNEL_BACKEND,
    )


def new_ragged_wrapper(workspace: torch.Tensor) -> BatchPrefillWithRaggedKVCacheWrapper:
    return BatchPrefillWithRaggedKVCacheWrapper(
        workspace, "NHD", backend=KERNEL_BACKEND
    )  # k/v: the new tokens, [T, H, D]


def _common(key: LayerKey, dims: Dims, kv_dtype: Optional[torch.dtype] = None) -> dict:
    return dict(
        window_left=key.window_left,
        logits_soft_cap=key.logit_cap if key.logit_cap > 0 else None,
        sm_scale=key.scaling,
        q_data_type=dims.q_dtype,
        kv_data_type=dims.kv_dtype if kv_dtype is None else kv_dtype,
    )


def plan_decode(
    w: BatchDecodeWithPagedKVCacheWrapper, qo: QueryLayout, kv: PagedKV, key: LayerKey, dims: Dims, lean: bool
) -> None:
    """Plan decode over `kv` (`qo`: one query per request). A CUDA-graph wrapper reads its own
    buffers, which hold `kv`'s device arrays already."""
    if lean:
        replan.decode(w, qo, kv, key, dims)
        return
    args = (kv.indptr, kv.indices, kv.last_page_len, dims.num_q_heads, dims.num_kv_heads, dims.head_dim, kv.page_size)
    w.plan(*args, non_blocking=True, seq_lens=kv.kv_lens, **_common(key, dims))


def plan_paged(
    w: BatchPrefillWithPagedKVCacheWrapper,
    qo: QueryLayout,
    kv: PagedKV,
    key: LayerKey,
    dims: Dims,
    causal: bool,
    lean: bool,
    custom_mask: Optional[torch.Tensor] = None,
) -> None:
    """Plan the paged prefill pass: queries `qo` over the keys of `kv`; causal aligns each request's
    queries with its last keys; `custom_mask` (flattened bool `[q_len, kv_len]` per request,
    concatenated; public plans only) replaces the causal mask.

    With a mask, FlashInfer packs it on the device with offsets it derives from qo_indptr, indptr and
    last-page lengths, so those go to the mask's device (it reads them back: its mask path syncs)."""
    if lean:
        replan.paged(w, qo, kv, key, dims, causal)
        return
    qo_indptr, indptr, last = qo.indptr, kv.indptr, kv.last_page_len
    if custom_mask is not None:
        dev = custom_mask.device
        qo_indptr, indptr, last = (t.to(dev, non_blocking=True) for t in (qo_indptr, indptr, last))
    w.plan(
        qo_indptr,
        indptr,
        kv.indices,
        last,
        dims.num_q_heads,
        dims.num_kv_heads,
        dims.head_dim,
        kv.page_size,
        custom_mask=custom_mask,
        causal=causal,
        non_blocking=True,
        seq_lens=kv.kv_lens,
        **_common(key, dims),
    )


def plan_ragged(
    w: BatchPrefillWithRaggedKVCacheWrapper, qo: QueryLayout, key: LayerKey, dims: Dims, lean: bool
) -> None:
    """Plan the ragged pass: each request's new tokens attend to the new tokens themselves, causally unless
    the key's layer is encoder-only (`key.causal`)."""
    if lean:
        replan.ragged(w, qo, key, dims)
        return
    common = _common(key, dims, ragged_kv_dtype(dims))
    hq, hkv, d = dims.num_q_heads, dims.num_kv_heads, dims.head_dim
    w.plan(qo.indptr, qo.indptr, hq, hkv, d, causal=key.causal, non_blocking=True, **common)


def _split(res, return_lse: bool):
    return res if return_lse else (res, None)
