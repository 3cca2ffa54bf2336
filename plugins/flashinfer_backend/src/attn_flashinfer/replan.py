"""Re-planning a FlashInfer wrapper for a new batch at a fraction of its `plan`'s host time.

FlashInfer 0.6's `plan` spends most of its host time around its scheduler rather than in it: a
Python-level `max` over a host tensor (about a microsecond per request), one pageable host-to-device
copy per index array, argument canonicalisation. Every wrapper of this backend serves one layer setting
(`LayerKey`) with fixed head counts, head dim and dtypes, so once its public `plan` has run (which picks
and, if needed, JIT-builds the kernel module), only the batch changes from step to step. The functions
here then do what `plan` does for a new batch and nothing more: point the wrapper at the step's index
arrays (on the device, written by the step's index launch, shared by every layer setting), record batch
size and maxima, and call the compiled scheduler `_cached_module.plan` with the arguments `plan` passes
for FA2 kernels. A CUDA-graph decode wrapper reads fixed buffers that the step's index launch has
already rewritten, so its re-plan is the scheduler call alone (what FlashInfer's `fast_decode_plan`
does, without its torch ops on the host). `mla_run` likewise runs a planned MLA wrapper through its
compiled kernel call alone (its public `run` re-checks shapes the backend has fixed itself).

This reads FlashInfer's wrapper internals (FA2 kernels, eager wrappers), so the backend uses it only
with the FlashInfer versions in `VERIFIED_VERSIONS` (others get public plans, unless the backend's
`lean_replan=True` option insists). Masked plans, CUDA-graph prefill wrappers and the first plan of every
wrapper go through the public API; the GPU tests check that a lean re-plan leaves a wrapper with the plan info
and index buffers a public plan of the same batch gives, and the same outputs.
"""

from __future__ import annotations

import torch

from attn_flashinfer.indices import PagedKV, PageList, QueryLayout
from attn_flashinfer.steps import Dims, LayerKey

#: flashinfer-python versions whose wrapper internals this module was checked against on a GPU
VERIFIED_VERSIONS = frozenset({"0.6.6"})
#: FlashInfer's mask-mode codes (`flashinfer.utils.MaskMode`) its MLA kernels take
MASK_NON_CAUSAL, MASK_CAUSAL = 0, 1


def verified(flashinfer_version: str) -> bool:
    """Whether lean re-plans are on by default with this FlashInfer version."""
    return flashinfer_version in VERIFIED_VERSIONS


def _schedule(w, qo: QueryLayout, kv_indptr: torch.Tensor, kv_lens: torch.Tensor, page_size: int, causal: bool, key: LayerKey, dims: Dims):
    """The FA2 scheduler's work split for this batch (its argument list in flashinfer 0.6's `plan`;
    a CUDA-graph wrapper plans for its fixed batch size)."""
    bs = kv_lens.shape[0]
    w._plan_info = w._cached_module.plan(
        w._float_workspace_buffer,
        w._int_workspace_buffer,
        w._pin_memory_int_workspace_buffer,
        qo.indptr,
        kv_indptr,
        kv_lens,
        qo.num_tokens,  # total query rows (one per request for the decode wrappers, graph ones included)
        bs,
        dims.num_q_heads,
        dims.num_kv_heads,
        page_size,
        w.is_cuda_graph_enabled,
        dims.head_dim,
        dims.head_dim,
        causal,
        key.window_left,
        -1,  # fixed_split_size: let the scheduler choose
        False,  # disable_split_kv
        0,  # num_colocated_ctas
    )
    w._batch_size = bs


def decode(w, qo: QueryLayout, kv: PagedKV, key: LayerKey, dims: Dims) -> None:
    """Re-plan a tensor-core decode wrapper (one query per request, `qo` = 0..bs) over `kv`; a
    CUDA-graph wrapper keeps its buffers."""
    if not w.is_cuda_graph_enabled:
        w._qo_indptr_buf = qo.indptr_dev
        w._paged_kv_indptr_buf = kv.indptr_dev
        w._paged_kv_indices_buf = kv.indices
        w._paged_kv_last_page_len_buf = kv.last_page_len_dev
    w._max_kv_len = kv.max_len
    _schedule(w, qo, kv.indptr, kv.kv_lens, kv.page_size, False, key, dims)


