"""DCP decode and verify attention on 2 and 3 gloo ranks (spawned CPU processes, `attn_core.testing.distributed`)
against a float64 attention over each request's whole KV, written plainly.

Every rank runs the same schedule over several steps of the same requests: prompts (EXTEND: only the
K/V is stored, each token on its rank; prefill attention is not sharded), decode steps, a request
arriving mid-run, lengths that are not multiples of the interleave size, a request shorter than one
block (no key on the other ranks). KV pools are poisoned with NaN first.

The graph checks drive the same schedule twice on every rank, on two sets of pools: the eager path
(`build_dcp_step`, `dcp_decode_attention`) and graph-shaped steps through `attn_core.CudaGraphRunner`
(captured once per batch size, replayed every decode step with the new K/V written inside the graph;
on a CPU the runner runs the same metadata calls and the layers eagerly on its static buffers). Every
step's graph output must equal the eager output and the reference."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

from attn_core.testing.distributed import RankFailure, run_ranks

HERE = Path(__file__).resolve()
HKV, HQ_PER_RANK, PAGE = 2, 2, 4
HEAD_DIM = {"flashinfer": 64}  # FlashInfer's MHA kernels take 64, 128, 256; the others run 16


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 attention of one query `[Hq, D]` over keys/values `[L, Hkv, D]`: `[Hq, D]`."""
    group = q.shape[0] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(q.shape[0]):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        w = torch.softmax(kh @ q[h].double() * q.shape[-1] ** -0.5, dim=0)
        out[h] = w @ vh
    return out


def dcp_worker(
    rank: int,
    world: int,
    seed: int,
    configs: list[tuple[str, str, bool, str]],
    device: str = "cpu",
    dtype_name: str = "float32",
) -> list[float]:
    """Each (backend, exchange, q_heads_sharded, check) of `configs` in turn, in the same processes (one
    spawn); check is "eager" (`dcp_check`), "graph" (`dcp_graph_check`), "verify" (`dcp_verify_check`) or
    "verify_rows" (the same with DECODE rows only)."""
    checks = {
        "eager": dcp_check,
        "graph": dcp_graph_check,
        "verify": dcp_verify_check,
        "verify_rows": functools.partial(dcp_verify_check, verify_masks=False),
    }
    return [
        checks[config[3]](rank, world, seed + i, *config[:3], device, dtype_name) for i, config in enumerate(configs)
    ]


class RankSetup:
    """One rank's pools, backend and layer for a check (KV poisoned with NaN)."""

    def __init__(self, rank: int, world: int, backend: str, device: str, dtype: torch.dtype, graphs: bool = False):
        import attn_core as ac
        from attn_core.dcp import DcpLayout, DcpRequestPool

        self.hq, self.D = HQ_PER_RANK * world, HEAD_DIM.get(backend, 16)
        slots = 128
        kv = ac.MHATokenToKVPool(
            size=slots, page_size=PAGE, dtype=dtype, head_num=HKV, head_dim=self.D, layer_num=1, device=device
        )
        for buf in (kv.get_key_buffer(0), kv.get_value_buffer(0)):
            buf.fill_(float("nan"))
        rows = ac.ReqToTokenPool(size=8, max_context_len=64, device=device)
        self.pool = DcpRequestPool(
            ac.RequestPool(rows, ac.PagedTokenAllocator(slots, PAGE), kv), DcpLayout(world, PAGE), rank
        )
        ctx = ac.BackendContext(
            device=device,
            dtype=dtype,
            num_q_heads=self.hq,
            num_kv_heads=HKV,
            head_dim=self.D,
            page_size=PAGE,
            max_batch_size=8,
            max_context_len=64,
            req_to_token_pool=rows,
            token_to_kv_pool=kv,
            forward_modes={"decode"},
            features={ac.Feature.LSE_OUTPUT},
            validation="full",
            cuda_graph=ac.CudaGraphLevel.UNIFORM_BATCH if graphs else ac.CudaGraphLevel.NEVER,
        )
        self.attn = ac.create_backend(backend, ctx)
        self.layer = ac.AttentionLayer(0, self.hq, HKV, self.D)


