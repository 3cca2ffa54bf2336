"""The conformance kit's "hostile batch" section: batches a careless or buggy engine could hand a backend
(rows and slots out of range, negative or inconsistent lengths, host copies that disagree with the device,
duplicate / zero / foreign `out_cache_loc`, a row used twice, stale metadata, wrong int widths, q in
another dtype, scales that are not finite > 0, sinks on another device, a cascade prefix the requests do
not share). A case is a name, a mode and a `spoil(env)` that breaks the freshly built batch (or the
request table, or the layers) of a valid case; the check runs the engine's calls for one step —
`init_forward_metadata(batch)` and `forward` on every layer — in one of the two validation modes:

- "full" (`hostile-<name>`): a typed error (`AttnError`) naming the argument, with every layer's K and V
  buffers, the request table and the allocator bit-identical to before: nothing written;
- the default, "basic" (`hostile-basic-<name>`): on the CPU the same (the CPU validates fully at any
  level); on an accelerator a typed error at once, or else `DeviceFaultError` at the next step (the kit
  waits for the device between the steps, as an engine reading its sampled tokens does), with no slot
  outside the batch's legal slots (its own `out_cache_loc` and the dummy slot 0) written, the table and
  allocator unchanged. Run under `compute-sanitizer --tool memcheck` it must report no illegal access.

In both modes a good step follows on the same backend (the table restored), and its output must match
the float64 reference: the backend, the pools and the device context are still usable.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from attn_core.contract import validation as _validation
from attn_core.contract.errors import AttnError, DeviceFaultError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.testing.harness import (
    AttnCase,
    CaseEnv,
    compare_layer,
    forward_extras,
    layer_inputs,
    make_env,
    make_layer,
)
from attn_core.testing.negative import _same, _snapshot
from attn_core.testing.outcome import KitFailure
from attn_core.testing.reference import tolerance
from attn_core.testing.target import KitTarget

#: the validation modes the section runs in ("basic" is the default every engine gets)
HOSTILE_MODES = ("full", "basic")

Spoil = Callable[[CaseEnv], Optional[Callable]]


@dataclass(frozen=True)
class HostileCase:
    """`spoil(env)` breaks env.batch in place; it may return `call(backend, env)` replacing the default
    step (metadata, then every layer's forward). `case` overrides fields of the plan's case for this one
    (e.g. `(("page_size", 16),)`, an MLA or encoder-decoder case)."""

    name: str
    what: str
    mode: ForwardMode
    spoil: Spoil
    case: tuple[tuple[str, object], ...] = ()


def _set_len(env: CaseEnv, r: int, value: int) -> None:
    """Request r's seq_len becomes `value` in every copy (device, host, sum), so only the value is wrong."""
    b = env.batch
    delta = value - int(b.seq_lens_cpu[r])
    b.seq_lens[r] = value
    b.seq_lens_cpu[r] = value
    b.seq_lens_sum += delta
    if b.extend_prefix_lens is not None:
        b.extend_prefix_lens[r] += delta
        b.extend_prefix_lens_cpu[r] += delta


def _slot_of(env: CaseEnv, r: int, col: int) -> int:
    return int(env.req_to_token_pool.req_to_token[int(env.batch.req_pool_indices[r]), col])


def _first_slot(env: CaseEnv) -> int:
    return int(env.batch.out_cache_loc[0])


def _first_key_of_request_0(env: CaseEnv) -> int:
    return _slot_of(env, 0, 0)


def _first_key_of_request_1(env: CaseEnv) -> int:
    return _slot_of(env, 1, 0)


def _rows(env: CaseEnv) -> int:
    return env.req_to_token_pool.req_to_token.shape[0]


def _width(env: CaseEnv) -> int:
    return env.req_to_token_pool.req_to_token.shape[1]


def _other_batch(env: CaseEnv) -> Callable:
    """Metadata built for the batch, forward called with an equal copy of it (another object)."""

    def call(backend, env):
        backend.init_forward_metadata(env.batch)
        return _forward_all(backend, env, dataclasses.replace(env.batch))

    return call


def _no_metadata(env: CaseEnv) -> Callable:
    def call(backend, env):
        return _forward_all(backend, env, env.batch)

    return call


def _metadata_of_another_step(env: CaseEnv) -> Callable:
    """Metadata built for batch A, then for batch B (another step), then forward on A: what a second
    thread sharing the backend, or an engine reusing the previous step's metadata, does."""

    def call(backend, env):
        backend.init_forward_metadata(env.batch)
        other = dataclasses.replace(env.batch)
        backend.init_forward_metadata(other)
        return _forward_all(backend, env, env.batch)

    return call


def _q_in(dtype_name: str) -> Spoil:
    dtype = getattr(torch, dtype_name)

    def spoil(env):
        def call(backend, env):
            backend.init_forward_metadata(env.batch)
            return _forward_all(backend, env, env.batch, q_dtype=dtype)

        return call

    return spoil


def _set(field: str, value: Callable[[CaseEnv], object]) -> Spoil:
    def spoil(env):
        setattr(env.batch, field, value(env))

    return spoil


def _poke(field: str, index: int, value: Callable[[CaseEnv], int]) -> Spoil:
    def spoil(env):
        getattr(env.batch, field)[index] = value(env)

    return spoil


def _seq_lens_int64(env):
    env.batch.seq_lens = env.batch.seq_lens.to(torch.int64)


def _device_seq_len_longer(env):
    env.batch.seq_lens[0] += 1  # the host copies keep the old value


def _host_sum_short(env):
    env.batch.seq_lens_sum -= 1


def _unwritten_key(env):
    """Request 0 claims one key more than the engine wrote (its table entry there is 0: never written)."""
    col = int(env.batch.seq_lens_cpu[0])
    env.req_to_token_pool.req_to_token[int(env.batch.req_pool_indices[0]), col] = 0
    _set_len(env, 0, col + 1)
    if env.batch.forward_mode.is_decode():  # the new token moves to the claimed position
        env.req_to_token_pool.req_to_token[int(env.batch.req_pool_indices[0]), col] = int(env.batch.out_cache_loc[0])
        env.req_to_token_pool.req_to_token[int(env.batch.req_pool_indices[0]), col - 1] = 0


def _table_slot_past_pool(env):
    env.req_to_token_pool.req_to_token[int(env.batch.req_pool_indices[0]), 0] = env.kv_pool.num_slots + 5


def _extend_not_summing(env):
    b = env.batch
    b.extend_seq_lens[0] += 1
    b.extend_seq_lens_cpu[0] += 1
    b.extend_prefix_lens[0] -= 1
    b.extend_prefix_lens_cpu[0] -= 1


def _negative_extend(env):
    """Request 0 gets extend length -1 and prefix seq_len + 1 (prefix + extend still equals seq_len)."""
    b = env.batch
    seq = int(b.seq_lens_cpu[0])
    for t in (b.extend_seq_lens, b.extend_seq_lens_cpu):
        t[0] = -1
    for t in (b.extend_prefix_lens, b.extend_prefix_lens_cpu):
        t[0] = seq + 1


def _short_mask(env):
    spec = env.batch.spec_info
    env.batch.spec_info = dataclasses.replace(spec, custom_mask=spec.custom_mask[:-1])


def _row_duplicate(env):
    env.batch.req_pool_indices[1] = env.batch.req_pool_indices[0]


def _slot_in_page(env):
    """The first new token's slot moves by one inside its page (another position's slot, or a free one)."""
    ps = env.kv_pool.page_size
    loc = int(env.batch.out_cache_loc[0])
    env.batch.out_cache_loc[0] = loc + 1 if (loc + 1) % ps else loc - 1


def _last_slot_past_pool(env):
    env.batch.out_cache_loc[-1] = env.kv_pool.num_slots


def _extend_device_differs(env):
    """Device extend lengths of request 0 one longer (prefix one shorter) than the host copies say."""
    env.batch.extend_seq_lens[0] += 1
    env.batch.extend_prefix_lens[0] -= 1


def _start_loc_differs(env):
    env.batch.extend_start_loc[1] += 1


def _encoder_lens_differs(env):
    env.batch.encoder_lens[0] += 1


def _encoder_slot_minus_one(env):
    env.batch.encoder_out_cache_loc[0] = -1


def _mask_indptr_differs(env):
    env.batch.spec_info.mask_indptr[1] += 1


def _cascade_not_shared(env):
    """Request 1's first key slot becomes its own slot of a later position: the prefix is not shared."""
    r2t = env.req_to_token_pool.req_to_token
    row = int(env.batch.req_pool_indices[1])
    r2t[row, 0] = r2t[row, env.batch.cascade_prefix_len]


def _layers_with(**changes) -> Spoil:
    """Every layer gets `changes` (e.g. a v_scale of 0) and runs with `save_kv_cache=False` (no write on
    the way to the backend's own reading of the scales)."""

    def spoil(env):
        def call(backend, env):
            backend.init_forward_metadata(env.batch)
            return _forward_all(backend, env, env.batch, layer_changes=changes, save_kv_cache=False)

        return call

    return spoil


def _zero_scale(env):
    """A scale of 0 on every layer, save_kv_cache=False: v_scale (the one cpu_amx turned into 1.0), or on
    an MLA case k_scale (an MLA latent is read with k_scale alone: its v_scale means nothing)."""
    name = "k_scale" if env.case.arch == "mla" else "v_scale"
    return _layers_with(**{name: 0.0})(env)


def _sinks_elsewhere(env):
    """Sinks on another device than q (the meta device on a CPU machine, the CPU on an accelerator)."""

    def call(backend, env):
        backend.init_forward_metadata(env.batch)
        other = "meta" if env.ctx.device.type == "cpu" else "cpu"
        return _forward_all(backend, env, env.batch, sinks_device=other)

    return call


def hostile_cases(
    modes,
    features=frozenset(),
    archs=frozenset({"mha"}),
    other_dtype: Optional[str] = None,
    paged: Optional[int] = None,
    encoder_requests=None,
    cascade_prefix: int = 0,
) -> list[HostileCase]:
    """The cases for a backend declaring forward `modes`, `features` (`Feature` values or members),
    `archs`, whose context dtype differs from `other_dtype` (a torch dtype name); `paged`: a declared
    page size > 1 (for the in-page slot case); `encoder_requests`: the plan's encoder-decoder requests
    (cases with encoder tokens, when cross attention is declared); `cascade_prefix`: the shared prefix of
    the cascade case (when declared)."""
    D, E, V = ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY
    feats = {getattr(f, "value", f) for f in features}
    decode, extend = D in modes, E in modes
    verify_mask = V in modes and "custom_mask" in feats
    cases = []
    if decode:
        cases += [
            HostileCase("row_negative", "req_pool_indices of -1", D, _poke("req_pool_indices", 0, lambda e: -1)),
            HostileCase(
                "row_past_table", "req_pool_indices one past the table", D, _poke("req_pool_indices", 1, _rows)
            ),
            HostileCase("row_huge", "req_pool_indices of 10**6", D, _poke("req_pool_indices", 0, lambda e: 10**6)),
            HostileCase("row_duplicate", "one req_to_token row for two requests", D, _row_duplicate),
            HostileCase(
                "seq_lens_past_table",
                "a seq_len past the req_to_token width",
                D,
                lambda e: _set_len(e, 0, _width(e) + 1),
            ),
            HostileCase("seq_lens_zero_decode", "a DECODE seq_len of 0", D, lambda e: _set_len(e, 1, 0)),
            HostileCase("seq_lens_int64", "int64 seq_lens", D, _seq_lens_int64),
            HostileCase(
                "seq_lens_device_differs", "device seq_lens longer than seq_lens_cpu", D, _device_seq_len_longer
            ),
            HostileCase("seq_lens_sum_short", "seq_lens_sum smaller than the lengths", D, _host_sum_short),
            HostileCase("slot_minus_one", "out_cache_loc of -1", D, _poke("out_cache_loc", 0, lambda e: -1)),
            HostileCase("slot_zero", "out_cache_loc of the dummy slot 0", D, _poke("out_cache_loc", 0, lambda e: 0)),
            HostileCase(
                "slot_past_pool",
                "out_cache_loc one past the pool",
                D,
                _poke("out_cache_loc", 0, lambda e: e.kv_pool.num_slots),
            ),
            HostileCase("slot_last_past_pool", "the last out_cache_loc one past the pool", D, _last_slot_past_pool),
            HostileCase("slot_duplicate", "two tokens writing one slot", D, _poke("out_cache_loc", 1, _first_slot)),
            HostileCase(
                "slot_foreign",
                "out_cache_loc of another request's key",
                D,
                _poke("out_cache_loc", 1, _first_key_of_request_0),
            ),
            HostileCase("table_slot_past_pool", "a req_to_token slot past the pool", D, _table_slot_past_pool),
            HostileCase("key_never_written", "seq_lens covering a key the engine never wrote", D, _unwritten_key),
            HostileCase("stale_other_batch", "forward with a batch other than the metadata's", D, _other_batch),
            HostileCase("stale_no_metadata", "forward before any init_forward_metadata", D, _no_metadata),
            HostileCase("stale_previous_step", "forward on the previous step's batch", D, _metadata_of_another_step),
            HostileCase(
                "scale_negative_no_save", "a negative k_scale, save_kv_cache=False", D, _layers_with(k_scale=-0.5)
            ),
            HostileCase("scale_zero_no_save", "a scale of 0 (MLA: k_scale), save_kv_cache=False", D, _zero_scale),
            HostileCase("scale_nan", "a NaN k_scale", D, _layers_with(k_scale=float("nan"))),
        ]
        if paged:
            cases.append(
                HostileCase(
                    "slot_in_page",
                    "out_cache_loc at another offset of its page",
                    D,
                    _slot_in_page,
                    (("page_size", paged),),
                )
            )
        if "mla" in archs and "mha" in archs:
            cases.append(
                HostileCase(
                    "mla_slot_duplicate",
                    "an MLA latent slot written twice",
                    D,
                    _poke("out_cache_loc", 1, _first_slot),
                    (("arch", "mla"),),
                )
            )
        if "sinks" in feats:
            cases.append(
                HostileCase(
                    "sinks_other_device", "sinks on another device than q", D, _sinks_elsewhere, (("sinks", True),)
                )
            )
        if other_dtype is not None:
            cases.append(HostileCase("q_other_dtype", f"q in {other_dtype}", D, _q_in(other_dtype)))
    if extend:
        cases += [
            HostileCase("extend_negative", "a negative extend length", E, _negative_extend),
            HostileCase("extend_not_summing", "extend lengths not summing to the token count", E, _extend_not_summing),
            HostileCase(
                "extend_device_differs", "device extend lengths other than their host copies", E, _extend_device_differs
            ),
            HostileCase(
                "extend_start_loc_differs", "extend_start_loc other than the lengths' offsets", E, _start_loc_differs
            ),
            HostileCase(
                "extend_fields_missing",
                "an EXTEND batch without extend_seq_lens",
                E,
                _set("extend_seq_lens", lambda e: None),
            ),
            HostileCase(
                "extend_cpu_missing",
                "an EXTEND batch without its host copy",
                E,
                _set("extend_prefix_lens_cpu", lambda e: None),
            ),
            HostileCase(
                "extend_row_negative", "req_pool_indices of -1 (EXTEND)", E, _poke("req_pool_indices", 1, lambda e: -1)
            ),
            HostileCase(
                "extend_slot_foreign",
                "another request's slot (EXTEND)",
                E,
                _poke("out_cache_loc", 0, _first_key_of_request_1),
            ),
            HostileCase(
                "extend_last_slot_past_pool", "the last slot one past the pool (EXTEND)", E, _last_slot_past_pool
            ),
        ]
        if "cross_attention" in feats and encoder_requests:
            enc = (("requests", tuple(encoder_requests)),)
            cases += [
                HostileCase(
                    "encoder_lens_differs",
                    "device encoder_lens other than encoder_lens_cpu",
                    E,
                    _encoder_lens_differs,
                    enc,
                ),
                HostileCase(
                    "encoder_slot_minus_one",
                    "encoder_out_cache_loc of -1",
                    E,
                    _encoder_slot_minus_one,
                    enc + (("cross_attention", True),),
                ),
            ]
        if "cascade" in feats and cascade_prefix:
            casc = (
                ("cascade_prefix", cascade_prefix),
                ("requests", ((cascade_prefix + 3, 2), (cascade_prefix + 1, 1))),
            )
            cases.append(
                HostileCase(
                    "cascade_not_shared", "a cascade prefix the requests do not share", E, _cascade_not_shared, casc
                )
            )
    if verify_mask:
        cases += [
            HostileCase("verify_mask_short", "a verify mask one entry short", V, _short_mask),
            HostileCase(
                "verify_mask_indptr_differs", "mask_indptr other than the masks' offsets", V, _mask_indptr_differs
            ),
        ]
    return cases


def _forward_all(
    backend,
    env: CaseEnv,
    batch,
    q_dtype: Optional[torch.dtype] = None,
    layer_changes: Optional[dict] = None,
    save_kv_cache: bool = True,
    sinks_device: Optional[str] = None,
):
    gen = torch.Generator().manual_seed(env.case.seed + 7)
    for lid in range(env.case.num_layers):
        layer = make_layer(env.case, lid)
        for name, value in (layer_changes or {}).items():
            setattr(layer, name, value)
        inputs = layer_inputs(env, lid, gen, batch)
        if q_dtype is not None:
            inputs["q"] = inputs["q"].to(q_dtype)
        if sinks_device is not None and inputs["sinks"] is not None:
            inputs["sinks"] = torch.zeros(inputs["sinks"].shape, dtype=inputs["sinks"].dtype, device=sinks_device)
        backend.forward(
            inputs["q"], inputs["k"], inputs["v"], layer, batch, save_kv_cache, **forward_extras(env.case, inputs)
        )


def _default_call(backend, env: CaseEnv):
    backend.init_forward_metadata(env.batch)
    return _forward_all(backend, env, env.batch)


def _separate_host_copies(batch) -> None:
    """On a CPU device `x_cpu.to(device)` is `x_cpu` itself: give every host copy its own storage, so a
    spoil that changes one copy does not change the other."""
    for name in ("seq_lens_cpu", "extend_seq_lens_cpu", "extend_prefix_lens_cpu", "encoder_lens_cpu"):
        x = getattr(batch, name)
        if x is not None:
            setattr(batch, name, x.clone())


def clone_batch(batch):
    """A copy of `batch` whose tensors (spec_info's too) have their own storage: a spoil of the batch
    leaves it intact."""

    def c(x):
        return x.clone() if isinstance(x, torch.Tensor) else x

    out = dataclasses.replace(batch, **{f.name: c(getattr(batch, f.name)) for f in dataclasses.fields(batch)})
    if batch.spec_info is not None:
        out.spec_info = dataclasses.replace(
            batch.spec_info,
            **{f.name: c(getattr(batch.spec_info, f.name)) for f in dataclasses.fields(batch.spec_info)},
        )
    return out


def allocator_state(allocator) -> tuple:
    """What an allocator has handed out (its free lists and ownership), to compare before and after a
    step: nothing a step does may change it. Example: a fresh `PagedTokenAllocator(64, 16)` gives
    ((3, 2, 1), <owned mask>, ...)."""
    parts = []
    for a in (
        (getattr(allocator, "full", None), getattr(allocator, "window_alloc", None))
        if hasattr(allocator, "full")
        else (allocator,)
    ):
        parts.append(tuple(getattr(a, "_free_pages", ())))
        owned = getattr(a, "_owned", None)
        parts.append(None if owned is None else owned.clone())
    mapping = getattr(allocator, "full_to_window", None)
    parts.append(None if mapping is None else mapping.clone())
    return tuple(parts)


def _same_state(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def _pool_changed_outside(
    before: list[torch.Tensor], after: list[torch.Tensor], pool, legal: torch.Tensor
) -> list[int]:
    """Slots outside `legal` (the batch's own slots and the dummy 0) whose K/V changed, in either layout."""
    from attn_core.testing.harness import token_major

    bad: set[int] = set()
    for x, y in zip(before, after):
        x, y = token_major(pool, x), token_major(pool, y)
        diff = (
            (torch.nan_to_num(x.double(), nan=12345.0) != torch.nan_to_num(y.double(), nan=12345.0))
            .reshape(x.shape[0], -1)
            .any(-1)
        )
        diff[legal.to(diff.device)] = False
        bad |= set(diff.nonzero().flatten().tolist())
    return sorted(bad)


def _argument_of(exc: BaseException) -> Optional[str]:
    """The argument a typed error names (InvalidArgumentError and DeviceFaultError carry `argument`;
    UnsupportedFeatureError names what is unsupported)."""
    return getattr(exc, "argument", None) or getattr(exc, "what", None)


def _good_step(backend, env: CaseEnv, batch) -> float:
    """A valid step on the same backend after the hostile one: metadata, every layer, the output against
    the float64 reference. Returns the worst relative error (raises KitFailure past the tolerance)."""
    backend.init_forward_metadata(batch)
    gen = torch.Generator().manual_seed(env.case.seed + 11)
    worst, tol = 0.0, tolerance(getattr(torch, env.case.dtype))
    requests = env.case.step_requests()[0]
    for lid in range(env.case.num_layers):
        layer = make_layer(env.case, lid)
        inputs = layer_inputs(env, lid, gen, batch, requests)
        res = layer(inputs["q"], inputs["k"], inputs["v"], batch, **forward_extras(env.case, inputs))
        err, _ = compare_layer(env, layer, inputs, res, batch, requests)
        if not err <= tol:
            raise KitFailure(f"the good step after the hostile one: layer {lid} rel err {err:.3g} (tol {tol:g})")
        worst = max(worst, err)
    return worst


def judge_step(
    env: CaseEnv,
    backend,
    attempt: Callable[[], object],
    where: str,
    clean,
    *,
    next_step: Optional[Callable[[], object]] = None,
    errors: tuple = (AttnError,),
    table_to_restore: Optional[torch.Tensor] = None,
) -> str:
    """Run `attempt` (a hostile step) and judge it (module docstring): it must raise one of `errors` at
    once, naming the argument, with the pool, the table and the allocator unchanged; or, on an
    accelerator at "basic" (never on the CPU, never at "full"), `next_step()` (a good call, after a device
    wait) must raise `DeviceFaultError`, with no K/V written outside `clean`'s slots and the dummy slot.
    Then a good step on `clean` (the table first restored to `table_to_restore`, when given) must match
    the reference. Returns the check's detail line; raises `KitFailure`."""
    legal = [clean.out_cache_loc.to(torch.int64).cpu(), torch.zeros(1, dtype=torch.int64)]
    if clean.encoder_out_cache_loc is not None:
        legal.append(clean.encoder_out_cache_loc.to(torch.int64).cpu())
    r2t = env.req_to_token_pool.req_to_token
    before, table, alloc = _snapshot(env), r2t.clone(), allocator_state(env.allocator)
    late = False
    try:
        try:
            attempt()
        except AttnError:
            raise
        except Exception as exc:
            raise KitFailure(f"{where}: expected a typed AttnError, got {type(exc).__name__}: {exc}") from exc
        if _validation.effective_level(env.ctx) == _validation.FULL or next_step is None:
            changed = "" if _same(before, _snapshot(env)) else " and the KV pool changed"
            raise KitFailure(f"{where}: accepted without an error{changed}")
        late = True  # the default mode on an accelerator: the fault surfaces at the next step, at the latest
        if env.ctx.device.type == "cuda":
            torch.cuda.synchronize()  # what an engine's read of its sampled tokens does
        if table_to_restore is not None:
            r2t.copy_(table_to_restore)
        next_step()
        raise KitFailure(f"{where}: no typed error at the step nor at the next one")
    except AttnError as exc:
        name = type(exc).__name__
        if late and not isinstance(exc, DeviceFaultError):
            raise KitFailure(f"{where}: the next step raised {name} (expected DeviceFaultError): {exc}") from None
        if not late and not isinstance(exc, errors):
            raise KitFailure(f"{where}: expected {[e.__name__ for e in errors]}, got {name}: {exc}") from None
        if not _argument_of(exc):
            raise KitFailure(f"{where}: {name} names no argument: {exc}") from None
        after = _snapshot(env)
        if not late and not _same(before, after):
            raise KitFailure(f"{where}: raised {name} but only after writing to the KV pool") from None
        outside = _pool_changed_outside(before, after, env.kv_pool, torch.cat(legal)) if late else []
        if outside:
            raise KitFailure(f"{where}: K/V written outside the batch's slots {outside[:8]} before {name}") from None
        want = table if not late or table_to_restore is None else table_to_restore
        if not torch.equal(r2t, want):
            raise KitFailure(f"{where}: the request table changed") from None
        if not _same_state(alloc, allocator_state(env.allocator)):
            raise KitFailure(f"{where}: the allocator changed") from None
        message = f"{name}{' (next step)' if late else ''}: {exc}"
    if table_to_restore is not None:
        r2t.copy_(table_to_restore)
    clean.attn_backend = backend
    err = _good_step(backend, env, clean)
    return f"{message}; then a good step: rel err {err:.2g}"


def hostile_check(
    target: KitTarget, case: AttnCase, hostile: HostileCase, validation: str = "full"
) -> Callable[[], str]:
    """A check: build `case` (the context at `validation`), spoil its batch, run one step, judge it
    (`judge_step`; see the module docstring for what passes in each mode)."""

    def run() -> str:
        env = make_env(case)
        if validation != env.ctx.validation:
            env.ctx = dataclasses.replace(env.ctx, validation=validation)
        backend = target.factory(env.ctx)
        env.batch.attn_backend = backend
        _separate_host_copies(env.batch)
        clean = clone_batch(env.batch)
        table = env.req_to_token_pool.req_to_token.clone()
        call = hostile.spoil(env) or _default_call
        where = f"{hostile.what} (validation {validation!r})\n  case: {case.describe()}"
        return judge_step(
            env,
            backend,
            lambda: call(backend, env),
            where,
            clean,
            next_step=lambda: backend.init_forward_metadata(clean),
            table_to_restore=table,
        )

    return run
