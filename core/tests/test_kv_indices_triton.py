"""The index kernel (`attn_core.ops.kv_indices_triton`) against the torch builders of
`attn_core.ops.kv_indices` and plain Python loops: under the Triton interpreter (every output, page
sizes 1 and > 1, several copy programs per request), compiled for sm_90 without a GPU, and on a GPU
through the cached launch."""

import importlib.util
import os
import random
import subprocess
import sys

import pytest
import torch

import attn_core.ops.kv_indices as kvi

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # pytest runs with --import-mode=importlib: the sibling module's table helpers
from test_kv_indices_paged import _case, _expected_ids, _paged_table  # noqa: E402

_INTERPRETED = """
import sys
import torch
sys.path.insert(0, {here!r})
import test_kv_indices_triton as t
import attn_core.ops.kv_indices_triton as kvt
from attn_core.contract.errors import InvalidArgumentError

for page_size in (1, 4, 16):
    for seed in range(4):
        t.check_all_outputs(kvt.kv_indices_triton, *t._case(60 + seed, page_size, seed % 2 == 1), page_size, seed)
        t.check_ids_only(kvt.kv_indices_triton, *t._case(70 + seed, page_size, seed % 2 == 0), page_size)
kvt.copy_programs = lambda bs, on_gpu: 3  # the GPU's grid-stride copy: several programs per request
for page_size in (1, 2):
    for seed in range(2):
        case = t.long_case(80 + seed, page_size)
        t.check_all_outputs(kvt.kv_indices_triton, *case, page_size, seed)
        t.check_ids_only(kvt.kv_indices_triton, *case, page_size)

indptr = torch.full((1,), 7, dtype=torch.int32)
empty = torch.zeros(0, dtype=torch.int64)
kvt.kv_indices_triton(
    torch.zeros(1, 4, dtype=torch.int32), empty, empty.int(), torch.zeros(1, dtype=torch.int32), kv_indptr=indptr
)
assert indptr.tolist() == [0]
r2t = torch.arange(40, dtype=torch.int32).view(8, 5)
try:
    kvt.kv_indices_triton(
        r2t.t(), torch.tensor([1]), torch.tensor([2], dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    )
    raise SystemExit("strided rows accepted")
except InvalidArgumentError as e:
    assert "req_to_token" in str(e)
print("ok")
"""


def long_case(seed: int, page_size: int):
    """A few requests longer than the kernel's copy chunk (512 ids), for the multi-program copy."""
    gen = torch.Generator().manual_seed(seed)
    bs, width = 3, 2200
    r2t = _paged_table(random.Random(seed), bs + 1, width, page_size)
    rows = torch.randperm(bs + 1, generator=gen)[:bs]
    starts = torch.randint(0, 20, (bs,), generator=gen, dtype=torch.int32) * page_size
    lens = torch.randint(1100, 2100, (bs,), generator=gen, dtype=torch.int32)
    lens[1] = 0
    return r2t, rows, lens, starts