def dcp_check(
    rank: int, world: int, seed: int, backend: str, exchange: str, sharded: bool, device: str, dtype_name: str
) -> float:
    import attn_core as ac
    from attn_core.dcp import build_dcp_step, dcp_decode_attention

    dtype = getattr(torch, dtype_name)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    if device == "cuda":
        device = f"cuda:{rank}"
    setup = RankSetup(rank, world, backend, device, dtype)
    pool, attn, layer, hq, D = setup.pool, setup.attn, setup.layer, setup.hq, setup.D

    g = torch.Generator().manual_seed(seed)  # the same data on every rank
    prompts = [int(torch.randint(1, 14, (1,), generator=g)) for _ in range(4)]
    prompts[1] = 3  # shorter than one block: no key on ranks > 0
    keys = [torch.randn(40, HKV, D, generator=g).to(dtype) for _ in prompts]
    values = [torch.randn(40, HKV, D, generator=g).to(dtype) for _ in prompts]
    reqs, lens = [], []
    worst = 0.0

    def prefill(i: int) -> None:
        reqs.append(pool.add())
        lens.append(prompts[i])
        step = build_dcp_step(pool, [(reqs[i], prompts[i])], attn_backend=attn)
        step.save_kv(layer, keys[i][: prompts[i]].to(device), values[i][: prompts[i]].to(device))
        return step

    steps = [prefill(i) for i in range(3)]
    h_rank = HQ_PER_RANK if sharded else hq
    expect_error(
        ac.InvalidArgumentError,
        dcp_decode_attention,
        torch.zeros(prompts[2], h_rank, D, dtype=dtype, device=device),
        layer,
        steps[2],
        exchange=exchange,
        q_heads_sharded=sharded,
    )  # an EXTEND step
    for t in range(4):
        if t == 2:
            prefill(3)  # arrives mid-run
        work = [(r, 1) for r in reqs]
        step = build_dcp_step(pool, work, attn_backend=attn)
        assert step.forward_mode.is_decode()
        new_k = torch.stack([keys[i][lens[i]] for i in range(len(reqs))])
        new_v = torch.stack([values[i][lens[i]] for i in range(len(reqs))])
        step.save_kv(layer, new_k.to(device), new_v.to(device))
        lens = [n + 1 for n in lens]
        step.init_forward_metadata()
        q = torch.randn(len(reqs), hq, D, generator=g).to(dtype)
        mine = slice(rank * HQ_PER_RANK, (rank + 1) * HQ_PER_RANK) if sharded else slice(0, hq)
        if t == 0:  # bad calls raise a typed error on every rank before any collective (none may hang)
            good = dict(q=q[:, mine].contiguous().to(device), exchange=exchange, q_heads_sharded=sharded)
            for bad in (dict(exchange="ring"), dict(q=good["q"][:, :1]), dict(q=good["q"][:1])):
                kw = good | bad
                expect_error(ac.InvalidArgumentError, dcp_decode_attention, kw.pop("q"), layer, step, **kw)
        out = dcp_decode_attention(
            q[:, mine].contiguous().to(device), layer, step, exchange=exchange, q_heads_sharded=sharded
        )
        for i in range(len(reqs)):
            want = reference(q[i], keys[i][: lens[i]], values[i][: lens[i]])[mine]
            got = out[i].view(-1, D).double().cpu()
            assert torch.isfinite(got).all(), (rank, t, i)
            err = float((got - want).abs().max())
            assert err < tol, (rank, t, i, err)
            worst = max(worst, err)
    return worst


#: the verify check's schedule: k drafts per TARGET_VERIFY step, 0 for a decode step
VERIFY_STEPS = (1, 0, 3, 4, 0, 2, 1)
#: the verify step before which a fifth request (2 tokens) arrives
VERIFY_ARRIVAL = 3


