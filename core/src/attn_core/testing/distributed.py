"""Run a function on N torch.distributed ranks (spawned CPU processes, gloo) from inside one test.

    results = run_ranks("path/to/module.py", "worker", world=2, args=(seed,), timeout_s=60)

Each rank is a fresh `spawn`ed process that loads `module.py` by path (so test modules work whatever
pytest's import mode), joins a gloo (or NCCL) group through a file store (no port to pick, none to collide),
calls `worker(rank, world, *args)` and sends back its return value (picklable). An exception on any
rank is raised here as `RankFailure` with that rank's traceback; a rank still running after
`timeout_s` (a hung collective) is killed and `RankFailure` names it, so a hang fails the test
instead of blocking CI.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Sequence

import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """A rank raised, died or timed out (the message names the rank and carries its traceback)."""


def _rank_main(
    rank: int, world: int, store_path: str, module_path: str, func: str, args: tuple, results, dist_backend: str
) -> None:
    import torch.distributed as dist

    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)
        if dist_backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            dist_backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        spec = importlib.util.spec_from_file_location(f"_rank_module_{rank}", module_path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {module_path} as a module")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        value = getattr(module, func)(rank, world, *args)
        results.put((rank, True, value))
    except BaseException:  # every failure goes back to the test
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    module_path: str,
    func: str,
    world: int,
    args: Sequence[Any] = (),
    timeout_s: float = 120.0,
    dist_backend: str = "gloo",
) -> list[Any]:
    """`func(rank, world, *args)` from the file `module_path` on `world` ranks (`dist_backend` "gloo",
    or "nccl" with rank r on GPU r); returns the ranks' return values in rank order. Raises
    `RankFailure` when a rank raises, exits without a result or is still running after `timeout_s`
    seconds (all ranks are then killed)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_main,
                daemon=True,
                args=(r, world, store, str(module_path), func, tuple(args), results, dist_backend),
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(got) < world:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(world)) - set(got))
                    raise RankFailure(f"ranks {missing} still running after {timeout_s} s (a hung collective?)")
                try:
                    rank, ok, value = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [
                        r
                        for r, p in enumerate(procs)
                        if r not in got and not p.is_alive() and p.exitcode not in (None, 0)
                    ]
                    if dead:
                        raise RankFailure(
                            f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode}) without a result"
                        ) from None
                    continue
                if not ok:
                    raise RankFailure(f"rank {rank} of {world} failed:\n{value}")
                got[rank] = value
        finally:
            complete = len(got) == world
            for p in procs:
                p.join(timeout=5 if complete else 0)  # after a failure the others may wait on it forever
                if p.is_alive():
                    p.kill()
                    p.join()
    return [got[r] for r in range(world)]
