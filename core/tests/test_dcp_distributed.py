"""DCP decode attention on 2 and 3 gloo ranks (spawned CPU processes, `attn_core.testing.distributed`)
against a float64 attention over each request's whole KV, written plainly.

Every rank runs the same schedule over several steps of the same requests: prompts (EXTEND: only the
K/V is stored, each token on its rank; prefill attention is not sharded), decode steps, a request
arriving mid-run, lengths that are not multiples of the interleave size, a request shorter than one
block (no key on the other ranks). KV pools are poisoned with NaN first."""

from __future__ import annotations

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


def dcp_worker(rank: int, world: int, seed: int, configs: list[tuple[str, str, bool]], device: str = "cpu",
               dtype_name: str = "float32") -> list[float]:
    """Each (backend, exchange, q_heads_sharded) of `configs` in turn, in the same processes (one spawn)."""
    return [dcp_check(rank, world, seed + i, *config, device, dtype_name) for i, config in enumerate(configs)]


def dcp_check(rank: int, world: int, seed: int, backend: str, exchange: str, sharded: bool, device: str, dtype_name: str) -> float:
    import attn_core as ac
    from attn_core.dcp import DcpLayout, DcpRequestPool, build_dcp_step, dcp_decode_attention

    hq = HQ_PER_RANK * world
    D = HEAD_DIM.get(backend, 16)
    dtype = getattr(torch, dtype_name)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    layout = DcpLayout(world, PAGE)
    slots = 128
    if device == "cuda":
        device = f"cuda:{rank}"
    kv = ac.MHATokenToKVPool(size=slots, page_size=PAGE, dtype=dtype, head_num=HKV, head_dim=D, layer_num=1, device=device)
    for buf in (kv.get_key_buffer(0), kv.get_value_buffer(0)):
        buf.fill_(float("nan"))
    rows = ac.ReqToTokenPool(size=8, max_context_len=64, device=device)
    pool = DcpRequestPool(ac.RequestPool(rows, ac.PagedTokenAllocator(slots, PAGE), kv), layout, rank)
    ctx = ac.BackendContext(device=device, dtype=dtype, num_q_heads=hq, num_kv_heads=HKV, head_dim=D, page_size=PAGE,
                            max_batch_size=8, max_context_len=64, req_to_token_pool=rows, token_to_kv_pool=kv,
                            forward_modes={"decode"}, features={ac.Feature.LSE_OUTPUT}, validation="full")
    attn = ac.create_backend(backend, ctx)
    layer = ac.AttentionLayer(0, hq, HKV, D)

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
    expect_error(ac.InvalidArgumentError, dcp_decode_attention, torch.zeros(prompts[2], h_rank, D, dtype=dtype, device=device), layer,
                 steps[2], exchange=exchange, q_heads_sharded=sharded)  # an EXTEND step
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
        out = dcp_decode_attention(q[:, mine].contiguous().to(device), layer, step, exchange=exchange, q_heads_sharded=sharded)
        for i in range(len(reqs)):
            want = reference(q[i], keys[i][: lens[i]], values[i][: lens[i]])[mine]
            got = out[i].view(-1, D).double().cpu()
            assert torch.isfinite(got).all(), (rank, t, i)
            err = float((got - want).abs().max())
            assert err < tol, (rank, t, i, err)
            worst = max(worst, err)
    return worst


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


#: per group size, the (backend, exchange, q_heads_sharded) runs of one spawn
CONFIGS = {
    2: [("torch_native", "all_gather", True), ("torch_native", "all_to_all", True), ("cpu_amx", "all_gather", False)],
    3: [("torch_native", "all_to_all", True), ("torch_native", "all_gather", False), ("cpu_amx", "all_to_all", True)],
}


@pytest.mark.parametrize("world", sorted(CONFIGS))
def test_dcp_decode_matches_single_rank(world):
    configs = [c for c in CONFIGS[world] if _usable(c[0])]
    errs = run_ranks(HERE, "dcp_worker", world, args=(world * 7, configs), timeout_s=150)
    assert [len(e) for e in errs] == [len(configs)] * world


@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype_name", [("triton", "float32"), ("flashinfer", "float16")])
@pytest.mark.parametrize("exchange", ["all_gather", "all_to_all"])
def test_dcp_decode_nccl(backend, dtype_name, exchange):
    """The same check on 2 GPUs over NCCL (eager)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    if not _usable(backend):
        pytest.skip(f"{backend} cannot run here")
    run_ranks(HERE, "dcp_worker", 2, args=(5, [(backend, exchange, True)], "cuda", dtype_name), timeout_s=300, dist_backend="nccl")


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