def dcp_verify_check(
    rank: int,
    world: int,
    seed: int,
    backend: str,
    exchange: str,
    sharded: bool,
    device: str,
    dtype_name: str,
    verify_masks: bool = True,
) -> list[tuple[str, bool]]:
    """Verify and decode steps of the same requests (module docstring) against the float64 reference;
    `verify_masks` as `build_dcp_step` takes it (a local TARGET_VERIFY batch where the backend takes
    custom masks, or DECODE rows only). Returns the (local batch mode, several parts in the step) pairs
    this rank ran, for the test to check that every kind of local part ran on some rank."""
    import attn_core as ac
    from attn_core.dcp import build_dcp_step, dcp_attention, dcp_decode_attention

    dtype = getattr(torch, dtype_name)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    if device == "cuda":
        device = f"cuda:{rank}"
    setup = RankSetup(rank, world, backend, device, dtype)
    pool, attn, layer, hq, D = setup.pool, setup.attn, setup.layer, setup.hq, setup.D
    mine = slice(rank * HQ_PER_RANK, (rank + 1) * HQ_PER_RANK) if sharded else slice(0, hq)
    g = torch.Generator().manual_seed(seed)  # the same data on every rank
    prompts = [int(torch.randint(1, 14, (1,), generator=g)) for _ in range(5)]
    prompts[1], prompts[4] = 3, 2  # shorter than one block: no key on ranks > 0 until it grows
    keys = [torch.randn(48, HKV, D, generator=g).to(dtype) for _ in prompts]
    values = [torch.randn(48, HKV, D, generator=g).to(dtype) for _ in prompts]
    reqs, lens = [], []

    def prefill(i: int) -> None:
        reqs.append(pool.add())
        lens.append(prompts[i])
        step = build_dcp_step(pool, [(reqs[i], prompts[i])], attn_backend=attn)
        step.save_kv(layer, keys[i][: prompts[i]].to(device), values[i][: prompts[i]].to(device))

    for i in range(4):
        prefill(i)
    expect_error(ac.InvalidArgumentError, build_dcp_step, pool, [(reqs[0], 2), (reqs[1], 3)], mode="target_verify")
    expect_error(ac.InvalidArgumentError, build_dcp_step, pool, [(r, 2) for r in reqs], mode="draft_extend")
    expect_error(ac.InvalidArgumentError, pool.truncate, reqs[0], lens[0] + 1)
    assert [pool.kv_len(r) for r in reqs] == lens  # nothing allocated by the refused calls
    kinds = set()
    for t, k in enumerate(VERIFY_STEPS):
        if t == VERIFY_ARRIVAL:
            prefill(4)  # arrives mid-run with fewer local keys than drafts: DECODE rows beside a verify batch
        n = max(k, 1)
        step = build_dcp_step(
            pool,
            [(r, n) for r in reqs],
            attn_backend=attn,
            mode="target_verify" if k else None,
            verify_masks=verify_masks,
        )
        kinds.update((b.forward_mode.name, len(step.local_parts) > 1) for _, b in step.local_parts)
        assert step.forward_mode == (ac.ForwardMode.TARGET_VERIFY if k else ac.ForwardMode.DECODE)
        new_k = torch.cat([keys[i][lens[i] : lens[i] + n] for i in range(len(reqs))]).to(device)
        new_v = torch.cat([values[i][lens[i] : lens[i] + n] for i in range(len(reqs))]).to(device)
        step.save_kv(layer, new_k, new_v)
        step.init_forward_metadata()
        q = torch.randn(len(reqs) * n, hq, D, generator=g).to(dtype)
        q_mine = q[:, mine].contiguous().to(device)
        if t == 0:  # typed errors on every rank before any collective
            expect_error(
                ac.InvalidArgumentError,
                dcp_attention,
                q_mine[:1],
                layer,
                step,
                exchange=exchange,
                q_heads_sharded=sharded,
            )
            expect_error(
                ac.InvalidArgumentError,
                dcp_decode_attention,
                q_mine,
                layer,
                step,
                exchange=exchange,
                q_heads_sharded=sharded,
            )
        out = dcp_attention(q_mine, layer, step, exchange=exchange, q_heads_sharded=sharded).double().cpu()
        for i in range(len(reqs)):
            for j in range(n):
                row = i * n + j
                want = reference(q[row], keys[i][: lens[i] + j + 1], values[i][: lens[i] + j + 1])[mine]
                got = out[row].view(-1, D)
                assert torch.isfinite(got).all(), (rank, t, i, j)
                err = float((got - want).abs().max())
                assert err < tol, (rank, t, i, j, err)
        accepted = [int(torch.randint(1, n + 1, (1,), generator=g)) for _ in reqs]
        for i, r in enumerate(reqs):
            lens[i] += accepted[i]
            pool.truncate(r, lens[i])  # reject the rest: the next step rewrites those positions with new values
            keys[i][lens[i] :] = torch.randn(48 - lens[i], HKV, D, generator=g).to(dtype)
            values[i][lens[i] :] = torch.randn(48 - lens[i], HKV, D, generator=g).to(dtype)
    if verify_masks:
        tree_step(pool, attn, layer, reqs, lens, keys, values, g, mine, exchange, sharded, device, dtype, tol)
    return sorted(kinds)