def paged(w, qo: QueryLayout, kv: PagedKV, key: LayerKey, dims: Dims, causal: bool) -> None:
    """Re-plan an eager paged prefill wrapper, no custom mask: queries `qo` over the keys of `kv`."""
    w._qo_indptr_buf = qo.indptr_dev
    w._paged_kv_indptr_buf = kv.indptr_dev
    w._paged_kv_indices_buf = kv.indices
    w._paged_kv_last_page_len_buf = kv.last_page_len_dev
    w._custom_mask_buf = None
    w._mask_indptr_buf = None
    w._max_q_len = qo.max_len
    w._max_kv_len = kv.max_len
    w._seq_lens_kv = w._seq_lens_q = kv.kv_lens
    w._causal = causal
    _schedule(w, qo, kv.indptr, kv.kv_lens, kv.page_size, causal, key, dims)


def ragged(w, qo: QueryLayout, key: LayerKey, dims: Dims) -> None:
    """Re-plan an eager ragged prefill wrapper: each request's new tokens over themselves, causal unless
    the key's layer is encoder-only (`key.causal`)."""
    w._qo_indptr_buf = w._kv_indptr_buf = w._o_indptr_buf = w._v_indptr_buf = qo.indptr_dev
    w._causal = key.causal
    _schedule(w, qo, qo.indptr, qo.lens, 1, key.causal, key, dims)


def mla(w, qo: QueryLayout, kv: PageList, causal: bool, num_heads: int, head_dim_ckv: int) -> None:
    """Re-plan an MLA paged wrapper (`flashinfer.mla.BatchMLAPagedAttentionWrapper`, FA2 or FA3) for a new
    batch: its kernel reads only the page ids (`kv.indices`: an eager wrapper is pointed at the step's,
    a CUDA-graph wrapper's buffer already holds them) and the work list the compiled scheduler writes
    into the wrapper's workspace from the host arrays; the wrapper's device copies of the indptr arrays
    and lengths, which its public `plan` makes, are never read and are not made."""
    if not w._use_cuda_graph:
        w._kv_indices_buf = kv.indices
    w._causal = causal
    w._plan_info = w._cached_module.plan(
        w._float_workspace_buffer,
        w._int_workspace_buffer,
        w._pin_memory_int_workspace_buffer,
        qo.indptr,
        kv.indptr,
        kv.kv_lens,
        num_heads,
        head_dim_ckv,  # head_dim_o
        causal,
    )


def mla_run(w, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor, out: torch.Tensor, lse, works=None) -> None:
    """Run a planned MLA paged wrapper the way its public `run` does for these arguments (FA2 or FA3,
    no profiler), without its Python: its shape/dtype/device checks of `out` and `lse` (the backend
    allocates both in the shapes `run` checks for, from q's validated shape) and its argument
    defaulting. The mask mode is the plan's (causal or not), the LSE natural-log based.
    q_nope `[T, H, kv_lora_rank]`, q_pe `[T, H, rope]` (views of one q), ckv / kpe the paged latent,
    out `[T, H, kv_lora_rank]`, lse float32 `[T, H]` or None. `works` (`mla_works.StepWorks`): run the
    step's device work list instead of the wrapper's plan (its int workspace, plan info, page ids and mask
    mode); the wrapper then gives the compiled module, softmax scale and page size, which its first
    public plan fixed."""
    if works is None:
        int_ws, plan_info, ids, causal = w._int_workspace_buffer, w._plan_info, w._kv_indices_buf, w._causal
    else:
        int_ws, plan_info, ids, causal = works.int_ws, works.plan_info, works.kv_indices, works.causal
    w._cached_module.run(
        w._float_workspace_buffer,
        int_ws,
        plan_info,
        q_nope,
        q_pe,
        ckv,
        kpe,
        ids,
        out,
        lse,
        MASK_CAUSAL if causal else MASK_NON_CAUSAL,
        q_nope.shape[1],
        w._page_size,
        w._sm_scale,
        True,  # return_lse_base_on_e
    )
