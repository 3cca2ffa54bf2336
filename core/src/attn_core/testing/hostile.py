"""The conformance kit's "hostile batch" section: batches a careless or buggy engine could hand a backend
(rows and slots out of range, negative or inconsistent lengths, host copies that disagree with the device,
duplicate / zero / foreign `out_cache_loc`, stale metadata, wrong int widths, q in another dtype). Each
must give a typed error (`AttnError`) with every layer's K and V buffers bit-identical to before: nothing
may be written, read out of bounds or silently computed from a broken batch.

A case is a name, a mode and a `spoil(env)` that breaks the freshly built batch (or the request table)
of a valid case; the check then runs the engine's calls for one step — `init_forward_metadata(batch)`
and `forward` on every layer — under the kit's validation "full".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from attn_core.errors import AttnError
from attn_core.forward_mode import ForwardMode
from attn_core.testing.harness import AttnCase, CaseEnv, forward_extras, layer_inputs, make_env, make_layer
from attn_core.testing.negative import _same, _snapshot
from attn_core.testing.outcome import KitFailure
from attn_core.testing.target import KitTarget

Spoil = Callable[[CaseEnv], Optional[Callable]]


@dataclass(frozen=True)
class HostileCase:
    """`spoil(env)` breaks env.batch in place; it may return `call(backend, env)` replacing the default
    step (metadata, then every layer's forward)."""

    name: str
    what: str
    mode: ForwardMode
    spoil: Spoil


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


def hostile_cases(decode: bool, extend: bool, verify_mask: bool, other_dtype: Optional[str]) -> list[HostileCase]:
    """The cases for a backend running DECODE (`decode`), EXTEND (`extend`), TARGET_VERIFY with custom
    masks (`verify_mask`), whose context dtype differs from `other_dtype` (a torch dtype name)."""
    D, E, V = ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY
    cases = []
    if decode:
        cases += [
            HostileCase("row_negative", "req_pool_indices of -1", D, _poke("req_pool_indices", 0, lambda e: -1)),
            HostileCase("row_past_table", "req_pool_indices one past the table", D, _poke("req_pool_indices", 1, _rows)),
            HostileCase("row_huge", "req_pool_indices of 10**6", D, _poke("req_pool_indices", 0, lambda e: 10**6)),
            HostileCase("seq_lens_past_table", "a seq_len past the req_to_token width", D, lambda e: _set_len(e, 0, _width(e) + 1)),
            HostileCase("seq_lens_zero_decode", "a DECODE seq_len of 0", D, lambda e: _set_len(e, 1, 0)),
            HostileCase("seq_lens_int64", "int64 seq_lens", D, _seq_lens_int64),
            HostileCase("seq_lens_device_differs", "device seq_lens longer than seq_lens_cpu", D, _device_seq_len_longer),
            HostileCase("seq_lens_sum_short", "seq_lens_sum smaller than the lengths", D, _host_sum_short),
            HostileCase("slot_minus_one", "out_cache_loc of -1", D, _poke("out_cache_loc", 0, lambda e: -1)),
            HostileCase("slot_zero", "out_cache_loc of the dummy slot 0", D, _poke("out_cache_loc", 0, lambda e: 0)),
            HostileCase("slot_past_pool", "out_cache_loc one past the pool", D, _poke("out_cache_loc", 0, lambda e: e.kv_pool.num_slots)),
            HostileCase("slot_duplicate", "two tokens writing one slot", D, _poke("out_cache_loc", 1, _first_slot)),
            HostileCase("slot_foreign", "out_cache_loc of another request's key", D, _poke("out_cache_loc", 1, _first_key_of_request_0)),
            HostileCase("table_slot_past_pool", "a req_to_token slot past the pool", D, _table_slot_past_pool),
            HostileCase("key_never_written", "seq_lens covering a key the engine never wrote", D, _unwritten_key),
            HostileCase("stale_other_batch", "forward with a batch other than the metadata's", D, _other_batch),
            HostileCase("stale_no_metadata", "forward before any init_forward_metadata", D, _no_metadata),
            HostileCase("stale_previous_step", "forward on the previous step's batch", D, _metadata_of_another_step),
        ]
        if other_dtype is not None:
            cases.append(HostileCase("q_other_dtype", f"q in {other_dtype}", D, _q_in(other_dtype)))
    if extend:
        cases += [
            HostileCase("extend_negative", "a negative extend length", E, _negative_extend),
            HostileCase("extend_not_summing", "extend lengths not summing to the token count", E, _extend_not_summing),
            HostileCase("extend_fields_missing", "an EXTEND batch without extend_seq_lens", E, _set("extend_seq_lens", lambda e: None)),
            HostileCase("extend_cpu_missing", "an EXTEND batch without its host copy", E, _set("extend_prefix_lens_cpu", lambda e: None)),
            HostileCase("extend_row_negative", "req_pool_indices of -1 (EXTEND)", E, _poke("req_pool_indices", 1, lambda e: -1)),
            HostileCase("extend_slot_foreign", "another request's slot (EXTEND)", E, _poke("out_cache_loc", 0, _first_key_of_request_1)),
        ]
    if verify_mask:
        cases.append(HostileCase("verify_mask_short", "a verify mask one entry short", V, _short_mask))
    return cases


def _forward_all(backend, env: CaseEnv, batch, q_dtype: Optional[torch.dtype] = None):
    gen = torch.Generator().manual_seed(env.case.seed + 7)
    for lid in range(env.case.num_layers):
        layer = make_layer(env.case, lid)
        inputs = layer_inputs(env, lid, gen)
        if q_dtype is not None:
            inputs["q"] = inputs["q"].to(q_dtype)
        backend.forward(inputs["q"], inputs["k"], inputs["v"], layer, batch, True, **forward_extras(env.case, inputs))


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


def hostile_check(target: KitTarget, case: AttnCase, hostile: HostileCase) -> Callable[[], str]:
    """A check: build `case`, spoil its batch, run one step; a typed error with the pool unchanged passes."""

    def run() -> str:
        env = make_env(case)
        backend = target.factory(env.ctx)
        env.batch.attn_backend = backend
        _separate_host_copies(env.batch)
        call = hostile.spoil(env) or _default_call
        before = _snapshot(env)
        where = f"{hostile.what}\n  case: {case.describe()}"
        try:
            call(backend, env)
        except AttnError as exc:
            if not _same(before, _snapshot(env)):
                raise KitFailure(f"{where}: raised {type(exc).__name__} but only after writing to the KV pool") from None
            return f"{type(exc).__name__}: {exc}"
        except Exception as exc:
            raise KitFailure(f"{where}: expected a typed AttnError, got {type(exc).__name__}: {exc}") from exc
        changed = "" if _same(before, _snapshot(env)) else " and the KV pool changed"
        raise KitFailure(f"{where}: accepted without an error{changed}")

    return run
