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

This reads FlashInfer's wrapper internals (FA2 kernels, eager wrappers), which change between releases,
so every supported release has an `Internals` profile in `PROFILES` saying what its internals look like
where these functions touch them, and the backend re-plans lean by default only with a release that has
one (`verified`; the MLA functions only with a release whose profile says `mla`: `mla_verified`). Any
other release gets FlashInfer's public plans (unless the backend's `lean_replan=True` option insists; it
then uses the profile of the closest older release, `profile_for`). Masked plans, CUDA-graph prefill
wrappers and the first plan of every wrapper go through the public API; the GPU tests check that a lean
re-plan leaves a wrapper with the plan info and index buffers a public plan of the same batch gives, and
the same outputs (test_gpu.py, test_gpu_mla.py; `scripts/gpu_checks.sh fi-versions` runs them per release).

What changed from 0.6.6 to 0.7.2.post1, read in 0.7.2.post1's source (decode.py, prefill.py,
mla/_batch_mla/): the FA2 scheduler takes one more argument after `num_colocated_ctas`, `uniform_q_len`
(0: no promise; its eager planner never reads it); the paged and ragged prefill wrappers' `plan` records
the query rows (`_qo_indptr_last`) and `run` refuses a q of another length; the paged prefill `plan`
settles a specialised fp8-KV verify route per plan (`_eagle_verify_fp8kv_sm90_state`, None unless a
`uniform_q_len` promise is given, which this backend never gives); the MLA paged wrapper became a facade
over per-kernel backend objects that hold the plan (no `_plan_info`, `_causal`, `_page_size` on the
wrapper), so its lean path stays with 0.6.6 and 0.7's MLA runs through the public `plan` / `run`.
Public signatures this backend calls are unchanged (arguments after `page_size` by keyword).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch

from attn_flashinfer.indices import PagedKV, PageList, QueryLayout
from attn_flashinfer.steps import Dims, LayerKey


@dataclass(frozen=True)
class Internals:
    """What one flashinfer-python release's wrapper internals look like where this module touches them.

    `fa2_plan_tail`: the FA2 scheduler's arguments after `num_colocated_ctas` (0.7 added
    `uniform_q_len`, 0 = no promise); `records_q_rows`: the prefill wrappers' `plan` stores the query
    rows as `_qo_indptr_last` and `run` checks q against it; `cleared_per_plan`: wrapper attributes a
    public plan of an unmasked batch without hints sets to None; `mla`: the MLA paged wrapper keeps its
    compiled module, plan info, causal flag, page size and scale on itself, as `mla` / `mla_run` use them."""

    version: str
    fa2_plan_tail: tuple[int, ...] = ()
    records_q_rows: bool = False
    cleared_per_plan: tuple[str, ...] = ()
    mla: bool = False


#: every flashinfer-python release whose internals this module follows (read in its source; checked on a
#: GPU by test_gpu.py's lean-against-public comparisons, docs/dev/gpu-runs.md)
PROFILES: dict[str, Internals] = {
    "0.6.6": Internals("0.6.6", mla=True),
    "0.7.2.post1": Internals(
        "0.7.2.post1", fa2_plan_tail=(0,), records_q_rows=True, cleared_per_plan=("_eagle_verify_fp8kv_sm90_state",)
    ),
}
#: the releases with lean re-plans on by default
VERIFIED_VERSIONS = frozenset(PROFILES)
#: FlashInfer's mask-mode codes (`flashinfer.utils.MaskMode`) its MLA kernels take
MASK_NON_CAUSAL, MASK_CAUSAL = 0, 1


def verified(flashinfer_version: str) -> bool:
    """Whether lean re-plans of the MHA wrappers are on by default with this FlashInfer version:
    `verified("0.6.6")` and `verified("0.7.2.post1")` are True, `verified("0.7.3")` is False."""
    return flashinfer_version in PROFILES


def mla_verified(flashinfer_version: str) -> bool:
    """Whether the MLA wrapper's lean re-plan and run (`mla`, `mla_run`) are on by default with this
    version: True for 0.6.6, False for 0.7.2.post1 (its MLA wrapper keeps the plan in a backend object)."""
    found = PROFILES.get(flashinfer_version)
    return found is not None and found.mla


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "0.7.2.post1" → (0, 7, 2), "0.0-fake" → (0, 0)."""
    parts = []
    for piece in version.replace("-", ".").replace("+", ".").split("."):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def profile_for(flashinfer_version: str) -> Internals:
    """The profile of `flashinfer_version`, else of the newest profiled release not newer than it (what
    a forced `lean_replan=True` uses), else of the oldest: "0.7.2.post1" → 0.7.2.post1's, "0.7.3" →
    0.7.2.post1's, "0.6.7" → 0.6.6's, "0.0-fake" → 0.6.6's."""
    if flashinfer_version in PROFILES:
        return PROFILES[flashinfer_version]
    ordered = sorted(PROFILES.values(), key=lambda p: _release(p.version))
    older = [p for p in ordered if _release(p.version) <= _release(flashinfer_version)]
    return older[-1] if older else ordered[0]


_installed: Optional[Internals] = None


