"""DeepSeek's prefill path on TensorRT-LLM's ragged prefill: argument packing, LSE conversion and the
step's plan (no FlashInfer import: everything here runs on CPU; the vendor call is `kernel.ragged_prefill`).

The kernel is FlashInfer 0.6.6's `flashinfer.prefill.trtllm_ragged_attention_deepseek` (trtllm-gen,
compute capability 10.x). What this module relies on, read from FlashInfer v0.6.6's `flashinfer/prefill.py`,
`csrc/trtllm_fmha_kernel_launcher.cu`, `include/flashinfer/trtllm/fmha/lse.cuh` and its test
`tests/attention/test_trtllm_gen_attention.py::test_trtllm_gen_prefill`:

- q `[Tq, H, D]`, k `[Tk, H, D]`, v `[Tk, H, Dv]` with (D, Dv) = (192, 128) or (128, 128), packed request
  after request; `cum_seq_lens_q` / `cum_seq_lens_kv` int32 `[bs + 1]` their offsets, `seq_lens` int32
  `[bs]` the key counts, `max_q_len` / `max_kv_len` host upper bounds, `batch_size`.
- `bmm1_scale` multiplies q·k (softmax scale × q scale × k scale; a float, which the launcher turns into
  base-2 units itself), `bmm2_scale` the output (v scale); `o_sf_scale` serves FP4 outputs only;
  `window_left` -1 is no window; `is_causal` masks keys after the query (bottom-right aligned, which is
  plain causal here: the causal pass has as many keys as queries per request).
- With `return_lse`, the LSE comes back float32 `[Tq, H]` (token-major, like attn-core's) in **base 2**:
  `log2e · m + log2(d)` from the kernel's running max m and denominator d (lse.cuh); FlashInfer's test
  checks it against the cutlass ragged wrapper's LSE, whose SM100 epilogue writes
  `log2(row sum) + scale·log2e·row max`. attn-core merges natural logs (docs/design.md §3.2), so
  `natural_lse` multiplies by ln 2.
- The workspace's first 8 MiB are semaphores that must be zero before the call (and are left zero);
  8 bytes per (query token, head) of softmax statistics follow.

Not established by that source (settled only by `tests/test_gpu.py` on a Blackwell GPU): what the
kernel writes for a request with no key in a pass (a request whose prefix ends before a chunk).
`natural_lse` sets those rows' LSE to -inf whatever the kernel wrote, so attn-core's merge ignores them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from attn_core.batching.chunk_plan import Partial, PrefixChunk, chunk_slots, plan_prefix_chunks
from attn_core.batching.chunked_prefill import ChunkedPrefillPlan, prefill_lengths
from attn_core.contract.batch import ForwardBatch
from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_trtllm_mla.args import Scales, fold_scales

#: (qk_head_dim, v_head_dim) pairs the ragged kernel builds (DeepSeek's 192/128, and 128/128).
RAGGED_HEAD_DIMS = frozenset({(192, 128), (128, 128)})
#: Bytes at the start of the workspace the kernel keeps its (zeroed) semaphores in.
COUNTER_BYTES = 8192 * 256 * 4
#: Bytes of softmax statistics per (query token, head) that follow them (a float2), and their alignment.
STATS_BYTES = 8
ALIGNMENT = 16
LN2 = math.log(2.0)

#: The vendor call: `ragged_kwargs(...)` -> (output `[Tq, H, Dv]`, base-2 LSE float32 `[Tq, H]`).
RaggedKernel = Callable[[dict], tuple[torch.Tensor, torch.Tensor]]


def uses_ragged_kernel(kernel: Optional[str], qk_head_dim: int, v_head_dim: int) -> bool:
    """Whether DeepSeek's prefill goes through TRT-LLM's ragged prefill: on the trtllm-gen kernels
    (`kernel.kernel_for`: compute capability 10.x, bf16) for the head dims it builds; otherwise the
    fallback's FlashInfer ragged wrappers serve. Examples: ("trtllm-gen", 192, 128) -> True;
    ("trtllm-gen", 192, 64) -> False; (None, 192, 128) -> False."""
    return kernel == "trtllm-gen" and (qk_head_dim, v_head_dim) in RAGGED_HEAD_DIMS


def workspace_bytes_needed(num_q_tokens: int, num_heads: int) -> int:
    """Workspace bytes one ragged call over `num_q_tokens` queries of `num_heads` heads takes: the
    semaphores, then the softmax statistics rounded up to the alignment. Example: (1000, 128) ->
    8388608 + 1024000 = 9412608."""
    stats = num_q_tokens * num_heads * STATS_BYTES
    return COUNTER_BYTES + -(-stats // ALIGNMENT) * ALIGNMENT


def check_workspace(num_q_tokens: int, num_heads: int, workspace: torch.Tensor) -> None:
    """A typed error when the workspace cannot hold one call's semaphores and statistics."""
    have = workspace.numel() * workspace.element_size()
    if workspace_bytes_needed(num_q_tokens, num_heads) > have:
        most = (have - COUNTER_BYTES) // (num_heads * STATS_BYTES)
        raise InvalidArgumentError(
            "forward_batch", f"at most {most} new tokens (the TRT-LLM workspace of {have} bytes)", num_q_tokens
        )


