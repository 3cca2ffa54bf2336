"""Pick double sparsity's heavy channels of one layer from sample activations (the offline calibration that
SGLang reads from a channel-config file; here a function of the samples).

For KV head g (q heads h of its group) and channel c, the importance is

    "qk": sum_h mean_n |q[n, h, c] * k[n, g, c]|     (the channel's share of the q·k scores)
    "q":  sum_h mean_n |q[n, h, c]|
    "k":  mean_n |k[n, g, c]|

over the N sample tokens, and the heavy channels of g are the C most important, most important first (ties:
lower channel first). Use the q and k the layer attends with (after RoPE). Stack the layers' results into
the `[layer_num, Hkv, C]` tensor `DoubleSparseKVPool` takes.

Worked example: one q and one KV head, head_dim 4, samples q = [[1, 0, 2, 1]], k = [[3, 5, 1, 1]]: the "qk"
importances are [3, 0, 2, 1], so num_channels=2 picks [[0, 2]].
"""

from __future__ import annotations

import torch

from attn_core.contract.errors import InvalidArgumentError

MODES = ("qk", "q", "k")


def select_heavy_channels(q: torch.Tensor, k: torch.Tensor, num_channels: int, mode: str = "qk") -> torch.Tensor:
    """Heavy channels of one layer: int64 `[Hkv, num_channels]` from samples q `[N, Hq, D]` and k
    `[N, Hkv, D]` (N >= 1 tokens, Hq a multiple of Hkv), by the module docstring's importance `mode`."""
    if mode not in MODES:
        raise InvalidArgumentError("mode", f"one of {MODES}", mode)
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[0] < 1:
        raise InvalidArgumentError(
            "q/k", "samples [N, Hq, D] and [N, Hkv, D] with the same N >= 1 and D", (tuple(q.shape), tuple(k.shape))
        )
    n, hq, d = q.shape
    hkv = k.shape[1]
    if hq % hkv:
        raise InvalidArgumentError("q", f"a head count that is a multiple of k's {hkv}", hq)
    if isinstance(num_channels, bool) or not isinstance(num_channels, int) or not 1 <= num_channels <= d:
        raise InvalidArgumentError("num_channels", f"an int in [1, {d}]", num_channels)
    qg = q.double().reshape(n, hkv, hq // hkv, d)
    kd = k.double()
    if mode == "qk":
        importance = (qg * kd[:, :, None, :]).abs().mean(0).sum(1)
    elif mode == "q":
        importance = qg.abs().mean(0).sum(1)
    else:
        importance = kd.abs().mean(0)
    order = torch.sort(-importance, dim=-1, stable=True).indices  # most important first, ties: lower channel
    return order[:, :num_channels].to(torch.int64).cpu()
