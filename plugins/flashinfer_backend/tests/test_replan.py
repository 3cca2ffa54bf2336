"""The lean re-plan on CPU with a recording stand-in for FlashInfer's compiled scheduler: the scheduler
gets the batch's host arrays and FA2's argument list as each supported release's `plan` passes them
(`replan.PROFILES`: 0.6.6, and 0.7.2.post1 with its extra `uniform_q_len` and the query rows its prefill
`run` checks), and the wrapper ends up pointing at the step's device arrays. (On the GPU, test_gpu.py
checks a lean re-plan against FlashInfer's own `plan`, per release: scripts/gpu_checks.sh fi-versions.)"""

import random
import types
from itertools import accumulate

import pytest
import torch

from attn_flashinfer import replan
from attn_flashinfer.indices import build_paged_kv, query_layout
from attn_flashinfer.steps import Dims, LayerKey

DIMS = Dims(32, 8, 128, torch.bfloat16, torch.bfloat16)
V066, V07 = replan.PROFILES["0.6.6"], replan.PROFILES["0.7.2.post1"]
RELEASES = pytest.mark.parametrize("internals", [V066, V07], ids=lambda p: p.version)
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
    ids, indptr, last = (
        torch.empty(2000, dtype=torch.int32),
        torch.empty(bs + 1, dtype=torch.int32),
        torch.empty(bs, dtype=torch.int32),
    )
    kv = build_paged_kv(r2t, torch.arange(bs), lens, lens, page_size, out=lambda b, n: (ids, indptr, last))
    q = torch.tensor(q_lens, dtype=torch.int32)
    qo = query_layout(q, torch.empty(bs + 1, dtype=torch.int32), q)
    return kv_lens, q_lens, kv, qo


def _common_tail(args, page_size, causal, internals, graph=False):
    """FA2's scheduler arguments from the head counts on: (..., num_colocated_ctas) in 0.6.6, then
    0.7's uniform_q_len (0: no promise)."""
    tail = (0,) if internals.version.startswith("0.7") else ()
    assert args[8:] == (
        DIMS.num_q_heads,
        DIMS.num_kv_heads,
        page_size,
        graph,
        128,
        128,
        causal,
        99,
        -1,
        False,
        0,
        *tail,
    )


