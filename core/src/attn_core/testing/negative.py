"""Checks that a backend refuses what it must refuse: bad inputs (typed `InvalidArgumentError` before any
compute, the KV pool untouched) and capabilities it does not declare (`UnsupportedFeatureError`, or for
construction-level properties such as head_dim: any typed error, or the correct answer)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from attn_core.contract.errors import AttnError, IncompatibleBackendError, InvalidArgumentError, UnsupportedFeatureError
from attn_core.testing.harness import AttnCase, CaseEnv, forward_extras, layer_inputs, make_env, make_layer, run_case
from attn_core.testing.outcome import KitFailure
from attn_core.testing.target import KitTarget

#: errors that count as "this backend does not do that"
REFUSALS = (UnsupportedFeatureError, IncompatibleBackendError)


def _snapshot(env: CaseEnv) -> list[torch.Tensor]:
    pool = env.kv_pool
    return [
        b.clone() for lid in range(env.case.num_layers) for b in (pool.get_key_buffer(lid), pool.get_value_buffer(lid))
    ]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bit-identical, NaN (the poison) equal to NaN."""
    return all(
        torch.equal(torch.nan_to_num(x.double(), nan=12345.0), torch.nan_to_num(y.double(), nan=12345.0))
        for x, y in zip(a, b)
    )


def _expect(cid: str, case: AttnCase, errors: tuple, what: str, attempt: Callable[[CaseEnv], object]) -> str:
    """Run `attempt(env)` on a fresh env of `case`; it must raise one of `errors` and leave the pool as it was."""
    env = make_env(case)
    before = _snapshot(env)
    names = " or ".join(e.__name__ for e in errors)
    try:
        attempt(env)
    except errors as exc:
        if not _same(before, _snapshot(env)):
            msg = f"{what}: raised {type(exc).__name__} but only after writing to the KV pool"
            raise KitFailure(f"{msg}\n  case: {case.describe()}") from None
        return f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        raise KitFailure(
            f"{what}: expected {names}, got {type(exc).__name__}: {exc}\n  case: {case.describe()}"
        ) from exc
    raise KitFailure(f"{what}: expected {names}, but the call succeeded\n  case: {case.describe()}")


def _forward(target: KitTarget, env: CaseEnv, init_metadata: bool = True, **changes):
    """Build a backend, metadata (unless told not to) and call layer 0 with the case's inputs, some of
    them replaced by `changes` (q, k, v, layer, extras, save_kv_cache)."""
    backend = target.factory(env.ctx)
    env.batch.attn_backend = backend
    if init_metadata:
        backend.init_forward_metadata(env.batch)
    layer = changes.pop("layer", None) or make_layer(env.case, 0)
    inputs = layer_inputs(env, 0, torch.Generator().manual_seed(env.case.seed + 1))
    inputs.update({name: changes.pop(name)(inputs) for name in ("q", "k", "v") if name in changes})
    extras = forward_extras(env.case, inputs)
    extras.update(changes.pop("extras", {}))
    return backend.forward(
        inputs["q"], inputs["k"], inputs["v"], layer, env.batch, changes.pop("save_kv_cache", True), **extras
    )


def bad_input_checks(target: KitTarget, case: AttnCase) -> dict[str, Callable[[], str]]:
    """check name -> check, each feeding one malformed input to a backend built for `case`."""
    caps = target.capabilities
    mha = case.arch == "mha"
    bad = (InvalidArgumentError,)
    checks: dict[str, Callable[[], str]] = {}

    def add(name: str, what: str, **changes):
        def run() -> str:
            return _expect(name, case, bad, what, lambda env: _forward(target, env, **dict(changes)))

        checks[name] = run

    add("q_rows", "q with one row too many", q=lambda i: torch.cat([i["q"], i["q"][:1]]))
    add("q_heads", "q with one head too many", q=lambda i: torch.cat([i["q"], i["q"][:, :1]], dim=1))
    add("k_heads", "k with one head too many", k=lambda i: torch.cat([i["k"], i["k"][:, :1]], dim=1))
    if mha:
        add("v_missing", "k given without v", v=lambda i: None)
    add("k_missing", "save_kv_cache=True without k", k=lambda i: None, v=lambda i: None)
    odd = next((d for d in (torch.float64, torch.int32) if str(d).removeprefix("torch.") not in caps.q_dtypes), None)
    if odd is not None:
        add("q_dtype", f"q of undeclared dtype {odd}", q=lambda i: i["q"].to(odd))
    add("unknown_extra", "an unknown forward() keyword", extras={"not_an_extra": 1})
    if "sinks" in {f.value for f in caps.features}:
        add(
            "sinks_shape",
            "sinks of the wrong shape",
            extras={"sinks": torch.zeros(case.num_q_heads + 1, device=case.device)},
        )
    add("no_metadata", "forward before init_forward_metadata", init_metadata=False)
    wide = dataclasses.replace(case, num_q_heads=case.num_q_heads * 2)
    add("layer_heads", "a layer whose head counts differ from the context", layer=make_layer(wide, 0))
    if case.device != "cpu":
        add("q_device", "q on the CPU for a backend on the accelerator", q=lambda i: i["q"].cpu())

    def unknown_option() -> str:
        def attempt(env):
            return target.backend_class(env.ctx, **{**target.options, "not_an_option": 1})

        return _expect("unknown_option", case, bad, "an unknown constructor option", attempt)

    checks["unknown_option"] = unknown_option
    return checks


def refusal_check(target: KitTarget, case: AttnCase, what: str) -> Callable[[], str]:
    """`case` uses a feature or mode the backend does not declare: it must raise UnsupportedFeatureError
    (at construction, metadata or forward) before touching the pool."""

    def run() -> str:
        def attempt(env):
            return _forward(target, env)

        return _expect("refuse", case, REFUSALS, f"undeclared {what}", attempt)

    return run


def refused_or_correct_check(target: KitTarget, case: AttnCase, what: str) -> Callable[[], str]:
    """`case` has a construction-level property the backend does not declare (q dtype, page size, head
    dim, arch): a typed error anywhere is a refusal; otherwise the result must be correct."""

    def run() -> str:
        try:
            result = run_case(target.factory, case)
        except AttnError as exc:
            return f"refused: {type(exc).__name__}: {exc}"
        if not result.ok:
            raise KitFailure(f"undeclared {what} was computed wrongly instead of refused\n{result.message()}")
        return "computed correctly although undeclared"

    return run


def no_token_check(target: KitTarget, case: AttnCase) -> Callable[[], str]:
    """IDLE / DUMMY_FIRST: metadata of an empty batch, then an empty `[0, Hq*Dv]` output."""

    def run() -> str:
        env = make_env(case)
        before = _snapshot(env)
        backend = target.factory(env.ctx)
        env.batch.attn_backend = backend
        backend.init_forward_metadata(env.batch)
        layer = make_layer(case, 0)
        q = torch.zeros(0, layer.num_q_heads, layer.head_dim, dtype=getattr(torch, case.dtype), device=case.device)
        out = backend.forward(q, None, None, layer, env.batch, save_kv_cache=False)
        want = (0, layer.num_q_heads * layer.v_head_dim)
        if tuple(out.shape) != want:
            raise KitFailure(
                f"{case.mode.name} output has shape {tuple(out.shape)}, expected {want}\n  case: {case.describe()}"
            )
        if not _same(before, _snapshot(env)):
            raise KitFailure(f"{case.mode.name} step wrote to the KV pool\n  case: {case.describe()}")
        return f"empty output {want}"

    return run
