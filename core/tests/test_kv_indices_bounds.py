"""The index kernel under hostile device input that no host check saw (what a CUDA-graph replay feeds
it): rows -1 / past the table / 10**6, negative lengths and starts, lengths past the table width, device
lengths larger than the host total that sized kv_indices, slots outside the pool, negative q lengths.

Buffers are views into larger poisoned tensors (canaries on both sides): the kernel must leave every
canary as it was, read nothing from outside the table into its outputs, write the documented
clamped result (checked against a plain Python loop over the rules in the module doc) and record each
refusal's kind in the fault buffer. Runs under the Triton interpreter in a fresh process (see
test_kv_indices_triton.py); on a GPU the same checks run on CUDA tensors."""

import os
import subprocess
import sys

import pytest
import torch

from attn_core.ops.device_faults import DeviceFaultFlags, DeviceFaultKind, describe_device_faults

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS, WIDTH, NUM_SLOTS, CANARY = 8, 24, 400, 777_777


def padded(shape, fill, pad, dtype=torch.int32, device="cpu"):
    """(whole, view): a tensor of `shape` in the middle of a larger one, everything set to `fill`."""
    n = int(torch.tensor(shape).prod()) if shape else 1
    whole = torch.full((n + 2 * pad,), fill, dtype=dtype, device=device)
    return whole, whole[pad : pad + n].view(shape)


def table(device):
    """req_to_token `[ROWS, WIDTH]` of distinct slots in 1..NUM_SLOTS-1 inside a CANARY-filled buffer."""
    whole, r2t = padded((ROWS, WIDTH), CANARY, 3 * WIDTH, device=device)
    gen = torch.Generator().manual_seed(0)
    r2t.copy_(torch.randperm(NUM_SLOTS - 1, generator=gen)[: ROWS * WIDTH].view(ROWS, WIDTH).to(torch.int32) + 1)
    return whole, r2t


