"""Arguments of TensorRT-LLM's generated MHA kernels through FlashInfer (`trtllm_mha`), packed from attn-core's
pools and a step's plan. Free of FlashInfer: tested on the CPU against a float64 stand-in
(`attn_trtllm_mla.testing.blackwell_stand_ins`). Never ran on a Blackwell GPU.

Documented rules followed (FlashInfer's `trtllm_batch_decode_with_kv_cache` / `trtllm_batch_context_with_kv_cache`
pages, SGLang's trtllm_mha backend for the call forms):

- K/V: a pair of caches `[pages, Hkv, page_size, D]` ("HND"). attn-core's `[slots, Hkv, D]` buffers are NHD
  pages; `hnd_view` permutes them without a copy. With one KV head the permuted view has a degenerate stride
  (the size-1 head dimension strides like the page dimension), which FlashInfer's TMA descriptors reject
  (flashinfer issue 2232): `hnd_view` gives that dimension its canonical stride.
- Scales: `bmm1_scale` multiplies Q·Kᵀ (softmax scale × k dequantization scale), `bmm2_scale` the P·V
  product (the v dequantization scale) (`mha_scales`).
- Sliding window: `window_left` keys before the query's own (attn-core's window W: W - 1; none: -1).
- Sinks: float32 `[Hq]`, one logit per query head joining the softmax denominator.
- Decode: query `[bs · q_len, Hq, D]` (q_len = `q_len_per_req`: 1, or the draft count of a chain verify),
  `seq_lens` int32 keys per request including the new ones, `max_seq_len` >= every one of them; causal from
  the bottom right. Context: `cum_seq_lens_q` / `cum_seq_lens_kv` int32 `[n + 1]`, `batch_size` n,
  `max_q_len` / `max_kv_len` bounds.
- Workspace: `WORKSPACE_BYTES`, zero before its first use (FlashInfer: "Must be initialized to 0").
"""

from __future__ import annotations

from typing import Optional

import torch

from attn_core.contract.errors import InvalidArgumentError

#: bytes of the zero-initialized workspace the TRT-LLM MHA kernels share (SGLang's default, 512 MiB)
WORKSPACE_BYTES = 512 << 20


def mha_scales(scaling: float, k_scale: float, v_scale: float) -> tuple[float, float]:
    """(bmm1_scale, bmm2_scale) for a cache storing K / k_scale and V / v_scale.
    Example: (0.125, 0.5, 2.0) -> (0.0625, 2.0)."""
    return float(scaling) * float(k_scale), float(v_scale)


def window_left(sliding_window_size: Optional[int]) -> int:
    """FlashInfer's `window_left` for attn-core's window of W keys (the query's own and W - 1 before it).
    Examples: None -> -1; 1 -> 0; 128 -> 127."""
    return -1 if sliding_window_size is None else int(sliding_window_size) - 1


def hnd_view(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """A layer's NHD buffer `[slots, Hkv, D]` as HND pages `[pages, Hkv, page_size, D]`, no copy; the size-1
    head dimension of a one-KV-head cache gets the canonical stride page_size · D.

    Example: a [64, 1, 8] buffer with page 16 -> shape [4, 1, 16, 8], strides (128, 128, 8, 1)."""
    slots, hkv, d = buf.shape
    view = buf.view(slots // page_size, page_size, hkv, d).permute(0, 2, 1, 3)
    if hkv == 1:
        s = view.stride()
        view = view.as_strided(view.shape, (s[0], page_size * d, s[2], s[3]))
    return view


def _common(q, kv_cache, workspace, block_tables, seq_lens, scales, window, sinks) -> dict:
    """The keyword arguments both kernels take alike."""
    return dict(
        query=q,
        kv_cache=kv_cache,
        workspace_buffer=workspace,
        block_tables=block_tables,
        seq_lens=seq_lens,
        bmm1_scale=scales[0],
        bmm2_scale=scales[1],
        window_left=window,
        sinks=sinks,
        out_dtype=q.dtype,
    )


def _check_query(q: torch.Tensor, rows: int) -> None:
    if q.dim() != 3 or q.shape[0] != rows:
        raise InvalidArgumentError("q", f"a [{rows}, heads, head_dim] tensor", tuple(q.shape))


def decode_kwargs(
    q,
    kv_cache,
    workspace,
    block_tables,
    seq_lens,
    *,
    max_seq_len: int,
    scales: tuple[float, float],
    window: int,
    q_len: int,
    sinks: Optional[torch.Tensor],
) -> dict:
    """Keyword arguments of `trtllm_batch_decode_with_kv_cache` for q `[bs * q_len, Hq, D]` over the HND pair
    `kv_cache`, block tables int32 `[bs, width]` and key counts int32 `[bs]`."""
    _check_query(q, block_tables.shape[0] * q_len)
    common = _common(q, kv_cache, workspace, block_tables, seq_lens, scales, window, sinks)
    return dict(common, max_seq_len=max_seq_len, q_len_per_req=q_len)


def context_kwargs(
    q,
    kv_cache,
    workspace,
    block_tables,
    seq_lens,
    *,
    cum_seq_lens_q,
    cum_seq_lens_kv,
    max_q_len: int,
    max_kv_len: int,
    scales: tuple[float, float],
    window: int,
    sinks: Optional[torch.Tensor],
) -> dict:
    """Keyword arguments of `trtllm_batch_context_with_kv_cache` for the n requests of the plan: q `[T, Hq, D]`
    (T = cum_seq_lens_q[-1], known on the host as the q rows), block tables `[n, width]`, key counts `[n]`."""
    n = block_tables.shape[0]
    if cum_seq_lens_q.shape[0] != n + 1 or cum_seq_lens_kv.shape[0] != n + 1:
        raise InvalidArgumentError(
            "cum_seq_lens_q", f"{n + 1} offsets", (cum_seq_lens_q.shape[0], cum_seq_lens_kv.shape[0])
        )
    common = _common(q, kv_cache, workspace, block_tables, seq_lens, scales, window, sinks)
    return dict(
        common,
        max_q_len=max_q_len,
        max_kv_len=max_kv_len,
        batch_size=n,
        cum_seq_lens_q=cum_seq_lens_q,
        cum_seq_lens_kv=cum_seq_lens_kv,
    )