def random_tree(k: int, g: torch.Generator) -> torch.Tensor:
    """bool `[k, k]`: a random draft tree, entry (j, m) True where draft m is draft j or one of its
    ancestors (draft m's parent is a random earlier draft or the cached prefix)."""
    tree = torch.eye(k, dtype=torch.bool)
    for m in range(1, k):
        parent = int(torch.randint(-1, m, (1,), generator=g))
        if parent >= 0:
            tree[m] |= tree[parent]
    return tree


def tree_step(pool, attn, layer, reqs, lens, keys, values, g, mine, exchange, sharded, device, dtype, tol) -> None:
    """A TARGET_VERIFY step of 3 drafts with random tree masks over the requests that have 3 keys on every
    rank (refused with a typed error while the step holds one that has not, a new request of 1 token),
    then the drafts rejected."""
    import attn_core as ac
    from attn_core.dcp import build_dcp_step, dcp_attention

    k, layout = 3, pool.layout
    new = pool.add()  # one token: fewer than k keys on rank 1 even with its drafts
    one = torch.randn(1, layer.num_kv_heads, layer.head_dim, generator=g).to(dtype).to(device)
    build_dcp_step(pool, [(new, 1)], attn_backend=attn).save_kv(layer, one, one)
    trees = [random_tree(k, g) for _ in reqs]
    expect_error(
        ac.InvalidArgumentError,
        build_dcp_step,
        pool,
        [(r, k) for r in reqs + [new]],
        attn_backend=attn,
        mode="target_verify",
        draft_masks=trees + [torch.eye(k, dtype=torch.bool)],
    )
    pool.free(new)
    every_rank = [min(int(layout.local_lens(torch.tensor(n + k), r)) for r in range(layout.world)) >= k for n in lens]
    assert any(every_rank)
    expect_error(
        ac.InvalidArgumentError,
        build_dcp_step,
        pool,
        [(reqs[0], k)],
        attn_backend=attn,
        mode="target_verify",
        draft_masks=[~trees[0]],
    )
    assert [pool.kv_len(r) for r in reqs] == lens  # nothing allocated by the refused calls
    chosen = [i for i, ok in enumerate(every_rank) if ok]
    step = build_dcp_step(
        pool,
        [(reqs[i], k) for i in chosen],
        attn_backend=attn,
        mode="target_verify",
        draft_masks=[trees[i] for i in chosen],
    )
    step.save_kv(
        layer,
        torch.cat([keys[i][lens[i] : lens[i] + k] for i in chosen]).to(device),
        torch.cat([values[i][lens[i] : lens[i] + k] for i in chosen]).to(device),
    )
    step.init_forward_metadata()
    q = torch.randn(len(chosen) * k, layer.num_q_heads, layer.head_dim, generator=g).to(dtype)
    out = (
        dcp_attention(q[:, mine].contiguous().to(device), layer, step, exchange=exchange, q_heads_sharded=sharded)
        .double()
        .cpu()
    )
    for row, (i, j) in enumerate((i, j) for i in chosen for j in range(k)):
        seen = list(range(lens[i])) + [lens[i] + m for m in range(k) if trees[i][j, m]]
        want = reference(q[row], keys[i][seen], values[i][seen])[mine]
        err = float((out[row].view(-1, layer.head_dim) - want).abs().max())
        assert err < tol, (i, j, err)
    for i in chosen:
        pool.truncate(reqs[i], lens[i])


