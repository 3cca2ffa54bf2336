"""The DCP attention step (DECODE and TARGET_VERIFY): each rank attends to its KV shard, the partial
results are merged, one row per query (`bs` decode queries or the T = bs * k verify queries).

    q (this rank's heads) --all-gather over the group--> q of all the group's heads
    local attention over this rank's shard (any backend declaring LSE output, `return_lse=True`)
    --exchange of partial outputs + LSEs--> merge_state over the group's partials --> this rank's heads

Exchanges (`exchange=`):
- "all_gather": every rank gathers every rank's partial output and LSE for all heads (one
  all_gather of a packed float32 `[rows, H, Dv + 1]`), then merges its own heads' partials.
- "all_to_all": one packed all_to_all: rank j receives from every rank only the partials of rank
  j's heads (1/world of the all-gather's volume).

With `q_heads_sharded=False` (pure DCP, every rank computes the same q for all heads) the q gather is
skipped, the all-gather exchange is used and every rank returns all heads.

Partials travel as float32 (exact merge; twice the bytes of a bf16 output). A query that sees no key
on a rank contributes LSE -inf there (ignored by `merge_state`). DECODE and TARGET_VERIFY (eager; a
verify query at global position p sees the keys at positions <= p on every rank, as local DECODE rows:
`attn_core.dcp.requests`). Prefill attention is not sharded (the engine runs it unsharded and stores the
K/V with `DcpStep.save_kv`).

CUDA graphs (DECODE only; verify steps run eagerly): with a graph-shaped step
(`build_dcp_step(..., graph_shaped=True)`, or `DcpStep.from_graph_batch` inside a `CudaGraphRunner`'s
`run_layers`) every shape is fixed by the batch size and nothing syncs with the host: the local attention
runs over all `bs` rows and the rows without a
local key (`step.local_mask` False) get output 0 and LSE -inf by `torch.where`. The q gather, the
exchange and the merge are captured with the attention; on NCCL the collectives are captured too (the
runner's eager warm-up before each capture makes the communicator; every rank of the group must capture
and replay the same sizes in the same order, as they run the same schedule). An engine captures it with
`attn_core.CudaGraphRunner` (`DCP_GRAPH_INPUTS` among its inputs); see `attn_core.dcp.requests`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from attn_core.contract.batch import batch_field
from attn_core.contract.errors import InvalidArgumentError
from attn_core.contract.layer import AttentionLayer
from attn_core.dcp.requests import DcpStep
from attn_core.ops.merge_state import merge_state

EXCHANGES = ("all_gather", "all_to_all")


def _all_gather_flat(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """out `[world * n, ...]` <- every rank's x `[n, ...]` in rank order (torch's single-tensor all-gather:
    `all_gather_single` where torch has it, else its older name `all_gather_into_tensor`)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge `n` partial attention results over disjoint key sets: o `[n, T, H, Dv]`, lse float32
    `[n, T, H]` -> (o `[T, H, Dv]`, lse `[T, H]`), folding `merge_state` left to right.

    Example: 5 queries of 8 heads over 10 keys, attended as keys 0..3 and keys 4..9 separately:
    o `[2, 5, 8, 128]`, lse `[2, 5, 8]` -> o `[5, 8, 128]`, lse `[5, 8]`, the attention (and LSE) of
    the queries over all 10 keys (up to rounding; the natural-log LSE of a partial with no keys is -inf).
    """
    acc_o, acc_lse = o[0], lse[0]
    for i in range(1, o.shape[0]):
        acc_o, acc_lse = merge_state(acc_o, acc_lse, o[i], lse[i])
    return acc_o, acc_lse


def _check_graph_shaped(step: DcpStep, device: torch.device) -> None:
    """Typed errors for a graph-shaped step whose mask or local batch does not cover its `bs` rows."""
    bs, mask, batch = step.batch_size, step.local_mask, step.local_batch
    if (
        not isinstance(mask, torch.Tensor)
        or mask.dtype != torch.bool
        or tuple(mask.shape) != (bs,)
        or mask.device != device
    ):
        raise InvalidArgumentError(
            "step.local_mask",
            f"a bool [{bs}] tensor on {device}",
            (tuple(mask.shape), mask.dtype, mask.device) if isinstance(mask, torch.Tensor) else mask,
        )
    if batch is None or batch.batch_size != bs or not batch.forward_mode.is_decode():
        raise InvalidArgumentError(
            "step.local_batch", f"a DECODE batch of the step's {bs} requests", getattr(batch, "batch_size", None)
        )


def _scattered_partials(q: torch.Tensor, layer: AttentionLayer, step: DcpStep) -> torch.Tensor:
    """Packed float32 partials `[rows, H, Dv + 1]` (output | LSE) of an eager step: the local attention of
    the rows that see a local key (`step.local_parts`; a step of several parts makes each part's
    metadata before it), the others output 0, LSE -inf."""
    H, dv = layer.num_q_heads, layer.v_head_dim
    part = torch.zeros((step.num_rows, H, dv + 1), dtype=torch.float32, device=q.device)
    part[..., dv] = float("-inf")
    parts = step.local_parts
    for rows, batch in parts:
        if len(parts) > 1:
            batch_field(batch.attn_backend, "attn_backend").init_forward_metadata(batch)
        o, lse = layer(q[rows], None, None, batch, save_kv_cache=False, return_lse=True)
        part[rows, :, :dv] = o.view(-1, H, dv).float()
        part[rows, :, dv] = lse
    return part


def _masked_partials(q: torch.Tensor, layer: AttentionLayer, step: DcpStep) -> torch.Tensor:
    """Packed float32 partials `[bs, H, Dv + 1]` (output | LSE) of a graph-shaped step: the local
    attention of all `bs` rows, rows whose `local_mask` is False set to output 0, LSE -inf (whatever the
    padding row computed, NaN included). Fixed shapes, no host sync."""
    bs, H, dv = step.batch_size, layer.num_q_heads, layer.v_head_dim
    local_batch, local_mask = step.graph_part()
    o, lse = layer(q, None, None, local_batch, save_kv_cache=False, return_lse=True)
    keep = local_mask[:, None]
    o = torch.where(keep[..., None], o.view(bs, H, dv).float(), 0.0)
    lse = torch.where(keep, lse, float("-inf"))
    return torch.cat((o, lse[..., None]), dim=-1)


def dcp_decode_attention(
    q: torch.Tensor,
    layer: AttentionLayer,
    step: DcpStep,
    *,
    group: Optional[dist.ProcessGroup] = None,
    q_heads_sharded: bool = True,
    exchange: str = "all_gather",
) -> torch.Tensor:
    """`dcp_attention` of a DECODE step (any other mode is refused with `InvalidArgumentError`)."""
    if not step.forward_mode.is_decode():
        raise InvalidArgumentError(
            "step.forward_mode",
            "DECODE (DCP shards decode attention only; prefill is unsharded)",
            step.forward_mode.name,
        )
    return dcp_attention(q, layer, step, group=group, q_heads_sharded=q_heads_sharded, exchange=exchange)


def dcp_attention(
    q: torch.Tensor,
    layer: AttentionLayer,
    step: DcpStep,
    *,
    group: Optional[dist.ProcessGroup] = None,
    q_heads_sharded: bool = True,
    exchange: str = "all_gather",
) -> torch.Tensor:
    """DCP attention of a DECODE or TARGET_VERIFY step on this rank.

    q: `[rows, Hq_rank, D]` (rows: `bs` for DECODE, the step's T = bs * k draft tokens for
    TARGET_VERIFY, request after request), this rank's query heads (`q_heads_sharded`, rank j holding
    heads j*Hq_rank .. (j+1)*Hq_rank-1 of the group's) or all heads (`q_heads_sharded=False`). `layer`
    is the layer as the local backend sees it: `num_q_heads` = the group's heads (world * Hq_rank when
    sharded), `num_kv_heads` = the KV heads of this rank's pool. `step` is this rank's `build_dcp_step`
    result, its `init_forward_metadata()` called, its new K/V already written (`save_kv`), or a
    graph-shaped DECODE step whose metadata the graph runner made current (capture / replay). Returns
    `[rows, Hq_rank * Dv]` in q's dtype. Every rank of `group` must call it with the same step shape.

    Example (2 ranks, sharded q, 4 heads): a verify step of 3 requests with k = 2 drafts: q `[6, 2, D]`
    on each rank -> `[6, 2 * Dv]`, row 2j + i the draft i of request j over its keys at positions <= its own.
    """
    if exchange not in EXCHANGES:
        raise InvalidArgumentError("exchange", f"one of {EXCHANGES}", exchange)
    if not (step.forward_mode.is_decode() or step.forward_mode.is_target_verify()):
        raise InvalidArgumentError(
            "step.forward_mode", "DECODE or TARGET_VERIFY (prefill attention is not sharded)", step.forward_mode.name
        )
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n, H = step.num_rows, layer.num_q_heads
    h_rank = H // world if q_heads_sharded else H
    if q.dim() != 3 or q.shape[0] != n or q.shape[1] * (world if q_heads_sharded else 1) != H:
        raise InvalidArgumentError(
            "q",
            f"[{n}, {h_rank}, D] (layer.num_q_heads {H} over {world} ranks)" if q_heads_sharded else f"[{n}, {H}, D]",
            tuple(q.shape),
        )
    if not q_heads_sharded and exchange != "all_gather":
        raise InvalidArgumentError("exchange", "all_gather when q_heads_sharded=False", exchange)
    if step.graph_shaped:
        _check_graph_shaped(step, q.device)
    if q_heads_sharded and world > 1:
        gathered = q.new_empty((world * n,) + tuple(q.shape[1:]))
        _all_gather_flat(gathered, q.contiguous(), group)
        q = gathered.view(world, n, h_rank, -1).transpose(0, 1).reshape(n, H, -1)
    dv = layer.v_head_dim
    part = _masked_partials(q, layer, step) if step.graph_shaped else _scattered_partials(q, layer, step)
    if world == 1:
        parts = part[None]
    elif exchange == "all_gather":
        parts = part.new_empty((world * n,) + tuple(part.shape[1:]))
        _all_gather_flat(parts, part, group)
        parts = parts.view((world,) + tuple(part.shape))
    else:
        send = part.view(n, world, h_rank, dv + 1).transpose(0, 1).contiguous()
        parts = torch.empty_like(send)
        dist.all_to_all_single(parts, send, group=group)
    if q_heads_sharded and exchange == "all_gather":
        parts = parts[:, :, rank * h_rank : (rank + 1) * h_rank]
    out, _ = merge_partials(parts[..., :dv], parts[..., dv].contiguous())
    return out.to(q.dtype).reshape(n, h_rank * dv)
