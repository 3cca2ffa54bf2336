"""The kit's masked-values check: keys a query must not see add exactly nothing to it, whatever their K and
V hold (docs/design.md §3.2). An attention kernel that multiplies every key's V by its probability adds
0 · Inf = NaN for a masked key whose V is Inf or NaN; a correct one does not.

`masked_nonfinite_check(target, case)` runs `case` (its extend-like requests of two or more new tokens,
or, with `window_keys`, a sliding window) with Inf / NaN written into keys that some queries do not see:

- the last new token of every request with two or more new tokens gets K = NaN (every third request),
  V = +Inf (the others) or V = NaN: the request's earlier tokens must not see it (causal, or its verify
  mask says so), the last token itself does;
- with `window_keys`, every cached key older than each request's window gets K = NaN and V = Inf in the
  pool: no query of the step sees it.

Rows (token, head) whose float64 reference (`reference_attention`, which sums visible keys only) is
finite must be finite and within the dtype's tolerance; rows whose reference is not finite must not be
finite either. At least one row of each kind must occur (else the case tests nothing).
"""

from __future__ import annotations

from typing import Callable

import torch

from attn_core.testing.harness import (
    AttnCase,
    CaseEnv,
    forward_extras,
    layer_inputs,
    layer_slots,
    make_env,
    make_layer,
    reference_for_layer,
)
from attn_core.testing.outcome import KitFailure
from attn_core.testing.reference import tolerance
from attn_core.testing.target import KitTarget


def _poison_new_tokens(env: CaseEnv, inputs: dict, requests) -> int:
    """Inf / NaN into the K or V of the last new token of every request with >= 2 new tokens; returns
    how many tokens were poisoned."""
    start, n_poisoned = 0, 0
    for j, i in enumerate(requests):
        n = env.case.requests[i].extend_len
        if n >= 2:
            t = start + n - 1
            if j % 3 == 2 or inputs["v"] is None:
                inputs["k"][t] = float("nan")
            else:
                inputs["v"][t] = float("inf") if j % 3 == 0 else float("nan")
            n_poisoned += 1
        start += n
    return n_poisoned


def _poison_old_keys(env: CaseEnv, lid: int, window: int, batch, requests) -> int:
    """K = NaN, V = Inf in the pool (and in the dense copies the reference reads) for every cached key of
    each request older than its first query's window; returns how many keys."""
    pool, r2t = env.kv_pool, env.req_to_token_pool.req_to_token
    k_buf, v_buf = pool.get_key_buffer(lid), pool.get_value_buffer(lid)
    rows = batch.req_pool_indices.tolist()
    count = 0
    for row, i in zip(rows, requests):
        r = env.case.requests[i]
        old = (
            r.prefix_len - window + 1
        )  # positions < old are outside every query's window (the first query at prefix_len)
        if old <= 0:
            continue
        slots = layer_slots(env, lid, r2t[row, r.encoder_len : r.encoder_len + old].long())
        k_buf[slots] = float("nan")
        v_buf[slots] = float("inf")
        env.cached_k[lid][i][:old] = float("nan")
        env.cached_v[lid][i][:old] = float("inf")
        count += old
    return count


def masked_nonfinite_check(target: KitTarget, case: AttnCase, window_keys: bool = False) -> Callable[[], str]:
    """The check of the module docstring for `case` (MHA or MLA, no fp8 cache)."""

    def run() -> str:
        env = make_env(case)
        backend = target.factory(env.ctx)
        batch, requests = env.batch, case.step_requests()[0]
        batch.attn_backend = backend
        backend.init_forward_metadata(batch)
        gen = torch.Generator().manual_seed(case.seed + 13)
        tol = tolerance(getattr(torch, case.dtype))
        worst, finite_rows, other_rows, poisoned = 0.0, 0, 0, 0
        for lid in range(case.num_layers):
            layer = make_layer(case, lid)
            inputs = layer_inputs(env, lid, gen, batch, requests)
            if not batch.forward_mode.is_decode():
                poisoned += _poison_new_tokens(env, inputs, requests)
            if window_keys and layer.sliding_window_size is not None:
                poisoned += _poison_old_keys(env, lid, layer.sliding_window_size, batch, requests)
            res = layer(inputs["q"], inputs["k"], inputs["v"], batch, **forward_extras(case, inputs))
            out = (res[0] if isinstance(res, tuple) else res).double().cpu()
            ref, _ = reference_for_layer(env, layer, inputs, batch, requests)
            out = out.reshape(ref.shape)
            ref_ok = torch.isfinite(ref).all(-1)  # [T, Hq]
            out_ok = torch.isfinite(out).all(-1)
            where = f"layer {lid}\n  case: {case.describe()}"
            leaked = (ref_ok & ~out_ok).nonzero()
            if leaked.numel():
                t, h = leaked[0].tolist()
                raise KitFailure(f"a masked key's Inf/NaN reached token {t}, head {h}, which does not see it: {where}")
            hidden = (~ref_ok & out_ok).nonzero()
            if hidden.numel():
                t, h = hidden[0].tolist()
                raise KitFailure(f"token {t}, head {h} sees a non-finite value but its output is finite: {where}")
            if ref_ok.any():
                scale = ref[ref_ok].abs().max().clamp_min(1e-6)
                err = float((out[ref_ok] - ref[ref_ok]).abs().max() / scale)
                if not err <= tol:
                    raise KitFailure(f"rows that see only finite keys: rel err {err:.3g} (tol {tol:g}): {where}")
                worst = max(worst, err)
            finite_rows += int(ref_ok.sum())
            other_rows += int((~ref_ok).sum())
        if not poisoned or not finite_rows:
            raise KitFailure(f"the case poisons no key a query does not see (kit bug)\n  case: {case.describe()}")
        exact = f"{finite_rows} rows exact (max rel err {worst:.2g})"
        return f"{poisoned} keys poisoned; {exact}, {other_rows} rows non-finite as in the reference"

    return run


__all__ = ["masked_nonfinite_check"]