#: the graph check's captured batch sizes and schedule: decode steps, and the step each request arrives
#: at (0: prefilled before the first decode); 2, 3 then 4 requests run in the graphs of 2, 4 and 4
GRAPH_SIZES, GRAPH_STEPS, GRAPH_ARRIVALS = (2, 4), 6, (0, 0, 1, 3)


def dcp_graph_check(
    rank: int, world: int, seed: int, backend: str, exchange: str, sharded: bool, device: str, dtype_name: str
) -> float:
    """The schedule on eager pools and on graph-shaped steps through a `CudaGraphRunner` (module docstring)."""
    import attn_core as ac
    from attn_core.dcp import DCP_GRAPH_INPUTS, DcpStep, build_dcp_step, dcp_decode_attention

    dtype = getattr(torch, dtype_name)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    if device == "cuda":
        device = f"cuda:{rank}"
    eager, graph = (
        RankSetup(rank, world, backend, device, dtype),
        RankSetup(rank, world, backend, device, dtype, graphs=True),
    )
    layer, hq, D = graph.layer, graph.hq, graph.D
    h_rank = HQ_PER_RANK if sharded else hq
    mine = slice(rank * HQ_PER_RANK, (rank + 1) * HQ_PER_RANK) if sharded else slice(0, hq)

    def run_layers(batch, x):
        step = DcpStep.from_graph_batch(batch, x)
        step.save_kv(layer, x["k"], x["v"])  # inside the graph: every row, tokens stored elsewhere into slot 0
        return dcp_decode_attention(x["q"], layer, step, exchange=exchange, q_heads_sharded=sharded)

    shapes = {"q": ((h_rank, D), dtype), "k": ((HKV, D), dtype), "v": ((HKV, D), dtype), **DCP_GRAPH_INPUTS}
    runner = ac.CudaGraphRunner(graph.attn, GRAPH_SIZES, run_layers, shapes)  # captures every size now, on every rank
    assert runner.use_cuda_graph == device.startswith("cuda")

    g = torch.Generator().manual_seed(seed)  # the same data on every rank
    n = len(GRAPH_ARRIVALS)
    prompts = [int(torch.randint(1, 14, (1,), generator=g)) for _ in range(n)]
    prompts[1] = 3  # shorter than one block: no key on ranks > 0 until it grows
    keys = [torch.randn(40, HKV, D, generator=g).to(dtype) for _ in prompts]
    values = [torch.randn(40, HKV, D, generator=g).to(dtype) for _ in prompts]
    reqs, lens = {"eager": [], "graph": []}, []
    worst = 0.0

    def prefill(i: int) -> None:
        lens.append(prompts[i])
        for name, s in (("eager", eager), ("graph", graph)):
            reqs[name].append(s.pool.add())
            step = build_dcp_step(s.pool, [(reqs[name][i], prompts[i])], attn_backend=s.attn)
            step.save_kv(layer, keys[i][: prompts[i]].to(device), values[i][: prompts[i]].to(device))

    for t in range(GRAPH_STEPS):
        for i in range(n):
            if GRAPH_ARRIVALS[i] == t:
                prefill(i)
        bs = len(lens)
        new_k = torch.stack([keys[i][lens[i]] for i in range(bs)]).to(device)
        new_v = torch.stack([values[i][lens[i]] for i in range(bs)]).to(device)
        q = torch.randn(bs, hq, D, generator=g).to(dtype)
        q_mine = q[:, mine].contiguous().to(device)
        if t == 0:
            check_graph_step_errors(RankSetup(rank, world, backend, device, dtype), q_mine, exchange, sharded)
        ref_step = build_dcp_step(eager.pool, [(r, 1) for r in reqs["eager"]], attn_backend=eager.attn)
        ref_step.save_kv(layer, new_k, new_v)
        ref_step.init_forward_metadata()
        want_eager = (
            dcp_decode_attention(q_mine, layer, ref_step, exchange=exchange, q_heads_sharded=sharded).double().cpu()
        )
        step = build_dcp_step(graph.pool, [(r, 1) for r in reqs["graph"]], attn_backend=graph.attn, graph_shaped=True)
        check_padding_rows(step, graph.attn, [r.kv_len for r in reqs["graph"]])
        out = runner.run(step.local_batch, {"q": q_mine, "k": new_k, "v": new_v, **step.graph_inputs()})
        got_all = out.double().cpu()
        lens = [m + 1 for m in lens]
        for i in range(bs):
            want = reference(q[i], keys[i][: lens[i]], values[i][: lens[i]])[mine]
            got = got_all[i].view(-1, D)
            assert torch.isfinite(got).all(), (rank, t, i)
            err = max(float((got - want).abs().max()), float((got_all[i] - want_eager[i]).abs().max()))
            assert err < tol, (rank, t, i, err)
            worst = max(worst, err)
    return worst