def installed() -> Internals:
    """The profile of the imported `flashinfer` (looked up once per process)."""
    global _installed
    if _installed is None:
        module = sys.modules.get("flashinfer")
        if module is None:  # not imported yet: nothing to remember
            return profile_for("0")
        _installed = profile_for(getattr(module, "__version__", "0"))
    return _installed


def _schedule(
    w,
    qo: QueryLayout,
    kv_indptr: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    causal: bool,
    key: LayerKey,
    dims: Dims,
    internals: Optional[Internals] = None,
):
    """The FA2 scheduler's work split for this batch (its argument list in the release's `plan`; a
    CUDA-graph wrapper plans for its fixed batch size)."""
    internals = internals or installed()
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
        *internals.fa2_plan_tail,
    )
    w._batch_size = bs


def decode(w, qo: QueryLayout, kv: PagedKV, key: LayerKey, dims: Dims, internals: Optional[Internals] = None) -> None:
    """Re-plan a tensor-core decode wrapper (one query per request, `qo` = 0..bs) over `kv`; a
    CUDA-graph wrapper keeps its buffers. (0.7's decode `run` takes the batch size from the last-page
    lengths' buffer, which this points at the step's `[bs]` array.)"""
    if not w.is_cuda_graph_enabled:
        w._qo_indptr_buf = qo.indptr_dev
        w._paged_kv_indptr_buf = kv.indptr_dev
        w._paged_kv_indices_buf = kv.indices
        w._paged_kv_last_page_len_buf = kv.last_page_len_dev
    w._max_kv_len = kv.max_len
    _schedule(w, qo, kv.indptr, kv.kv_lens, kv.page_size, False, key, dims, internals)


def _record_plan_state(w, qo: QueryLayout, internals: Internals) -> None:
    """What a release's prefill `plan` records besides the scheduler's output (`Internals`)."""
    if internals.records_q_rows:
        w._qo_indptr_last = qo.num_tokens
    for name in internals.cleared_per_plan:
        setattr(w, name, None)


def paged(
    w, qo: QueryLayout, kv: PagedKV, key: LayerKey, dims: Dims, causal: bool, internals: Optional[Internals] = None
) -> None:
    """Re-plan an eager paged prefill wrapper, no custom mask: queries `qo` over the keys of `kv`."""
    internals = internals or installed()
    _record_plan_state(w, qo, internals)
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
    _schedule(w, qo, kv.indptr, kv.kv_lens, kv.page_size, causal, key, dims, internals)


def ragged(w, qo: QueryLayout, key: LayerKey, dims: Dims, internals: Optional[Internals] = None) -> None:
    """Re-plan an eager ragged prefill wrapper: each request's new tokens over themselves, causal unless
    the key's layer is encoder-only (`key.causal`)."""
    internals = internals or installed()
    _record_plan_state(w, qo, internals)
    w._qo_indptr_buf = w._kv_indptr_buf = w._o_indptr_buf = w._v_indptr_buf = qo.indptr_dev
    w._causal = key.causal
    _schedule(w, qo, qo.indptr, qo.lens, 1, key.causal, key, dims, internals)


def _require_mla(internals: Optional[Internals]) -> None:
    internals = internals or installed()
    if not internals.mla:
        raise NotImplementedError(
            f"flashinfer-python {internals.version}'s MLA wrapper keeps its plan in a backend object: "
            "no lean MLA re-plan with this release (construct the backend with lean_replan=False)"
        )


def mla(
    w,
    qo: QueryLayout,
    kv: PageList,
    causal: bool,
    num_heads: int,
    head_dim_ckv: int,
    internals: Optional[Internals] = None,
) -> None:
    """Re-plan an MLA paged wrapper (`flashinfer.mla.BatchMLAPagedAttentionWrapper`, FA2 or FA3) for a new
    batch: its kernel reads only the page ids (`kv.indices`: an eager wrapper is pointed at the step's,
    a CUDA-graph wrapper's buffer already holds them) and the work list the compiled scheduler writes
    into the wrapper's workspace from the host arrays; the wrapper's device copies of the indptr arrays
    and lengths, which its public `plan` makes, are never read and are not made. Releases whose profile
    says `mla` only (0.6.6); others raise NotImplementedError."""
    _require_mla(internals)
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


def mla_run(
    w,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    out: torch.Tensor,
    lse,
    works=None,
    internals: Optional[Internals] = None,
) -> None:
    """Run a planned MLA paged wrapper the way its public `run` does for these arguments (FA2 or FA3,
    no profiler), without its Python: its shape/dtype/device checks of `out` and `lse` (the backend
    allocates both in the shapes `run` checks for, from q's validated shape) and its argument
    defaulting. The mask mode is the plan's (causal or not), the LSE natural-log based.
    q_nope `[T, H, kv_lora_rank]`, q_pe `[T, H, rope]` (views of one q), ckv / kpe the paged latent,
    out `[T, H, kv_lora_rank]`, lse float32 `[T, H]` or None. `works` (`mla_works.StepWorks`): run the
    step's device work list instead of the wrapper's plan (its int workspace, plan info, page ids and mask
    mode); the wrapper then gives the compiled module, softmax scale and page size, which its first
    public plan fixed. Releases whose profile says `mla` only, as `mla`."""
    if internals is not None:
        _require_mla(internals)
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
