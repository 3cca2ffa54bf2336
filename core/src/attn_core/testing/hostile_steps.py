"""The hostile section's engine-path part: bad input through the other entry points an engine uses, in the
default validation mode ("basic"; the CPU validates fully at any level):

- `stale_freed_request`: a `build_step` batch run after one of its requests was freed -> `StaleRequestError`;
- `graph_run_*` (a backend with CUDA graphs for DECODE): `CudaGraphRunner.run` with a slot of -1, a request
  row past the table, a seq_len past the table's width;
- `graph_verify_drafts` (graphs for TARGET_VERIFY): a verify graph captured for one draft count run with
  another -> `GraphShapeError`;
- `graph_replay_unknown_bs`: SGLang's replay entry point with a batch size never captured -> `GraphShapeError`;
- `draft_row_negative`: `MultiStepDraftBackend` with a request row of -1.

Each passes like a hostile case of `attn_core.testing.hostile`: a typed error naming the argument at once
(on a GPU, for device-side faults: `DeviceFaultError` at the next step at the latest), no K/V outside the
batch's slots, the table and the allocator unchanged, then a good step matching the reference.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from attn_core.contract.capabilities import ARCH_MHA, CudaGraphLevel, Feature
from attn_core.contract.errors import AttnError, GraphShapeError, StaleRequestError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.engine.graph_runner import CudaGraphRunner
from attn_core.testing.harness import AttnCase, CaseEnv, make_env, make_layer
from attn_core.testing.hostile import _separate_host_copies, clone_batch, judge_step
from attn_core.testing.outcome import KitFailure
from attn_core.testing.target import KitTarget

Check = Callable[[KitTarget, AttnCase], Callable[[], str]]


def _basic_env(case: AttnCase) -> CaseEnv:
    env = make_env(case)
    env.ctx = dataclasses.replace(env.ctx, validation="basic")
    _separate_host_copies(env.batch)
    return env


def _run_layers(case: AttnCase) -> Callable:
    layers = [make_layer(case, lid) for lid in range(case.num_layers)]

    def run_layers(batch, inputs):
        out = None
        for layer in layers:
            out = layer(inputs["q"], inputs["k"], inputs["v"], batch)
        return out

    return run_layers


def _inputs(env: CaseEnv, batch) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(env.case.seed + 5)
    c, pool = env.case, env.kv_pool
    dt, dev, T = getattr(torch, c.dtype), pool.device, batch.num_tokens
    shapes = {
        "q": (c.num_q_heads, pool.head_dim),
        "k": (pool.head_num, pool.head_dim),
        "v": (pool.head_num, pool.v_head_dim),
    }
    return {n: torch.randn(T, *s, generator=gen).to(dt).to(dev) for n, s in shapes.items()}


def _runner(backend, env: CaseEnv, bs: int, num_draft_tokens: Optional[int] = None) -> CudaGraphRunner:
    c, pool, dt = env.case, env.kv_pool, getattr(torch, env.case.dtype)
    shapes = {
        "q": ((c.num_q_heads, pool.head_dim), dt),
        "k": ((pool.head_num, pool.head_dim), dt),
        "v": ((pool.head_num, pool.v_head_dim), dt),
    }
    return CudaGraphRunner(backend, [bs], _run_layers(c), shapes, num_draft_tokens=num_draft_tokens)


def _expect(env: CaseEnv, backend, attempt, what: str, errors=(AttnError,), next_step=None, clean=None) -> str:
    """`attn_core.testing.hostile.judge_step` of `attempt` (a good step on `clean`, default a copy of the
    env's batch, follows)."""
    clean = clone_batch(env.batch) if clean is None else clean
    where = f"{what}\n  case: {env.case.describe()}"
    return judge_step(env, backend, attempt, where, clean, next_step=next_step, errors=errors)


def stale_request_check(target: KitTarget, case: AttnCase) -> Callable[[], str]:
    """A `build_step` batch whose request was freed before it ran."""

    def run() -> str:
        from attn_core.engine.requests import RequestPool
        from attn_core.engine.step_builder import build_step
        from attn_core.memory import MHATokenToKVPool, PagedTokenAllocator, ReqToTokenPool

        env = _basic_env(case)
        ps, pool = case.page_size, env.kv_pool
        rows = ReqToTokenPool(4, 8 * ps, env.ctx.device)
        kv = MHATokenToKVPool(
            16 * ps, ps, pool.dtype, pool.head_num, pool.head_dim, 1, env.ctx.device, pool.v_head_dim, pool.kv_layout
        )
        requests = RequestPool(rows, PagedTokenAllocator(16 * ps, ps), kv)
        ctx = dataclasses.replace(
            env.ctx,
            req_to_token_pool=rows,
            token_to_kv_pool=kv,
            max_context_len=8 * ps,
            forward_modes=frozenset({ForwardMode.DECODE}),
        )
        backend = target.factory(ctx)
        a, b = requests.add(), requests.add()
        requests.extend([a, b], [3, 2])  # cached tokens (their K/V do not matter here)
        batch = build_step(requests, [(a, 1), (b, 1)], attn_backend=backend)
        requests.free(b)
        before = [kv.get_key_buffer(0).clone(), kv.get_value_buffer(0).clone()]
        try:
            backend.init_forward_metadata(batch)
        except StaleRequestError as exc:
            after = [kv.get_key_buffer(0), kv.get_value_buffer(0)]
            if not all(torch.equal(x.nan_to_num(1.0), y.nan_to_num(1.0)) for x, y in zip(before, after)):
                raise KitFailure("a stale batch wrote to the KV pool") from None
            return f"{type(exc).__name__}: {exc}"
        raise KitFailure(
            f"a batch run after one of its requests was freed: no StaleRequestError\n  case: {case.describe()}"
        )

    return run


def _graph_check(spoil: Callable[[CaseEnv], None], what: str) -> Check:
    """CudaGraphRunner.run of the case's DECODE batch spoiled by `spoil` (captured for its batch size)."""

    def check(target: KitTarget, case: AttnCase) -> Callable[[], str]:
        def run() -> str:
            env = _basic_env(case)
            backend = target.factory(env.ctx)
            bs = env.batch.batch_size
            runner = _runner(backend, env, bs)
            inputs = _inputs(env, env.batch)
            clean = clone_batch(env.batch)
            table = env.req_to_token_pool.req_to_token.clone()
            spoil(env)

            def next_step():
                env.req_to_token_pool.req_to_token.copy_(table)
                runner.run(clean, _inputs(env, clean))

            return _expect(
                env, backend, lambda: runner.run(env.batch, inputs), what, next_step=next_step, clean=clone_batch(clean)
            )

        return run

    return check


def _slot_minus_one(env: CaseEnv) -> None:
    env.batch.out_cache_loc[0] = -1


def _row_past_table(env: CaseEnv) -> None:
    env.batch.req_pool_indices[1] = env.req_to_token_pool.req_to_token.shape[0]


def _seq_past_table(env: CaseEnv) -> None:
    from attn_core.testing.hostile import _set_len

    _set_len(env, 0, env.req_to_token_pool.req_to_token.shape[1] + 1)


def verify_drafts_check(target: KitTarget, case: AttnCase) -> Callable[[], str]:
    """A TARGET_VERIFY graph captured for one draft count fewer than the batch carries."""

    def run() -> str:
        env = _basic_env(case)
        backend = target.factory(env.ctx)
        nd = env.batch.spec_info.num_draft_tokens
        runner = _runner(backend, env, env.batch.batch_size, num_draft_tokens=nd - 1)
        inputs = {
            n: x[: env.batch.batch_size * (nd - 1)] for n, x in _inputs(env, env.batch).items()
        }  # the captured shape
        return _expect(
            env,
            backend,
            lambda: runner.run(env.batch, inputs),
            f"a verify graph of {nd - 1} drafts run with {nd}",
            errors=(GraphShapeError,),
        )

    return run


def replay_unknown_bs_check(target: KitTarget, case: AttnCase) -> Callable[[], str]:
    """SGLang's replay entry point with a batch size that was never captured."""

    def run() -> str:
        env = _basic_env(case)
        backend = target.factory(env.ctx)
        bs = env.batch.batch_size
        _runner(backend, env, bs)  # captures bs
        rows = torch.zeros(bs + 1, dtype=torch.int64, device=env.ctx.device)
        lens = torch.ones(bs + 1, dtype=torch.int32, device=env.ctx.device)

        def attempt():
            backend.init_forward_metadata_replay_cuda_graph(
                bs + 1, rows, lens, bs + 1, None, ForwardMode.DECODE, None, torch.ones(bs + 1, dtype=torch.int32)
            )

        return _expect(
            env, backend, attempt, f"a graph replay of {bs + 1} requests (captured: {bs})", errors=(GraphShapeError,)
        )

    return run


def draft_row_check(target: KitTarget, case: AttnCase) -> Callable[[], str]:
    """MultiStepDraftBackend with a request row of -1 (a draft round of one step, topk 1)."""

    def run() -> str:
        from attn_core.wrappers.multi_step_draft import MultiStepDraftBackend, allocate_draft_slots

        env = _basic_env(dataclasses.replace(case, requests=((case.requests[0].prefix_len, 1), (3, 1))))
        backend = target.factory(env.ctx)
        draft = MultiStepDraftBackend(lambda ctx, s: target.factory(ctx), 1, 1, env.ctx)
        b = env.batch
        rows, lens = b.req_pool_indices.cpu().tolist(), b.seq_lens_cpu.tolist()
        loc = allocate_draft_slots(env.allocator, env.req_to_token_pool, rows, lens, 1, 1).to(env.ctx.device)
        bad_rows = b.req_pool_indices.clone()
        bad_rows[0] = -1

        def call(rpi):
            return draft.init_forward_metadata(rpi, b.seq_lens, loc, b.seq_lens_cpu)

        def attempt():
            call(bad_rows)

        result = _expect(
            env, backend, attempt, "a draft round with a request row of -1", next_step=lambda: call(b.req_pool_indices)
        )
        return result

    return run


def engine_path_checks(target: KitTarget, caps, modes) -> list[tuple[str, str, ForwardMode, Check]]:
    """(name, what, mode, check) of the engine-path cases the backend's capabilities reach."""
    D, V = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY
    out: list[tuple[str, str, ForwardMode, Check]] = []
    mha = ARCH_MHA in caps.archs
    if D in modes and mha:
        out.append(("stale_freed_request", "a batch run after one of its requests was freed", D, stale_request_check))
    if D in modes and mha and caps.cuda_graph >= CudaGraphLevel.UNIFORM_SINGLE_TOKEN_DECODE:
        out += [
            (
                "graph_run_slot_minus_one",
                "CudaGraphRunner.run with out_cache_loc -1",
                D,
                _graph_check(_slot_minus_one, "graph run, slot -1"),
            ),
            (
                "graph_run_row_past_table",
                "CudaGraphRunner.run with a row past the table",
                D,
                _graph_check(_row_past_table, "graph run, row past the table"),
            ),
            (
                "graph_run_seq_past_table",
                "CudaGraphRunner.run with a seq_len past the table width",
                D,
                _graph_check(_seq_past_table, "graph run, seq_len past the table"),
            ),
            ("graph_replay_unknown_bs", "a graph replay of a batch size never captured", D, replay_unknown_bs_check),
        ]
    if V in modes and mha and caps.cuda_graph >= CudaGraphLevel.UNIFORM_BATCH and caps.supports(Feature.CUSTOM_MASK):
        out.append(("graph_verify_drafts", "a verify graph replayed with another draft count", V, verify_drafts_check))
    if D in modes and mha:
        out.append(("draft_row_negative", "MultiStepDraftBackend with a request row of -1", D, draft_row_check))
    return out


__all__ = ["engine_path_checks"]