def check_all_outputs(fn, r2t, rows, lens, starts, page_size: int, seed: int) -> None:
    """Every output of one launch, from poisoned buffers, vs the torch builders (kv_start on odd seeds)."""
    bs = lens.shape[0]
    gen = torch.Generator().manual_seed(seed)
    q_lens = torch.minimum(lens, torch.randint(0, 9, (bs,), generator=gen, dtype=torch.int32).to(lens.device))
    total = int(kvi.num_pages_from_lens(lens, page_size).sum())
    start = starts if seed % 2 else None
    dev = r2t.device
    indptr = torch.full((bs + 1,), -1, dtype=torch.int32, device=dev)
    last = torch.full((bs,), -1, dtype=torch.int32, device=dev)
    indices = torch.full((total + 3,), -7, dtype=torch.int32, device=dev)
    qo = torch.full((bs + 1,), -1, dtype=torch.int32, device=dev)
    mask = torch.full((bs + 1,), -1, dtype=torch.int64, device=dev)
    fault = torch.zeros(8, dtype=torch.int32, device=dev)
    fn(
        r2t,
        rows,
        lens,
        indices,
        kv_indptr=indptr,
        last_page_len=last,
        page_size=page_size,
        kv_start=start,
        q_lens=q_lens,
        qo_indptr=qo,
        mask_indptr=mask,
        num_slots=int(r2t.max()) + 1,
        fault=fault,
    )
    want_indptr = kvi.page_indptr_from_lens(lens, page_size)
    assert torch.equal(indptr, want_indptr), (page_size, seed)
    want = kvi.kv_indices_from_req_to_token(r2t, rows, want_indptr, total, start, page_size)
    assert torch.equal(indices[:total], want), (page_size, seed)
    assert indices[total:].tolist() == [-7] * 3
    assert torch.equal(last, kvi.last_page_len_from_lens(lens, page_size))
    assert torch.equal(qo, kvi.kv_indptr_from_lens(q_lens))
    assert torch.equal(mask, kvi.exclusive_cumsum(q_lens.long() * lens.long(), torch.int64))
    assert not fault.any(), "valid input recorded a fault"


def check_ids_only(fn, r2t, rows, lens, starts, page_size: int) -> None:
    """The ids alone (no indptr buffer: `build_kv_indices`' use) vs a plain loop over req_to_token."""
    total = int(kvi.num_pages_from_lens(lens, page_size).sum())
    out = torch.full((total + 2,), -7, dtype=torch.int32, device=r2t.device)
    fn(r2t, rows, lens, out, page_size=page_size, kv_start=starts)
    assert out[:total].tolist() == _expected_ids(r2t, rows, lens, starts, page_size), page_size
    assert out[total:].tolist() == [-7] * 2


def test_kernel_interpreted():
    """In a fresh process: TRITON_INTERPRET must be set before triton is first imported (for the
    kernel's calls into triton.language's own jit functions)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-c", _INTERPRETED.format(here=HERE)], env=env, capture_output=True, text=True
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attn_core.ops.kv_indices_triton import _build_indices_kernel as fn

for page_size, keep in ((1, False), (16, False), (1, True), (16, True)):
    consts = dict(BS_BLOCK=256, CHUNK=512, PAGE_SIZE=page_size, HAS_START=True, HAS_INDPTR=True, HAS_LAST=True,
                  HAS_Q=True, HAS_MASK_INDPTR=True, CHECK_SLOTS=True, HAS_FAULT=True, KEEP_LAYOUT=keep)
    sig = {n: "constexpr" if n in consts else ("*i64" if n == "MASK_INDPTR" else "*i32") if n.isupper() else "i32"
           for n in fn.arg_names}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1})
    assert k.asm["cubin"], page_size
print("compiled")
"""


