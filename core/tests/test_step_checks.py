"""The step check (`attn_core.ops.step_checks`): the torch reference against hand-made expectations, and
the Triton kernel (interpreter, CPU tensors) against the torch reference on random spoiled batches."""

from __future__ import annotations

import os
import random

import pytest
import torch

from attn_core.memory import MHATokenToKVPool, PagedTokenAllocator, ReqToTokenPool
from attn_core.ops.device_faults import FAULT_WORDS, DeviceFault, DeviceFaultKind
from attn_core.ops.step_checks import StepTensors, check_step_torch
from attn_core.testing.batch_builder import build_forward_batch

K = DeviceFaultKind


def _batch(mode: str, reqs, page_size: int = 4, seed: int = 0):
    ps = page_size
    pages = sum(-(-(p + e) // ps) for p, e in reqs) + 3
    r2t = ReqToTokenPool(len(reqs) + 2, max(p + e for p, e in reqs) + ps)
    kv = MHATokenToKVPool(pages * ps, ps, torch.float32, 1, 8, 1)
    b = build_forward_batch(
        mode,
        reqs,
        req_to_token_pool=r2t,
        allocator=PagedTokenAllocator(pages * ps, ps),
        token_to_kv_pool=kv,
        generator=torch.Generator().manual_seed(seed),
    )
    return b, r2t, kv


def _tensors(b, r2t, kv, **changes) -> StepTensors:
    decode = b.forward_mode.is_decode()
    s = StepTensors(
        req_to_token=r2t.req_to_token,
        req_pool_indices=b.req_pool_indices.clone(),
        seq_lens=b.seq_lens.clone(),
        num_tokens=b.num_tokens,
        num_slots=kv.num_slots,
        q_lens=None if decode else b.extend_seq_lens.clone(),
        prefix_lens=None if decode else b.extend_prefix_lens.clone(),
        start_loc=None if decode else b.extend_start_loc.clone(),
        out_cache_loc=b.out_cache_loc.clone(),
        seq_total=b.seq_lens_sum,
        decode=decode,
    )
    for k, v in changes.items():
        setattr(s, k, v)
    return s


def _run(s: StepTensors):
    fault = torch.zeros(FAULT_WORDS, dtype=torch.int32)
    safe = torch.full((s.num_tokens,), -7, dtype=torch.int64)
    check_step_torch(s, safe, fault)
    return DeviceFault.from_words(fault.tolist()), safe


def test_valid_batches_pass_with_every_slot_allowed():
    for mode, reqs in (
        ("DECODE", [(5, 1), (9, 1), (1, 1)]),
        ("EXTEND", [(0, 7), (6, 3), (4, 0)]),
        ("MIXED", [(3, 1), (0, 5)]),
    ):
        b, r2t, kv = _batch(mode, reqs)
        fault, safe = _run(_tensors(b, r2t, kv))
        assert fault is None, (mode, fault)
        assert torch.equal(safe, b.out_cache_loc.to(torch.int64))


def test_bad_row_drops_only_that_requests_writes_and_names_it():
    b, r2t, kv = _batch("DECODE", [(5, 1), (9, 1), (2, 1)])
    rpi = b.req_pool_indices.clone()
    rpi[1] = -1
    fault, safe = _run(_tensors(b, r2t, kv, req_pool_indices=rpi))
    assert fault.kinds[0] == K.REQUEST_ROW and fault.first[K.REQUEST_ROW] == 1
    assert fault.argument == "forward_batch.req_pool_indices" and fault.request == 1
    want = b.out_cache_loc.clone().to(torch.int64)
    want[1] = 0
    assert torch.equal(safe, want)


@pytest.mark.parametrize(
    "what, kind, culprit",
    [
        ("slot -1", K.WRITE_SLOT, 0),
        ("slot past the pool", K.WRITE_SLOT, 2),
        ("duplicate slot", K.WRITE_OWNER, 1),
        ("foreign slot", K.WRITE_OWNER, 2),
        ("duplicate row", K.KEY_SLOT, 1),
        ("duplicate row and length", K.DUPLICATE_ROW, 1),
        ("device seq_len longer", K.KEY_SLOT, 0),
        ("key slot past the pool", K.KEY_SLOT, 1),
    ],
)
def test_decode_faults(what, kind, culprit):
    b, r2t, kv = _batch("DECODE", [(5, 1), (9, 1), (3, 1)])
    s = _tensors(b, r2t, kv)
    loc, rpi, seq = s.out_cache_loc, s.req_pool_indices, s.seq_lens
    if what == "slot -1":
        loc[0] = -1
    elif what == "slot past the pool":
        loc[2] = kv.num_slots
    elif what == "duplicate slot":
        loc[1] = loc[0]
    elif what == "foreign slot":
        loc[2] = r2t.req_to_token[int(rpi[0]), 0]
    elif what == "duplicate row":  # request 1 reads request 0's row at its own length: its slot is not the row's
        rpi[1] = rpi[0]
    elif what == "duplicate row and length":  # request 1 is request 0 again: one slot written twice
        rpi[1], seq[1], loc[1] = rpi[0], seq[0], loc[0]
        s.seq_total = None
    elif what == "device seq_len longer":
        seq[0] += 1
        s.seq_total = None  # the host total is not known: only the ownership of the new token tells
    elif what == "key slot past the pool":
        r2t.req_to_token[int(rpi[1]), 0] = kv.num_slots + 3
    fault, safe = _run(s)
    assert fault is not None and kind in fault.kinds, (what, fault)
    assert fault.first.get(kind) == culprit, (what, fault)
    assert int(safe[culprit]) == 0
    others = [i for i in range(3) if i != culprit]
    for i in others:
        assert int(safe[i]) == int(b.out_cache_loc[i]), (what, i)


def test_extend_totals_and_offsets():
    b, r2t, kv = _batch("EXTEND", [(0, 4), (5, 3), (2, 2)])
    s = _tensors(b, r2t, kv)
    s.start_loc[2] += 1
    fault, safe = _run(s)
    assert fault.kinds == (K.START_LOC,) and fault.first[K.START_LOC] == 2
    assert safe[7:].tolist() == [0, 0] and torch.equal(safe[:7], b.out_cache_loc[:7].to(torch.int64))
    s = _tensors(b, r2t, kv)
    s.q_lens[0] += 1  # the device extend lengths no longer sum to the step's tokens: every write dropped
    fault, safe = _run(s)
    assert K.EXTEND_TOTAL in fault.kinds and not safe.any()
    s = _tensors(b, r2t, kv)
    s.seq_lens[1] += 2
    s.prefix_lens[1] += 2
    fault, safe = _run(s)
    assert K.SEQ_TOTAL in fault.kinds and not safe.any()
    s.seq_total = torch.tensor([b.seq_lens_sum], dtype=torch.int64)  # the host total in device memory: the same
    fault, safe = _run(s)
    assert K.SEQ_TOTAL in fault.kinds and not safe.any()
    s.seq_total = torch.tensor([b.seq_lens_sum + 2], dtype=torch.int64)  # the totals agree (other checks still fail)
    fault, safe = _run(s)
    assert fault is not None and K.SEQ_TOTAL not in fault.kinds
    s = _tensors(b, r2t, kv, seq_total=torch.tensor([b.seq_lens_sum], dtype=torch.int64))
    fault, safe = _run(s)
    assert fault is None and torch.equal(safe, b.out_cache_loc.to(torch.int64))


def _spoil(rng: random.Random, s: StepTensors, r2t, kv) -> str:
    bs, T = s.batch_size, s.num_tokens
    what = rng.choice(
        ["none", "row", "rowdup", "seq", "q", "prefix", "start", "loc", "locdup", "table", "total", "cascade"]
    )
    r = rng.randrange(bs)
    if what == "row":
        s.req_pool_indices[r] = rng.choice([-1, r2t.req_to_token.shape[0], 10**6])
    elif what == "rowdup" and bs > 1:
        s.req_pool_indices[r] = s.req_pool_indices[(r + 1) % bs]
    elif what == "seq":
        s.seq_lens[r] += rng.choice([-50, -1, 1, 3, 10**5])
    elif what == "q" and s.q_lens is not None:
        s.q_lens[r] += rng.choice([-9, -1, 1, 2])
    elif what == "prefix" and s.prefix_lens is not None:
        s.prefix_lens[r] += rng.choice([-1, 1])
    elif what == "start" and s.start_loc is not None:
        s.start_loc[r] += rng.choice([-1, 1])
    elif what == "loc" and T:
        s.out_cache_loc[rng.randrange(T)] = rng.choice(
            [-1, 0, kv.num_slots, kv.num_slots + 7, 10**9, rng.randrange(kv.num_slots)]
        )
    elif what == "locdup" and T > 1:
        i, j = rng.sample(range(T), 2)
        s.out_cache_loc[i] = s.out_cache_loc[j]
    elif what == "table":
        row = int(s.req_pool_indices[r]) % r2t.req_to_token.shape[0]
        r2t.req_to_token[row, rng.randrange(r2t.req_to_token.shape[1])] = rng.choice([0, -3, kv.num_slots])
    elif what == "total":
        s.seq_total += rng.choice([-1, 1])
    elif what == "cascade":
        s.cascade_len = rng.choice([1, 2, 4, 100])
    return what


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernel runs on CPU tensors under TRITON_INTERPRET=1"
)
def test_triton_kernel_matches_torch_on_random_spoiled_batches():
    from attn_core.ops.step_checks_triton import check_step_triton

    rng = random.Random(3)
    for trial in range(40):
        mode = rng.choice(["DECODE", "EXTEND", "MIXED"])
        bs = rng.randint(1, 6)
        if mode == "DECODE":
            reqs = [(rng.randint(1, 20), 1) for _ in range(bs)]
        else:
            reqs = [(rng.randint(0, 12), rng.randint(0 if i else 1, 6)) for i in range(bs)]
            if mode == "MIXED":
                reqs[0] = (rng.randint(1, 9), 1)
        b, r2t, kv = _batch(mode, reqs, page_size=rng.choice([1, 4]), seed=trial)
        s = _tensors(b, r2t, kv, check_dup=rng.random() < 0.8, check_keys=rng.random() < 0.8)
        what = _spoil(rng, s, r2t, kv)
        if rng.random() < 0.5:  # the host total in device memory, as CudaGraphRunner's captured check reads it
            s.seq_total = torch.tensor([s.seq_total], dtype=torch.int64)
        f_ref = torch.zeros(FAULT_WORDS, dtype=torch.int32)
        safe_ref = torch.full((s.num_tokens,), -7, dtype=torch.int64)
        check_step_torch(s, safe_ref, f_ref)
        f_k = torch.zeros(FAULT_WORDS, dtype=torch.int32)
        safe_k = torch.full((s.num_tokens,), -7, dtype=torch.int64)
        check_step_triton(s, safe_k, f_k)
        assert f_k.tolist() == f_ref.tolist(), (trial, mode, what, reqs)
        assert torch.equal(safe_k, safe_ref), (trial, mode, what, reqs)
        if what == "none":
            assert not f_ref.any() and torch.equal(safe_ref, b.out_cache_loc.to(torch.int64)), (trial, mode, reqs)


def _strided(x: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """`x` (1-D) as a view with another stride and garbage between its entries: column 1 of a `[n, k]`
    buffer (k 2..4) or every other entry of a reversed buffer; the values read through it are x's."""
    n, k = x.shape[0], rng.randint(2, 4)
    buf = torch.full((n + 1, k), -12345, dtype=x.dtype)
    if rng.random() < 0.5:
        buf[:n, 1] = x
        return buf[:n, 1]
    flat = buf.reshape(-1)[: 2 * n]
    flat[::2] = x
    return flat[::2]


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernel runs on CPU tensors under TRITON_INTERPRET=1"
)
def test_triton_kernel_reads_strided_inputs_as_torch_does():
    """Every 1-D input as a strided view (an engine's out_cache_loc sliced out of a `[bs, steps]` buffer:
    the example engine's draft steps) and a table with strided columns: the kernel's faults and allowed
    slots equal the torch reference's, and a valid batch passes with every slot allowed (the kernel once
    read them as dense and refused every request after the first: a false WRITE_OWNER)."""
    from attn_core.ops.step_checks_triton import check_step_triton

    rng = random.Random(5)
    for trial in range(24):
        mode = rng.choice(["DECODE", "EXTEND", "MIXED"])
        bs = rng.randint(2, 5)
        if mode == "DECODE":
            reqs = [(rng.randint(1, 20), 1) for _ in range(bs)]
        else:
            reqs = [(rng.randint(0, 12), rng.randint(1, 6)) for _ in range(bs)]
        b, r2t, kv = _batch(mode, reqs, page_size=rng.choice([1, 4]), seed=100 + trial)
        s = _tensors(b, r2t, kv)
        what = _spoil(rng, s, r2t, kv) if trial % 2 else "none"
        for name in ("req_pool_indices", "seq_lens", "q_lens", "prefix_lens", "start_loc", "out_cache_loc"):
            if getattr(s, name) is not None:
                setattr(s, name, _strided(getattr(s, name), rng))
        if trial % 3 == 0:  # the table's columns strided too (a transposed buffer)
            s.req_to_token = s.req_to_token.t().contiguous().t()
        results = []
        for check in (check_step_torch, check_step_triton):
            fault = torch.zeros(FAULT_WORDS, dtype=torch.int32)
            safe = torch.full((s.num_tokens,), -7, dtype=torch.int64)
            check(s, safe, fault)
            results.append((fault.tolist(), safe))
        (f_ref, safe_ref), (f_k, safe_k) = results
        assert f_k == f_ref and torch.equal(safe_k, safe_ref), (trial, mode, what, reqs)
        if what == "none":
            assert not any(f_ref) and torch.equal(safe_ref, b.out_cache_loc.to(torch.int64)), (trial, mode, reqs)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels run on CPU tensors under TRITON_INTERPRET=1"
)
def test_index_launch_with_the_step_check_equals_the_two_launches(monkeypatch):
    """`kv_indices_triton(..., step_check=...)` (`launch_checked_indices`: the step check in the index kernel's
    launch) writes the fault word, the allowed slots and the index arrays the step check's
    kernel and the index kernel write one after the other, on random spoiled batches; a check of another
    batch size runs in a launch of its own."""
    from attn_core.ops import kv_indices_triton as checked_indices_triton
    from attn_core.ops.kv_indices_triton import kv_indices_triton
    from attn_core.ops.step_checks import PendingStepCheck
    from attn_core.ops.step_checks_triton import check_step_triton

    rng = random.Random(11)
    real = checked_indices_triton.launch_checked_indices
    fused_launches = []

    def counted(*args):
        fused_launches.append(1)
        real(*args)

    monkeypatch.setattr(checked_indices_triton, "launch_checked_indices", counted)
    for trial in range(24):
        mode = rng.choice(["DECODE", "EXTEND"])
        bs = rng.randint(1, 5)
        reqs = (
            [(rng.randint(1, 20), 1) for _ in range(bs)]
            if mode == "DECODE"
            else [(rng.randint(0, 12), rng.randint(1, 6)) for _ in range(bs)]
        )
        ps = rng.choice([1, 4])
        b, r2t, kv = _batch(mode, reqs, page_size=ps, seed=trial)
        s = _tensors(b, r2t, kv)
        what = _spoil(rng, s, r2t, kv)
        total = -(-b.seq_lens_cpu // ps).sum().item() if ps > 1 else int(b.seq_lens_cpu.sum())
        lens = s.seq_lens.to(torch.int32)
        outs = []
        for fused in (False, True):
            fault = torch.zeros(FAULT_WORDS, dtype=torch.int32)
            safe = torch.full((s.num_tokens,), -7, dtype=torch.int64)
            ids = torch.full((total + 3,), -5, dtype=torch.int32)
            indptr = torch.full((bs + 1,), -5, dtype=torch.int32)
            last = torch.full((bs,), -5, dtype=torch.int32)
            if not fused:
                check_step_triton(s, safe, fault)
            pending = PendingStepCheck(s, safe, fault) if fused else None
            kv_indices_triton(
                r2t.req_to_token,
                s.req_pool_indices,
                lens,
                ids,
                kv_indptr=indptr,
                last_page_len=last,
                page_size=ps,
                num_slots=kv.num_slots,
                fault=fault,
                capacity=total,
                step_check=pending,
            )
            outs.append((fault, safe, ids, indptr, last))
        for a, c in zip(*outs):
            assert torch.equal(a, c), (trial, mode, what, reqs)
    assert len(fused_launches) == 24  # every fused call went through the one launch
    # a check of another batch size than the index launch's: launched on its own first, the same results
    b, r2t, kv = _batch("DECODE", [(5, 1), (7, 1)])
    s = _tensors(b, r2t, kv)
    fault = torch.zeros(FAULT_WORDS, dtype=torch.int32)
    safe = torch.full((s.num_tokens,), -7, dtype=torch.int64)
    ids = torch.zeros(8, dtype=torch.int32)
    called = []
    monkeypatch.setattr(checked_indices_triton, "launch_checked_indices", lambda *a: called.append(a))
    kv_indices_triton(
        r2t.req_to_token,
        s.req_pool_indices[:1],
        s.seq_lens[:1].to(torch.int32),
        ids,
        step_check=PendingStepCheck(s, safe, fault),
    )
    assert not called and torch.equal(safe, b.out_cache_loc.to(torch.int64)) and not fault.any()