def check_padding_rows(step, attn, local_lens: list[int]) -> None:
    """A graph-shaped step's rows without a local key are `graph_padding`'s padding rows (request row 0,
    its seq_len, KV slot 0) and masked; the others are the request's local row and length."""
    from attn_core.contract.forward_mode import ForwardMode
    from attn_core.contract.graph_step import graph_padding

    pad = graph_padding(ForwardMode.DECODE, 0, [step.batch_size], attn.get_cuda_graph_seq_len_fill_value())
    b = step.local_batch
    local = torch.tensor(local_lens) > 0
    assert b.batch_size == step.batch_size and step.local_rows is None
    assert torch.equal(step.local_mask.cpu(), local)
    assert torch.equal(b.seq_lens_cpu, torch.where(local, torch.tensor(local_lens), pad.seq_len).to(torch.int32))
    assert (b.req_pool_indices.cpu()[~local] == 0).all() and (b.out_cache_loc.cpu()[~local] == 0).all()


def check_graph_step_errors(setup: RankSetup, q: torch.Tensor, exchange: str, sharded: bool) -> None:
    """On fresh pools (`setup`), typed errors before any allocation and any collective: a graph-shaped
    EXTEND step, one without a backend, `init_forward_metadata` of a graph-shaped step, a mask of the
    wrong shape or dtype."""
    import dataclasses

    import attn_core as ac
    from attn_core.dcp import build_dcp_step, dcp_decode_attention

    pool, bs = setup.pool, q.shape[0]
    reqs = [pool.add() for _ in range(bs)]
    expect_error(
        ac.InvalidArgumentError,
        build_dcp_step,
        pool,
        [(r, 2) for r in reqs],
        attn_backend=setup.attn,
        graph_shaped=True,
    )
    build_dcp_step(pool, [(r, 2) for r in reqs], attn_backend=setup.attn)
    work = [(r, 1) for r in reqs]
    expect_error(ac.InvalidArgumentError, build_dcp_step, pool, work, graph_shaped=True)
    assert [pool.kv_len(r) for r in reqs] == [2] * bs  # nothing allocated by the refused calls
    step = build_dcp_step(pool, work, attn_backend=setup.attn, graph_shaped=True)
    expect_error(ac.InvalidArgumentError, step.init_forward_metadata)
    for mask in (step.local_mask[:1], step.local_mask.float()):
        bad = dataclasses.replace(step, local_mask=mask)
        expect_error(
            ac.InvalidArgumentError,
            dcp_decode_attention,
            q,
            setup.layer,
            bad,
            exchange=exchange,
            q_heads_sharded=sharded,
        )