@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None, reason="Triton without its CUDA backend"
)
def test_kernel_compiles_for_sm90():
    """Lowered to cubin ahead of time (no GPU needed): catches what the interpreter does not check."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page_size", [1, 16])
def test_cached_launch_on_gpu(page_size):
    """After the first call of a constexpr set the launch goes through the compiled handle; batches of
    other sizes, alignments, index dtypes and lengths still match the torch builders."""
    pytest.importorskip("triton")
    import attn_core.ops.kv_indices_triton as kvt

    gen = torch.Generator().manual_seed(3)
    r2t = torch.randint(1, 1 << 20, (300, 5200), generator=gen, dtype=torch.int32).cuda()
    i32, i64 = torch.int32, torch.int64
    shapes = ((1, i64), (7, i64), (64, i64), (64, i32), (255, i64), (256, i32), (3, i64))
    for bs, idx_dtype in shapes * 2:  # the second round: every constexpr set through the compiled handle, new buffers
        rpi = torch.randperm(300, generator=gen)[:bs].to(idx_dtype).cuda()
        lens = torch.randint(1, 4990, (bs,), generator=gen, dtype=torch.int32).cuda()
        start = (torch.randint(0, 10, (bs,), generator=gen, dtype=torch.int32) * page_size).cuda()
        total = int(kvi.num_pages_from_lens(lens, page_size).sum())
        buf = torch.full((bs + 1 + total,), -1, dtype=torch.int32, device="cuda")
        indptr, indices = buf[: bs + 1], buf[bs + 1 :]
        fault = torch.zeros(8, dtype=torch.int32, device="cuda")
        kvt.kv_indices_triton(
            r2t,
            rpi,
            lens,
            indices,
            kv_indptr=indptr,
            page_size=page_size,
            kv_start=start,
            num_slots=1 << 20,
            fault=fault,
        )
        want = kvi.page_indptr_from_lens(lens, page_size)
        assert torch.equal(indptr, want)
        assert torch.equal(
            indices, kvi.kv_indices_from_req_to_token(r2t, rpi, want, total, kv_start=start, page_size=page_size)
        )
        assert not fault.any()
    assert kvt._LAUNCH.compiled and kvt._LAUNCH.enabled, "the cached launch path was never taken (or fell back)"
    assert kvt._LAUNCH._stream_of is not None, "the compiled kernel's launcher is not called directly"
    # the direct launch goes to the current stream: captured into a CUDA graph (a side stream, where a
    # launch on another stream breaks the capture), every replay matches the torch builders
    bs, rpi = 5, torch.randperm(300, generator=gen)[:5].cuda()
    lens = torch.randint(1, 4990, (bs,), generator=gen, dtype=torch.int32).cuda()
    cap = int(kvi.num_pages_from_lens(lens.new_full((bs,), 4990), page_size).sum())
    buf = torch.full((bs + 1 + cap,), -1, dtype=torch.int32, device="cuda")
    fault = torch.zeros(8, dtype=torch.int32, device="cuda")

    def launch():
        kvt.kv_indices_triton(
            r2t, rpi, lens, buf[bs + 1 :], kv_indptr=buf[: bs + 1], page_size=page_size, num_slots=1 << 20, fault=fault
        )

    launch()  # this constexpr set compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for _ in range(3):
        lens.copy_(torch.randint(1, 4990, (bs,), generator=gen, dtype=torch.int32))
        rpi.copy_(torch.randperm(300, generator=gen)[:bs])
        buf.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        want = kvi.page_indptr_from_lens(lens, page_size)
        total = int(want[-1])
        assert torch.equal(buf[: bs + 1], want)
        assert torch.equal(
            buf[bs + 1 : bs + 1 + total], kvi.kv_indices_from_req_to_token(r2t, rpi, want, total, page_size=page_size)
        )
    assert not fault.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_run_matches_the_interpreter_checks():
    """The interpreter's checks (poisoned buffers, every output, ids-only) on CUDA tensors."""
    pytest.importorskip("triton")
    import attn_core.ops.kv_indices_triton as kvt

    for page_size in (1, 4, 16):
        for seed in range(4):
            case = [x.cuda() for x in _case(60 + seed, page_size, seed % 2 == 1)]
            check_all_outputs(kvt.kv_indices_triton, *case, page_size, seed)
            check_ids_only(kvt.kv_indices_triton, *case, page_size)
    for page_size in (1, 2):
        case = [x.cuda() for x in long_case(80, page_size)]
        check_all_outputs(kvt.kv_indices_triton, *case, page_size, 1)


def test_table_arguments_refuse_rows_that_are_not_contiguous():
    from attn_core.contract.errors import InvalidArgumentError
    from attn_core.ops.kv_indices_triton import table_arguments

    table = torch.zeros(8, 4096, dtype=torch.int32)
    got = table_arguments(table)
    assert got[0] is table and got[1:] == (4096, 8, 4096)
    assert table_arguments(table[2:5])[1:] == (4096, 3, 4096)  # a row range: still contiguous rows
    with pytest.raises(InvalidArgumentError, match="req_to_token"):
        table_arguments(table.t())
