"""The Triton backend's scratch (attn-core's `DeviceScratch`): the decode split views per (bs, max_splits)
and the step's key index views per batch size are handed out again until the buffers grow, and views
handed out before a growth keep their own memory; engine-style steps reuse one index buffer, and the
index kernel stays inside the step's keys."""

import torch
from triton_helpers import requires_interpreter

from attn_core.memory.scratch import DeviceScratch
from attn_triton.metadata import main_kv, split_views


def test_split_views_shape_reuse_and_growth():
    hq, dv = 3, 5
    s = DeviceScratch(torch.device("cpu"), min_entries=16)
    o, lse = split_views(s, 4, 2, hq, dv)
    assert o.shape == (4, hq, 2, dv) and lse.shape == (4, hq, 2)
    assert o.is_contiguous() and lse.is_contiguous() and o.dtype == lse.dtype == torch.float32
    again = split_views(s, 4, 2, hq, dv)
    assert again[0] is o and again[1] is lse  # no per-step view construction
    o.fill_(7.0)
    small = split_views(s, 2, 2, hq, dv)  # fits: the same memory, a different shape
    assert small[0].data_ptr() == o.data_ptr() and small[0].shape == (2, hq, 2, dv)
    big_o, big_lse = split_views(s, 64, 4, hq, dv)  # grows: new buffers, fresh views
    assert big_o.shape == (64, hq, 4, dv) and big_lse.shape == (64, hq, 4)
    assert big_o.data_ptr() != o.data_ptr()
    big_o.fill_(-1.0)
    assert bool((o == 7.0).all())  # an earlier step's views still own the old buffer
    after = split_views(s, 4, 2, hq, dv)
    assert after[0] is not o and after[0].data_ptr() == big_o.data_ptr()  # views of the grown buffer


def test_main_kv_views_per_batch_size_and_growth():
    s = DeviceScratch(torch.device("cpu"), min_entries=16)
    a = main_kv(s, 2, 10)
    assert a.indptr.shape == (3,) and a.indices.shape == (23,)  # the rest of a 26-entry buffer: room for 10
    assert a.indices.data_ptr() == a.indptr.data_ptr() + 3 * 4
    assert main_kv(s, 2, 12) is a  # fits: the same views, no per-step view construction
    zero = main_kv(s, 3, 0)
    assert zero.indptr.shape == (4,) and zero.indices.shape == (22,) and zero.indptr.data_ptr() == a.indptr.data_ptr()
    a.indices.fill_(5)
    c = main_kv(s, 4, 40)  # grows to twice what was asked
    assert c.indptr.data_ptr() != a.indptr.data_ptr() and c.indices.shape == (2 * 45 - 5,)
    c.indices.fill_(-1)
    assert bool((a.indices == 5).all())  # an earlier step's views keep the old buffer
    again = main_kv(s, 2, 10)
    assert again is not a and again.indptr.data_ptr() == c.indptr.data_ptr()  # views of the grown buffer