@RELEASES
def test_paged_replan_passes_the_batch_and_points_at_the_step_arrays(internals):
    for seed in range(20):
        page_size = random.Random(seed).choice([1, 16])
        kv_lens, q_lens, kv, qo = _batch(seed, page_size)
        w = _Wrapper()
        w._eagle_verify_fp8kv_sm90_state = object()  # 0.7: a public plan without a uniform_q_len hint clears it
        replan.paged(w, qo, kv, KEY, DIMS, causal=seed % 2 == 0, internals=internals)
        (args,) = w._cached_module.calls
        assert args[3].tolist() == [0, *accumulate(q_lens)]
        assert args[4].tolist() == [0, *accumulate(-(-n // page_size) for n in kv_lens)]
        assert args[5].tolist() == kv_lens
        assert args[6:8] == (sum(q_lens), len(kv_lens))
        _common_tail(args, page_size, seed % 2 == 0, internals)
        assert w._plan_info == [1] and w._batch_size == len(kv_lens) and w._causal == (seed % 2 == 0)
        assert w._qo_indptr_buf is qo.indptr_dev and w._paged_kv_indptr_buf is kv.indptr_dev
        assert w._paged_kv_indices_buf is kv.indices and w._paged_kv_last_page_len_buf is kv.last_page_len_dev
        assert w._custom_mask_buf is None and w._mask_indptr_buf is None
        assert w._max_q_len == max(q_lens) and w._max_kv_len == max(kv_lens)
        if internals is V07:  # the q rows 0.7's run checks q against, and the verify route cleared
            assert w._qo_indptr_last == sum(q_lens) and w._eagle_verify_fp8kv_sm90_state is None
        else:
            assert not hasattr(w, "_qo_indptr_last") and w._eagle_verify_fp8kv_sm90_state is not None


@RELEASES
def test_decode_replan_has_one_query_per_request(internals):
    kv_lens, _, kv, _ = _batch(3, 16)
    bs = len(kv_lens)
    qo = query_layout(torch.ones(bs, dtype=torch.int32), torch.empty(bs + 1, dtype=torch.int32))
    w = _Wrapper()
    replan.decode(w, qo, kv, KEY, DIMS, internals=internals)
    (args,) = w._cached_module.calls
    assert args[3].tolist() == list(range(bs + 1)) and args[5].tolist() == kv_lens and args[6:8] == (bs, bs)
    _common_tail(args, 16, False, internals)
    assert w._qo_indptr_buf is qo.indptr_dev and w._paged_kv_indices_buf is kv.indices and w._max_kv_len == max(kv_lens)
    assert w._paged_kv_last_page_len_buf.shape == (bs,)  # 0.7's decode run reads the batch size from it


@RELEASES
def test_graph_decode_replan_keeps_the_graph_buffers(internals):
    kv_lens, _, kv, _ = _batch(4, 16)
    bs = len(kv_lens)
    qo = query_layout(torch.ones(bs, dtype=torch.int32), torch.empty(bs + 1, dtype=torch.int32))
    w = _Wrapper(graph=True)
    fixed = w._paged_kv_indptr_buf = torch.zeros(bs + 1, dtype=torch.int32)
    replan.decode(w, qo, kv, KEY, DIMS, internals=internals)
    (args,) = w._cached_module.calls
    assert args[5].tolist() == kv_lens and args[6:8] == (bs, bs)
    _common_tail(args, 16, False, internals, graph=True)
    assert w._paged_kv_indptr_buf is fixed and not hasattr(w, "_qo_indptr_buf") and w._plan_info == [1]


@RELEASES
def test_ragged_replan_keys_are_the_new_tokens(internals):
    _, q_lens, _, qo = _batch(5, 16)
    w = _Wrapper()
    replan.ragged(w, qo, KEY, DIMS, internals=internals)
    (args,) = w._cached_module.calls
    assert args[3].tolist() == args[4].tolist() == [0, *accumulate(q_lens)] and args[5].tolist() == q_lens
    _common_tail(args, 1, True, internals)
    assert w._qo_indptr_buf is w._kv_indptr_buf is qo.indptr_dev and w._causal
    assert getattr(w, "_qo_indptr_last", None) == (sum(q_lens) if internals is V07 else None)


def test_lean_replans_default_to_the_verified_flashinfer_versions():
    assert replan.verified("0.6.6") and replan.verified("0.7.2.post1")
    assert not replan.verified("0.6.7") and not replan.verified("0.7.0") and not replan.verified("0.7.3")
    assert replan.mla_verified("0.6.6") and not replan.mla_verified("0.7.2.post1") and not replan.mla_verified("0.6.7")


def test_an_unprofiled_release_takes_the_closest_older_profile():
    assert (
        replan.profile_for("0.7.2.post1") is V07
        and replan.profile_for("0.7.3") is V07
        and replan.profile_for("1.0") is V07
    )
    assert replan.profile_for("0.6.7") is V066 and replan.profile_for("0.7.0") is V066
    assert replan.profile_for("0.0-fake") is V066 and replan.profile_for("garbage") is V066


def test_lean_mla_refuses_a_release_without_the_mla_internals():
    w = types.SimpleNamespace(_use_cuda_graph=False)
    kv = types.SimpleNamespace(indices=None)
    with pytest.raises(NotImplementedError, match="0.7.2.post1.*lean_replan=False"):
        replan.mla(w, None, kv, False, 4, 512, internals=V07)
    with pytest.raises(NotImplementedError, match="0.7.2.post1"):
        replan.mla_run(w, None, None, None, None, None, None, internals=V07)
    assert not hasattr(w, "_causal")  # refused before touching the wrapper
