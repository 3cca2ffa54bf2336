"""The lean re-plan on CPU with a recording stand-in for FlashInfer's compiled scheduler: the scheduler
gets the batch's host arrays and FA2's argument list, and the wrapper ends up pointing at the step's
device arrays. (On the GPU, test_gpu.py checks a lean re-plan against FlashInfer's own `plan`.)"""

import random
from itertools import accumulate

import torch

from attn_flashinfer import replan
from attn_flashinfer.indices import build_paged_kv, query_layout
from attn_flashinfer.steps import Dims, LayerKey

DIMS = Dims(32, 8, 128, torch.bfloat16, torch.bfloat16)
KEY = LayerKey(window_left=99, logit_cap=0.0, scaling=0.1, cross=False)


class _Scheduler:
    def __init__(self):
        self.calls = []

    def plan(self, *args):
        self.calls.append(args)
        return [len(self.calls)]  # stands for FlashInfer's plan info


class _Wrapper:
    def __init__(self, graph: bool = False):
        self.is_cuda_graph_enabled = graph
        self._cached_module = _Scheduler()
        self._float_workspace_buffer = torch.zeros(8, dtype=torch.uint8)
        self._int_workspace_buffer = torch.zeros(8, dtype=torch.uint8)
        self._pin_memory_int_workspace_buffer = torch.zeros(8, dtype=torch.uint8)
        self._custom_mask_buf = torch.ones(3, dtype=torch.uint8)  # left over from a masked plan
        self._mask_indptr_buf = torch.zeros(2, dtype=torch.int32)


def _batch(seed: int, page_size: int):
    rng = random.Random(seed)
    bs = rng.randint(1, 9)
    kv_lens = [rng.choice([0, 1, page_size, rng.randint(1, 300)]) for _ in range(bs)]
    q_lens = [rng.randint(0, 20) for _ in range(bs)]
    r2t = torch.arange(bs * 320, dtype=torch.int32).view(bs, 320)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    ids, indptr, last = torch.empty(2000, dtype=torch.int32), torch.empty(bs + 1, dtype=torch.int32), torch.empty(bs, dtype=torch.int32)
    kv = build_paged_kv(r2t, torch.arange(bs), lens, lens, page_size, out=lambda b, n: (ids, indptr, last))
    q = torch.tensor(q_lens, dtype=torch.int32)
    qo = query_layout(q, torch.empty(bs + 1, dtype=torch.int32), q)
    return kv_lens, q_lens, kv, qo


def _common_tail(args, page_size, causal, graph=False):
    assert args[8:] == (DIMS.num_q_heads, DIMS.num_kv_heads, page_size, graph, 128, 128, causal, 99, -1, False, 0)


def test_paged_replan_passes_the_batch_and_points_at_the_step_arrays():
    for seed in range(20):
        page_size = random.Random(seed).choice([1, 16])
        kv_lens, q_lens, kv, qo = _batch(seed, page_size)
        w = _Wrapper()
        replan.paged(w, qo, kv, KEY, DIMS, causal=seed % 2 == 0)
        (args,) = w._cached_module.calls
        assert args[3].tolist() == [0, *accumulate(q_lens)]
        assert args[4].tolist() == [0, *accumulate(-(-n // page_size) for n in kv_lens)]
        assert args[5].tolist() == kv_lens
        assert args[6:8] == (sum(q_lens), len(kv_lens))
        _common_tail(args, page_size, seed % 2 == 0)
        assert w._plan_info == [1] and w._batch_size == len(kv_lens) and w._causal == (seed % 2 == 0)
        assert w._qo_indptr_buf is qo.indptr_dev and w._paged_kv_indptr_buf is kv.indptr_dev
        assert w._paged_kv_indices_buf is kv.indices and w._paged_kv_last_page_len_buf is kv.last_page_len_dev
        assert w._custom_mask_buf is None and w._mask_indptr_buf is None
        assert w._max_q_len == max(q_lens) and w._max_kv_len == max(kv_lens)


def test_decode_replan_has_one_query_per_request():
    kv_lens, _, kv, _ = _batch(3, 16)
    bs = len(kv_lens)
    qo = query_layout(torch.ones(bs, dtype=torch.int32), torch.empty(bs + 1, dtype=torch.int32))
    w = _Wrapper()
    replan.decode(w, qo, kv, KEY, DIMS)
    (args,) = w._cached_module.calls
    assert args[3].tolist() == list(range(bs + 1)) and args[5].tolist() == kv_lens and args[6:8] == (bs, bs)
    _common_tail(args, 16, False)
    assert w._qo_indptr_buf is qo.indptr_dev and w._paged_kv_indices_buf is kv.indices and w._max_kv_len == max(kv_lens)


def test_graph_decode_replan_keeps_the_graph_buffers():
    kv_lens, _, kv, _ = _batch(4, 16)
    bs = len(kv_lens)
    qo = query_layout(torch.ones(bs, dtype=torch.int32), torch.empty(bs + 1, dtype=torch.int32))
    w = _Wrapper(graph=True)
    fixed = w._paged_kv_indptr_buf = torch.zeros(bs + 1, dtype=torch.int32)
    replan.decode(w, qo, kv, KEY, DIMS)
    (args,) = w._cached_module.calls
    assert args[5].tolist() == kv_lens and args[6:8] == (bs, bs)
    _common_tail(args, 16, False, graph=True)
    assert w._paged_kv_indptr_buf is fixed and not hasattr(w, "_qo_indptr_buf") and w._plan_info == [1]


def test_ragged_replan_keys_are_the_new_tokens():
    _, q_lens, _, qo = _batch(5, 16)
    w = _Wrapper()
    replan.ragged(w, qo, KEY, DIMS)
    (args,) = w._cached_module.calls
    assert args[3].tolist() == args[4].tolist() == [0, *accumulate(q_lens)] and args[5].tolist() == q_lens
    _common_tail(args, 1, True)
    assert w._qo_indptr_buf is w._kv_indptr_buf is qo.indptr_dev and w._causal


def test_lean_replans_default_to_the_verified_flashinfer_versions():
    assert replan.verified("0.6.6")
    assert not replan.verified("0.6.7") and not replan.verified("0.7.0")