def expected(r2t, rows, lens, starts, capacity, page_size, num_slots, keep_layout=False):
    """The documented clamps, as a plain loop: (ids, indptr, last_page_len, faults). `keep_layout`: a
    refused row keeps its keys' count of ids, each the dummy 0 (then the tail to the capacity is 0 too)."""
    faults, ids, indptr, last = set(), [], [0], []
    for row, n, s in zip(rows, lens, starts):
        if not 0 <= row < ROWS:
            faults.add(DeviceFaultKind.REQUEST_ROW)
        if n < 0 or s < 0:
            faults.add(DeviceFaultKind.LENGTH)
        if 0 <= row < ROWS and s + n > WIDTH:
            faults.add(DeviceFaultKind.TABLE_WIDTH)
        s = min(max(s, 0), WIDTH)
        row_ok = 0 <= row < ROWS
        n = min(max(n, 0), WIDTH - s) if row_ok or keep_layout else 0
        pages = -(-n // page_size)
        if indptr[-1] + pages > capacity:
            faults.add(DeviceFaultKind.INDEX_CAPACITY)
        keep = min(pages, capacity - indptr[-1])
        for j in range(keep):
            slot = int(r2t[row, s + j * page_size]) if row_ok else 0
            if num_slots is not None and not 0 <= slot < num_slots:
                faults.add(DeviceFaultKind.SLOT)
                slot = 0
            ids.append(slot // page_size)
        indptr.append(indptr[-1] + keep)
        kept = min(n, keep * page_size)
        last.append(kept - max(keep - 1, 0) * page_size)
    return ids, indptr, last, faults


# (rows, lens, starts, host total or None, q_lens or None, page_size)
CASES = {
    "row_minus_1": ([2, -1, 5], [5, 7, 3], [0, 0, 0], None, None, 1),
    "row_equal_to_table_rows": ([ROWS, 1], [4, 6], [0, 0], None, None, 1),
    "row_10e6": ([1, 10**6, 0], [3, 3, 3], [0, 0, 0], None, None, 4),
    "negative_length": ([3, 4], [-5, 6], [0, 0], None, None, 1),
    "negative_start": ([3, 4], [5, 6], [-8, 4], None, None, 4),
    "length_past_width": ([0, 6], [WIDTH + 9, 2], [4, 0], None, None, 1),
    "device_lens_above_host_total": ([0, 1, 2], [9, 11, 13], [0, 0, 0], 12, None, 1),
    "device_pages_above_host_total": ([0, 1, 2], [9, 11, 13], [0, 0, 0], 4, None, 4),
    "negative_q_len": ([0, 1], [6, 8], [0, 0], None, [2, -3], 1),
}


def run_case(name, device, bad_slot=False, keep_layout=False):
    import attn_core.ops.kv_indices_triton as kvt

    rows, lens, starts, total, q_lens, page_size = CASES[name]
    bs = len(rows)
    r2t_whole, r2t = table(device)
    if bad_slot:  # a slot past the pool, and a negative one, in rows 0 and 1
        r2t[0, 1], r2t[1, 0] = NUM_SLOTS + 5, -3
    r2t_before = r2t_whole.clone()
    if total is None:
        total = sum(-(-min(max(n, 0), WIDTH) // page_size) for n in lens)
    ids_whole, ids = padded((max(total, 1),), -7, 5, device=device)
    ptr_whole, indptr = padded((bs + 1,), -7, 5, device=device)
    last_whole, last = padded((bs,), -7, 5, device=device)
    qo_whole, qo = padded((bs + 1,), -7, 5, device=device)
    flags = DeviceFaultFlags(torch.device(device))
    q = torch.tensor(q_lens, dtype=torch.int32, device=device) if q_lens is not None else None
    kvt.kv_indices_triton(
        r2t,
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(lens, dtype=torch.int32, device=device),
        ids[:total] if total else ids[:0],
        kv_indptr=indptr,
        last_page_len=last,
        page_size=page_size,
        kv_start=torch.tensor(starts, dtype=torch.int32, device=device),
        q_lens=q,
        qo_indptr=qo if q is not None else None,
        num_slots=NUM_SLOTS,
        fault=flags.buffer,
        keep_layout=keep_layout,
    )
    want_ids, want_ptr, want_last, want_faults = expected(
        r2t.cpu(), rows, lens, starts, total, page_size, NUM_SLOTS, keep_layout
    )
    if keep_layout:  # every entry up to the capacity written: the dummy 0 after the ids
        want_ids = want_ids + [0] * (total - len(want_ids))
    assert torch.equal(r2t_whole, r2t_before), "the table changed"
    n = len(want_ids)
    assert ids_whole[5 : 5 + n].tolist() == want_ids, (name, ids.tolist(), want_ids)
    assert all(x == -7 for x in ids_whole[5 + n :].tolist() + ids_whole[:5].tolist()), f"{name}: wrote past its ids"
    assert CANARY not in ids_whole.tolist() and CANARY // page_size not in ids_whole.tolist(), (
        f"{name}: read outside the table"
    )
    assert indptr.tolist() == want_ptr and last.tolist() == want_last, (name, indptr.tolist(), last.tolist())
    for whole, n in ((ptr_whole, bs + 1), (last_whole, bs), (qo_whole, bs + 1)):
        assert whole[:5].tolist() == [-7] * 5 and whole[5 + n :].tolist() == [-7] * 5, (
            f"{name}: wrote outside a small buffer"
        )
    if q is not None:
        want_qo = [0]
        for n in q_lens:
            want_qo.append(want_qo[-1] + max(n, 0))
        assert qo.tolist() == want_qo
        if min(q_lens) < 0:
            want_faults.add(DeviceFaultKind.LENGTH)
    got = {k for k in DeviceFaultKind if flags.buffer[k].item()}
    assert got == want_faults and got, (name, got, want_faults)
    report = flags.poll()
    assert report == describe_device_faults([int(k in want_faults) for k in DeviceFaultKind])
    assert not flags.buffer.any() and flags.poll() is None, "poll did not reset the flags"


_SCRIPT = """
import sys
sys.path.insert(0, {here!r})
import test_kv_indices_bounds as t
for name in t.CASES:
    t.run_case(name, "cpu")
t.run_case("row_minus_1", "cpu", bad_slot=True)
t.run_case("device_lens_above_host_total", "cpu", bad_slot=True)
for name in t.CASES:
    t.run_case(name, "cpu", keep_layout=True)
print("ok")
"""


def test_hostile_device_input_interpreted():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", _SCRIPT.format(here=HERE)], env=env, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def test_describe_and_poll_on_cpu():
    assert describe_device_faults([0] * len(DeviceFaultKind)) is None
    text = describe_device_faults([1, 0, 0, 0, 1, 0, 0, 0])
    assert text.startswith("request row") and "slot" in text and "mask" not in text
    flags = DeviceFaultFlags(torch.device("cpu"))
    assert flags.poll() is None
    flags.buffer[DeviceFaultKind.INDEX_CAPACITY] = 1
    assert "index capacity" in flags.poll() and flags.poll() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_device_input_on_gpu(name):
    pytest.importorskip("triton")
    run_case(name, "cuda")
    run_case(name, "cuda", bad_slot=True)
    run_case(name, "cuda", keep_layout=True)