def expect_error(error: type, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except error:
        return
    raise AssertionError(f"no {error.__name__}")


def _usable(name: str) -> bool:
    import attn_core as ac

    entry = next((e for e in ac.list_backends() if e.name == name), None)
    return entry is not None and entry.ok and entry.probe() is None


#: per group size, the (backend, exchange, q_heads_sharded, check) runs of one spawn
CONFIGS = {
    2: [
        ("torch_native", "all_gather", True, "eager"),
        ("torch_native", "all_to_all", True, "eager"),
        ("cpu_amx", "all_gather", False, "eager"),
        ("torch_native", "all_to_all", True, "graph"),
        ("torch_native", "all_gather", False, "graph"),
        ("torch_native", "all_to_all", True, "verify"),
        ("cpu_amx", "all_gather", False, "verify"),
        ("torch_native", "all_gather", True, "verify_rows"),
    ],
    3: [
        ("torch_native", "all_to_all", True, "eager"),
        ("torch_native", "all_gather", False, "eager"),
        ("cpu_amx", "all_to_all", True, "eager"),
        ("torch_native", "all_gather", True, "graph"),
        ("torch_native", "all_gather", True, "verify"),
        ("cpu_amx", "all_to_all", True, "verify"),
        ("torch_native", "all_gather", False, "verify_rows"),
    ],
}


@pytest.mark.parametrize("world", sorted(CONFIGS))
def test_dcp_decode_matches_single_rank(world):
    configs = [c for c in CONFIGS[world] if _usable(c[0])]
    errs = run_ranks(HERE, "dcp_worker", world, args=(world * 7, configs), timeout_s=150)
    assert [len(e) for e in errs] == [len(configs)] * world
    for i, config in enumerate(configs):  # verify: every kind of local part ran on some rank
        kinds = {tuple(kind) for e in errs for kind in e[i]} if config[3].startswith("verify") else set()
        if config[3] == "verify":  # a TARGET_VERIFY batch beside DECODE rows in one step
            assert ("TARGET_VERIFY", True) in kinds, (config, kinds)
        if config[3] == "verify_rows":  # DECODE rows only, split into several parts
            assert ("DECODE", True) in kinds and "TARGET_VERIFY" not in {m for m, _ in kinds}, (config, kinds)


def test_dcp_verify_triton_interpreter():
    """The verify check with attn-triton's kernels under the Triton interpreter (2 gloo ranks): its
    TARGET_VERIFY custom-mask batch beside DECODE rows."""
    if os.environ.get("TRITON_INTERPRET") != "1" or not _usable("triton"):
        pytest.skip("needs TRITON_INTERPRET=1 and attn-triton")
    errs = run_ranks(HERE, "dcp_worker", 2, args=(3, [("triton", "all_gather", True, "verify")]), timeout_s=300)
    assert ("TARGET_VERIFY", True) in {tuple(kind) for e in errs for kind in e[0]}


@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype_name", [("triton", "float32"), ("flashinfer", "float16")])
@pytest.mark.parametrize("exchange", ["all_gather", "all_to_all"])
def test_dcp_decode_nccl(backend, dtype_name, exchange):
    """The same checks on 2 GPUs over NCCL (eager decode, and verify)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    if not _usable(backend):
        pytest.skip(f"{backend} cannot run here")
    configs = [(backend, exchange, True, "eager"), (backend, exchange, True, "verify")]
    run_ranks(HERE, "dcp_worker", 2, args=(5, configs, "cuda", dtype_name), timeout_s=300, dist_backend="nccl")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype_name", [("triton", "float32"), ("flashinfer", "float16")])
@pytest.mark.parametrize("exchange", ["all_gather", "all_to_all"])
def test_dcp_decode_nccl_cuda_graphs(backend, dtype_name, exchange):
    """Graph-shaped DCP decode in real CUDA graphs on 2 GPUs, the collectives captured on NCCL: every
    replay equals the eager path and the reference (q sharded over the ranks, and with all_gather also
    the unsharded q of pure DCP)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    if not _usable(backend):
        pytest.skip(f"{backend} cannot run here")
    configs = [(backend, exchange, True, "graph")] + (
        [(backend, exchange, False, "graph")] if exchange == "all_gather" else []
    )
    run_ranks(HERE, "dcp_worker", 2, args=(11, configs, "cuda", dtype_name), timeout_s=300, dist_backend="nccl")


def hang_worker(rank: int, world: int) -> None:
    import time

    import torch.distributed as dist

    if rank == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(600)


def fail_worker(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")


def test_harness_reports_failures_and_hangs():
    with pytest.raises(RankFailure, match="rank 1 fails on purpose"):
        run_ranks(HERE, "fail_worker", 2, timeout_s=60)
    with pytest.raises(RankFailure, match="still running"):
        run_ranks(HERE, "hang_worker", 2, timeout_s=5)