@requires_interpreter
def test_decode_steps_reuse_the_index_buffer_and_stay_inside_it(monkeypatch):
    """Engine-style steps on one backend: a large decode step grows the shared index buffer, a smaller
    one reuses it; a hostile step whose device lengths exceed the host sum writes nothing past its own
    keys (the buffer's tail keeps its poison) and reports INDEX_CAPACITY. Validation "basic" as a GPU
    runs it (on the CPU every level validates fully, which would refuse the hostile step first)."""
    import attn_core.contract.backend

    monkeypatch.setattr(attn_core.contract.backend, "effective_level", lambda ctx: ctx.validation)
    from attn_core.contract.context import BackendContext
    from attn_core.memory import MHATokenToKVPool, PagedTokenAllocator, ReqToTokenPool
    from attn_core.ops.device_faults import FAULT_DESCRIPTIONS, DeviceFaultKind
    from attn_core.testing.batch_builder import build_forward_batch
    from attn_triton.backend import TritonAttnBackend

    page, hkv, d = 4, 1, 16
    slots = 512
    req_pool = ReqToTokenPool(8, 64)
    kv_pool = MHATokenToKVPool(slots, page, torch.float32, hkv, d, 1)
    alloc = PagedTokenAllocator(slots, page)
    ctx = BackendContext(
        device="cpu",
        dtype=torch.float32,
        num_q_heads=2,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=page,
        max_batch_size=8,
        max_context_len=64,
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
        validation="basic",
    )
    backend = TritonAttnBackend(ctx)

    def step(requests):
        return build_forward_batch(
            "DECODE", requests, req_to_token_pool=req_pool, allocator=alloc, token_to_kv_pool=kv_pool
        )

    big = step([(40, 1)] * 5)
    backend.init_forward_metadata(big)
    kv = backend.forward_metadata.kv
    buf = backend.planner.scratch.get("kv", 1)  # the step's index buffer (asking for 1 entry never grows it)
    assert kv.indptr.data_ptr() == buf.data_ptr()
    assert kv.indices.shape[0] >= big.seq_lens_sum
    for r in range(5):  # each request's keys are its table row
        row = int(big.req_pool_indices[r])
        ids = kv.indices[int(kv.indptr[r]) : int(kv.indptr[r + 1])]
        assert torch.equal(ids, req_pool.req_to_token[row, :41])
    rows = big.req_pool_indices.clone()

    small = step([(9, 1), (12, 1)])
    small.req_pool_indices = rows[:2].clone()  # the first two rows again
    small.seq_lens = torch.tensor([20, 30], dtype=torch.int32)  # the device says 50 keys ...
    small.seq_lens_cpu = torch.tensor([10, 13], dtype=torch.int32)  # ... the host 23 (validation "basic" reads these)
    small.seq_lens_sum = 23
    buf.fill_(-7)
    backend.init_forward_metadata(small)
    kv = backend.forward_metadata.kv
    assert backend.planner.scratch.get("kv", 1) is buf and kv.indptr.data_ptr() == buf.data_ptr()  # reused
    # the kernel is held to the host sum (capacity 23)
    end = 3 + 23
    assert bool((buf[end:] == -7).all()), "the index kernel wrote past the step's keys"
    assert kv.indptr.tolist() == [0, 20, 23]
    assert torch.equal(kv.indices[:20], req_pool.req_to_token[int(rows[0]), :20])
    fault = backend.poll_device_fault()  # the index kernel's refusal (the step check's, sharing the word, too)
    assert FAULT_DESCRIPTIONS[DeviceFaultKind.INDEX_CAPACITY] in fault


@requires_interpreter
def test_plain_decode_steps_of_one_size_share_a_metadata_object_with_fresh_indices():
    """Decode steps of the same batch size hand out the same plan object (only the index contents
    change), each step's indices are its own table rows, and a step of another size gets its own."""
    from attn_core.contract.context import BackendContext
    from attn_core.memory import MHATokenToKVPool, PagedTokenAllocator, ReqToTokenPool
    from attn_core.testing.batch_builder import build_forward_batch
    from attn_triton.backend import TritonAttnBackend

    page, slots = 4, 512
    req_pool = ReqToTokenPool(16, 64)
    kv_pool = MHATokenToKVPool(slots, page, torch.float32, 1, 16, 1)
    alloc = PagedTokenAllocator(slots, page)
    ctx = BackendContext(
        device="cpu",
        dtype=torch.float32,
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=16,
        page_size=page,
        max_batch_size=16,
        max_context_len=64,
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
    )
    backend = TritonAttnBackend(ctx)
    seen = []
    for requests in (
        [(30, 1), (1, 1)],
        [(5, 1), (9, 1)],
        [(7, 1), (7, 1), (7, 1)],
        [(20, 1), (3, 1)],
    ):  # first the largest
        b = build_forward_batch(
            "DECODE", requests, req_to_token_pool=req_pool, allocator=alloc, token_to_kv_pool=kv_pool
        )
        backend.init_forward_metadata(b)
        meta = backend.forward_metadata
        seen.append(meta)
        kv = meta.kv
        assert kv.indptr.tolist() == [0, *torch.cumsum(b.seq_lens, 0).tolist()]
        for r in range(b.batch_size):
            row, n = int(b.req_pool_indices[r]), int(b.seq_lens[r])
            assert torch.equal(kv.indices[int(kv.indptr[r]) : int(kv.indptr[r + 1])], req_pool.req_to_token[row, :n])
    assert seen[0] is seen[1] is seen[3] and seen[2] is not seen[0]
