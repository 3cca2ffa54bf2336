"""The Triton backend's kernel launches, as plain functions over one backend's `Launch` settings: a
split-KV decode launch (`launch_decode`), an extend or verify launch (`launch_extend`), an MLA launch
(`launch_mla`) and a cascade's prefix pass merged by LSE (`merge_prefix_pass`). The per-step plans
(`plans.py`) call them once per layer; nothing here decides a path.

Every launch reads the pool's buffers as stored (fp8 included): the layer's k_scale / v_scale
(`attn_core.memory.kv_scales`) fold into the score scale and the output inside the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attn_core.contract.layer import AttentionLayer
from attn_core.memory.kv_pool import KVPool
from attn_core.memory.pools import kv_scales
from attn_core.ops.merge_state import merge_state
from attn_triton.kernels.decode import DecodeConfig, decode_attention
from attn_triton.kernels.extend import ExtendConfig, extend_attention
from attn_triton.kernels.mla_decode import MLAConfig, mla_attention
from attn_triton.kernels.verify import VerifyConfig, verify_attention
from attn_triton.metadata import CascadeKeys, KVIndex, Splits


@dataclass(frozen=True)
class Launch:
    """What every launch of one backend shares: the kernels' tile configs, the MLA latent's rope width
    (`d_rope`, 0 for MHA), whether K and V share one buffer (absorbed MLA) and its rank, the device fault
    buffer the kernels record refusals in, and the context's KV pool (whose scales a layer's k_scale /
    v_scale are checked against)."""

    decode: DecodeConfig
    extend: ExtendConfig
    mla: MLAConfig
    verify: VerifyConfig
    d_rope: int
    share_kv: bool
    kv_lora_rank: int
    fault: torch.Tensor
    pool: Optional[KVPool]


def launch_decode(
    ln: Launch,
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    o: torch.Tensor,
    lse: Optional[torch.Tensor],
    layer: AttentionLayer,
    keys: KVIndex,
    splits: Splits,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    sinks: Optional[torch.Tensor],
) -> None:
    """One split-KV decode launch: q `[bs, Hq, D]` (one row per request of `keys`) into `o` `[bs, Hq, Dv]`
    (and `lse` `[bs, Hq]` float32 when not None), stage-1 results in `part_o` / `part_lse`."""
    k_scale, v_scale = kv_scales(layer, ln.pool)
    decode_attention(
        last_dim_contiguous(q),
        k_buf,
        v_buf,
        o,
        keys.indptr,
        keys.indices,
        splits.max_splits,
        splits.min_split_len,
        part_o,
        part_lse,
        ln.fault,
        sm_scale=layer.scaling,
        config=ln.decode,
        logit_cap=layer.logit_cap,
        window=None if layer.is_cross_attention else layer.sliding_window_size,
        sinks=float_sinks(sinks),
        lse_out=lse,
        k_scale=k_scale,
        v_scale=v_scale,
        d_rope=ln.d_rope,
        share_kv=ln.share_kv,
    )


def launch_extend(
    ln: Launch,
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    layer: AttentionLayer,
    qo_indptr: torch.Tensor,
    keys: KVIndex,
    max_q_len: int,
    *,
    causal: bool,
    custom_mask: Optional[torch.Tensor],
    mask_indptr: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor],
    want_lse: bool,
    verify_len: Optional[int] = None,
    spans: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One extend-kernel launch: output `[T, Hq, Dv]` and LSE `[T, Hq]` (None unless `want_lse`). With
    `verify_len` (every request has that many tokens: `kernels.verify.verify_q_len`) the verify kernel
    runs instead, its tokens folded with the q heads of each KV head. `spans`: the batch's bidirectional
    spans (int32 `[bs, 2]`, `attn_core.contract.bidirectional`) for a bidirectional layer's causal launch."""
    k_scale, v_scale = kv_scales(layer, ln.pool)
    T, hq, dv = q.shape[0], layer.num_q_heads, layer.v_head_dim
    o = q.new_empty((T, hq, dv))
    lse = torch.empty((T, hq), dtype=torch.float32, device=q.device) if want_lse else None
    common = dict(
        sm_scale=layer.scaling,
        custom_mask=custom_mask,
        mask_indptr=mask_indptr,
        logit_cap=layer.logit_cap,
        window=None if layer.is_cross_attention else layer.sliding_window_size,
        sinks=float_sinks(sinks),
        lse_out=lse,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    q_in = last_dim_contiguous(q)
    if verify_len is not None:
        verify_attention(
            q_in, k_buf, v_buf, o, keys.indptr, keys.indices, verify_len, ln.fault, config=ln.verify, **common
        )
    else:
        extend_attention(
            q_in,
            k_buf,
            v_buf,
            o,
            qo_indptr,
            keys.indptr,
            keys.indices,
            max_q_len,
            ln.fault,
            config=ln.extend,
            causal=causal,
            d_rope=ln.d_rope,
            share_kv=ln.share_kv,
            spans=spans,
            **common,
        )
    return o, lse


def launch_mla(
    ln: Launch,
    q: torch.Tensor,
    kv_buf: torch.Tensor,
    layer: AttentionLayer,
    keys: KVIndex,
    sinks: Optional[torch.Tensor],
    return_lse: bool,
    *,
    q_len: int,
    splits: Optional[Splits] = None,
    part_o: Optional[torch.Tensor] = None,
    part_lse: Optional[torch.Tensor] = None,
    qo_indptr: Optional[torch.Tensor] = None,
    custom_mask: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
):
    """The MLA kernel: DECODE (q_len 1, split-KV with `splits` and their scratch) or q_len folded tokens
    per request (with the step's custom mask, if any). Returns the output `[T, Hq * kv_lora_rank]` (and
    the LSE `[T, Hq]` with return_lse)."""
    T, hq, rank = q.shape[0], layer.num_q_heads, ln.kv_lora_rank
    k_scale, v_scale = kv_scales(layer, ln.pool)
    o = q.new_empty((T, hq, rank))
    lse = torch.empty((T, hq), dtype=torch.float32, device=q.device) if return_lse else None
    mla_attention(
        last_dim_contiguous(q),
        kv_buf,
        o,
        keys.indptr,
        keys.indices,
        ln.fault,
        kv_lora_rank=rank,
        sm_scale=layer.scaling,
        config=ln.mla,
        q_len=q_len,
        qo_indptr=qo_indptr,
        max_splits=splits.max_splits if splits is not None else 1,
        min_split_len=splits.min_split_len if splits is not None else 1,
        part_o=part_o,
        part_lse=part_lse,
        custom_mask=custom_mask,
        mask_indptr=mask_indptr,
        logit_cap=layer.logit_cap,
        window=None if layer.is_cross_attention else layer.sliding_window_size,
        sinks=float_sinks(sinks),
        lse_out=lse,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    o = o.view(T, hq * rank)
    return (o, lse) if return_lse else o


def merge_prefix_pass(
    ln: Launch,
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    layer: AttentionLayer,
    cascade: CascadeKeys,
    o_suffix: torch.Tensor,
    lse_suffix: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A cascade's prefix pass (every query of the step, as one non-causal group, over the shared keys:
    one extend launch) merged by LSE with the suffix pass's result `[T, Hq, Dv]` / `[T, Hq]`."""
    o_p, lse_p = launch_extend(
        ln,
        q,
        k_buf,
        v_buf,
        layer,
        cascade.qo_indptr,
        cascade.prefix,
        q.shape[0],
        causal=False,
        custom_mask=None,
        mask_indptr=None,
        sinks=None,
        want_lse=True,
    )
    return merge_state(o_p, lse_p, o_suffix, lse_suffix)


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """`x` itself when its last dimension has unit stride (what the kernels read), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def float_sinks(sinks: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The per-head sink logits as the kernels read them: float32, contiguous (None stays None)."""
    return None if sinks is None else sinks.to(torch.float32).contiguous()
