"""`StepTensors`: the device tensors and host numbers the step check reads (`attn_core.ops.step_checks`),
in a module of its own so that both implementations import it (the torch one and the Triton kernel)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch


@dataclass
class StepTensors:
    """The device tensors the step check reads (all on one device; lengths int32, indices int32/int64).

    `req_to_token` `[rows, width]`; `req_pool_indices`, `seq_lens` `[bs]`; `encoder_lens` `[bs]` or None;
    `q_lens` / `prefix_lens` / `start_loc` `[bs]` (extend-like modes; None in DECODE: one token each);
    `mask_indptr` `[bs + 1]` or None; `out_cache_loc` `[num_tokens]` or None (no write check);
    host numbers: `num_tokens`, `seq_total` (the host's sum of seq_lens; None: not checked; or a 1-element
    int64 device tensor holding it, which a kernel of the step wrote: `CudaGraphRunner`'s captured check reads
    it so), `num_slots`, `cascade_len` (0: none),
    `decode` (seq_lens >= 1), `check_dup` (rows distinct), `check_keys` (every key's slot), `pad_seq_len`
    (graph padding rows, see the field)."""

    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    num_tokens: int
    num_slots: int
    encoder_lens: Optional[torch.Tensor] = None
    q_lens: Optional[torch.Tensor] = None
    prefix_lens: Optional[torch.Tensor] = None
    start_loc: Optional[torch.Tensor] = None
    mask_indptr: Optional[torch.Tensor] = None
    out_cache_loc: Optional[torch.Tensor] = None
    seq_total: Union[int, torch.Tensor, None] = None
    cascade_len: int = 0
    decode: bool = True
    check_dup: bool = True
    check_keys: bool = True
    #: CUDA-graph runs: requests in row 0 with this seq_len are graph padding rows (`graph_padding`; a
    #: graph-shaped DCP step carries them), exempt from the duplicate-row and key checks, and any token
    #: whose slot is the dummy 0 may write it (padding rows, tokens another DCP rank stores; -1: neither)
    pad_seq_len: int = -1

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.shape[0]


__all__ = ["StepTensors"]