@dataclass(frozen=True)
class RaggedLayout:
    """One ragged pass's batch: device int32 `cu_seqlens_q` / `cu_seqlens_kv` `[bs + 1]` and `kv_lens`
    `[bs]`; host `max_q_len`, `max_kv_len`, `num_q_tokens`, `num_kv_tokens`; `has_keys` device bool
    `[num_q_tokens]` (whether each query's request has a key in the pass), None when every request has."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    kv_lens: torch.Tensor
    max_q_len: int
    max_kv_len: int
    num_q_tokens: int
    num_kv_tokens: int
    causal: bool
    has_keys: Optional[torch.Tensor]

    @property
    def batch_size(self) -> int:
        return self.kv_lens.shape[0]


def ragged_layout(q_lens: torch.Tensor, kv_lens: torch.Tensor, causal: bool, device: torch.device) -> RaggedLayout:
    """The layout of a pass whose request b has `q_lens[b]` queries and `kv_lens[b]` keys (host int
    tensors `[bs]`), with one host-to-device copy.

    Worked example: q_lens [3, 2], kv_lens [4, 0], causal False ->
        cu_seqlens_q [0, 3, 5], cu_seqlens_kv [0, 4, 4], kv_lens [4, 0], max_q_len 3, max_kv_len 4,
        num_q_tokens 5, num_kv_tokens 4, has_keys [True, True, True, False, False]
    (q_lens [3, 2], kv_lens [3, 2], causal True: the new tokens' own pass, has_keys None)."""
    ql = torch.as_tensor(q_lens, dtype=torch.int64).reshape(-1).cpu()
    kl = torch.as_tensor(kv_lens, dtype=torch.int64).reshape(-1).cpu()
    if ql.shape != kl.shape:
        raise InvalidArgumentError("kv_lens", f"{ql.shape[0]} lengths like q_lens", kl.shape[0])
    bs = ql.shape[0]
    host = torch.zeros(3 * bs + 2, dtype=torch.int64)
    torch.cumsum(ql, 0, out=host[1 : bs + 1])
    torch.cumsum(kl, 0, out=host[bs + 2 : 2 * bs + 2])
    host[2 * bs + 2 :] = kl
    dev = host.to(torch.int32).to(device)
    has_keys = None
    if bool((kl == 0).any()):
        has_keys = torch.repeat_interleave(kl > 0, ql).to(device)
    return RaggedLayout(
        cu_seqlens_q=dev[: bs + 1],
        cu_seqlens_kv=dev[bs + 1 : 2 * bs + 2],
        kv_lens=dev[2 * bs + 2 :],
        max_q_len=int(ql.max()) if bs else 0,
        max_kv_len=int(kl.max()) if bs else 0,
        num_q_tokens=int(host[bs]),
        num_kv_tokens=int(host[2 * bs + 1]),
        causal=causal,
        has_keys=has_keys,
    )


def ragged_kwargs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RaggedLayout, scales: Scales, workspace: torch.Tensor
) -> dict:
    """Keyword arguments of `trtllm_ragged_attention_deepseek` for one pass: q `[Tq, H, D]`, k `[Tk, H,
    D]`, v `[Tk, H, Dv]` bf16 (made contiguous when they are not), the layout's offsets and bounds, the
    folded scales, the LSE asked for (the kernel allocates output and LSE), no window, sinks or
    skipped softmax. Typed errors for shapes, head dims, dtypes and a too-small workspace.

    Example: q [5, 16, 192], k [4, 16, 192], v [4, 16, 128] over `ragged_layout([3, 2], [4, 0], False,
    dev)` -> seq_lens [4, 0], cum_seq_lens_q [0, 3, 5], cum_seq_lens_kv [0, 4, 4], max_q_len 3,
    max_kv_len 4, batch_size 2, is_causal False, bmm1_scale / bmm2_scale from `scales`."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise InvalidArgumentError(name, "a [tokens, heads, head_dim] tensor", tuple(t.shape))
    if q.shape[0] != layout.num_q_tokens:
        raise InvalidArgumentError("q", f"{layout.num_q_tokens} query rows (the planned batch)", q.shape[0])
    if k.shape[0] != layout.num_kv_tokens or v.shape[0] != layout.num_kv_tokens:
        raise InvalidArgumentError(
            "k/v", f"{layout.num_kv_tokens} key rows (the planned pass)", (k.shape[0], v.shape[0])
        )
    H = q.shape[1]
    if k.shape[1] != H or v.shape[1] != H:
        raise InvalidArgumentError("k/v", f"{H} heads like q", (k.shape[1], v.shape[1]))
    dims = (q.shape[2], v.shape[2])
    if k.shape[2] != q.shape[2] or dims not in RAGGED_HEAD_DIMS:
        raise InvalidArgumentError(
            "q/k/v", f"head dims (q=k, v) among {sorted(RAGGED_HEAD_DIMS)}", (q.shape[2], k.shape[2], v.shape[2])
        )
    if q.dtype != torch.bfloat16 or k.dtype != q.dtype or v.dtype != q.dtype:
        raise UnsupportedFeatureError("trtllm_mla", f"ragged prefill in {(q.dtype, k.dtype, v.dtype)} (bfloat16 here)")
    check_workspace(layout.num_q_tokens, H, workspace)
    return dict(
        query=q.contiguous(),
        key=k.contiguous(),
        value=v.contiguous(),
        workspace_buffer=workspace,
        seq_lens=layout.kv_lens,
        max_q_len=layout.max_q_len,
        max_kv_len=layout.max_kv_len,
        bmm1_scale=scales.bmm1,
        bmm2_scale=scales.bmm2,
        o_sf_scale=1.0,
        batch_size=layout.batch_size,
        window_left=-1,
        cum_seq_lens_q=layout.cu_seqlens_q,
        cum_seq_lens_kv=layout.cu_seqlens_kv,
        enable_pdl=False,
        is_causal=layout.causal,
        return_lse=True,
    )


def natural_lse(lse_base2: torch.Tensor, has_keys: Optional[torch.Tensor]) -> torch.Tensor:
    """The kernel's base-2 LSE `[T, H]` float32 as attn-core's natural log (× ln 2, in place), with -inf
    in the rows of queries that have no key in the pass (`has_keys` False; None: every query has).

    Worked example: [[1.0, -2.0], [3.0, 0.5]] with has_keys [True, False] ->
        [[0.6931, -1.3863], [-inf, -inf]]."""
    lse = lse_base2.mul_(LN2)
    if has_keys is not None:
        lse.masked_fill_(~has_keys[:, None], float("-inf"))
    return lse


@dataclass
class RaggedPrefillPlan(ChunkedPrefillPlan):
    """One step's DeepSeek prefill on TRT-LLM's ragged kernel: the new tokens' causal pass
    (`new_layout`) and one pass per prefix chunk (`chunk_layouts[c]`), through `run` (the vendor call,
    `kernel.ragged_prefill`; a float64 fake in the CPU tests) with the folded `scales` and `workspace`.
    `attend` is `ChunkedPrefillPlan.attend` (attn-core's chunk loop and LSE merge)."""

    new_layout: RaggedLayout
    chunk_layouts: list[RaggedLayout]
    scales: Scales
    workspace: torch.Tensor
    run: RaggedKernel

    def run_new(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Partial:
        return self._pass(self.new_layout, q, k, v)

    def run_chunk(self, chunk: PrefixChunk, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Partial:
        return self._pass(self.chunk_layouts[chunk.index], q, k, v)

    def _pass(self, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Partial:
        o, lse = self.run(ragged_kwargs(q, k, v, layout, self.scales, self.workspace))
        return o, natural_lse(lse, layout.has_keys)


def plan_ragged_prefill(
    forward_batch: ForwardBatch,
    req_to_token: torch.Tensor,
    chunk_capacity: int,
    *,
    num_heads: int,
    qk_head_dim: int,
    v_head_dim: int,
    scaling: float,
    workspace: torch.Tensor,
    run: RaggedKernel,
) -> RaggedPrefillPlan:
    """Plan an EXTEND batch's non-absorbed prefill on the ragged kernel: the new tokens over themselves
    (causal) and over their cached prefix in chunks of at most `chunk_capacity` tokens (attn-core's
    `plan_prefix_chunks`, SGLang's semantics). `scaling` is the softmax scale; the decompressed q/k/v
    carry no quantization scales, so bmm1 = scaling and bmm2 = 1 (`args.fold_scales`). Host lengths
    only: no device sync. Example: requests (prefix 5, 3 new) and (0, 2), capacity 4 -> chunk_len 2,
    chunks over prefix [0, 2), [2, 4), [4, 5) of the first request; each chunk pass has kv_lens [n, 0]."""
    if (qk_head_dim, v_head_dim) not in RAGGED_HEAD_DIMS:
        raise UnsupportedFeatureError("trtllm_mla", f"ragged prefill with head dims {(qk_head_dim, v_head_dim)}")
    q_lens, prefix_lens = prefill_lengths(forward_batch)
    chunks = plan_prefix_chunks(prefix_lens, chunk_capacity)
    device = req_to_token.device
    new = ragged_layout(q_lens, q_lens, True, device)
    check_workspace(new.num_q_tokens, num_heads, workspace)
    layouts = [ragged_layout(q_lens, c.lens, False, device) for c in chunks.chunks]
    slots = [chunk_slots(req_to_token, forward_batch.req_pool_indices, c) for c in chunks.chunks]
    return RaggedPrefillPlan(
        chunk_plan=chunks,
        chunk_slots=slots,
        num_tokens=new.num_q_tokens,
        num_heads=num_heads,
        v_head_dim=v_head_dim,
        new_layout=new,
        chunk_layouts=layouts,
        scales=fold_scales(scaling, None, None),
        workspace=workspace,
        run=run,
    )
