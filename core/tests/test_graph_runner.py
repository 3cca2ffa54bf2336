"""CudaGraphRunner: batches padded to the next captured size give the same outputs (and KV writes) as
eager runs, for DECODE and TARGET_VERIFY; padding rows carry the backend's fill value, request row 0
and slot 0. On CPU the capture/replay metadata path runs without graphs; on a GPU real graphs."""

from __future__ import annotations

import pytest
import torch

from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.backends.torch_native.spec import CAPABILITIES
from attn_core.batching.tbo_split import TboSplit, split_forward_batch
from attn_core.contract.capabilities import CudaGraphLevel
from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.engine.graph_runner import CudaGraphRunner
from attn_core.testing.harness import AttnCase, layer_inputs, make_env, make_layer, reference_for_layer
from attn_core.testing.reference import relative_error, tolerance


class Setup:
    """A case's pools and batch, its layers, per-layer inputs stacked as `[T, L, H, D]`, and the layers
    as a `run_layers` callable."""

    def __init__(self, case: AttnCase):
        self.case = case
        self.env = make_env(case)
        self.layers = [make_layer(case, i) for i in range(case.num_layers)]
        gen = torch.Generator().manual_seed(case.seed + 1)
        self.per_layer = [layer_inputs(self.env, i, gen) for i in range(case.num_layers)]
        self.inputs = {n: torch.stack([x[n] for x in self.per_layer], dim=1) for n in ("q", "k", "v")}
        self.shapes = {n: (tuple(t.shape[1:]), t.dtype) for n, t in self.inputs.items()}
        self.kv0 = self.kv()

    def run_layers(self, batch, inputs):
        outs = [
            layer(inputs["q"][:, i], inputs["k"][:, i], inputs["v"][:, i], batch) for i, layer in enumerate(self.layers)
        ]
        return torch.stack(outs, dim=1)

    def kv(self):
        pool = self.env.kv_pool
        return [(pool.get_key_buffer(i).clone(), pool.get_value_buffer(i).clone()) for i in range(self.case.num_layers)]

    def restore_kv(self):
        pool = self.env.kv_pool
        for i, (k, v) in enumerate(self.kv0):
            pool.get_key_buffer(i).copy_(k)
            pool.get_value_buffer(i).copy_(v)

    def sub_batch(self, n: int):
        """The first n requests of the batch (and their inputs)."""
        b = self.env.batch
        if n == b.batch_size:
            return b, self.inputs
        per = b.num_tokens // b.batch_size
        sub, _ = split_forward_batch(b, TboSplit(n, n * per))
        return sub, {k: v[: n * per] for k, v in self.inputs.items()}

    def eager(self, backend, batch, inputs):
        self.restore_kv()
        batch.attn_backend = backend
        backend.init_forward_metadata(batch)
        out = self.run_layers(batch, inputs)
        return out, self.kv()


def _assert_equal_outside_dummy(kv_a, kv_b, page_size):
    for (ka, va), (kb, vb) in zip(kv_a, kv_b):
        for a, b in ((ka, kb), (va, vb)):
            assert torch.equal(torch.nan_to_num(a[page_size:], nan=9.0), torch.nan_to_num(b[page_size:], nan=9.0))


def _check_runner(setup: Setup, backend_cls, sizes, run_sizes, device_graphs=None, rtol=1e-5):
    case = setup.case
    nd = case.requests[0].extend_len if case.mode.is_target_verify() else None
    runner = CudaGraphRunner(
        backend_cls(setup.env.ctx),
        sizes,
        setup.run_layers,
        setup.shapes,
        num_draft_tokens=nd,
        use_cuda_graph=device_graphs,
    )
    eager_backend = backend_cls(setup.env.ctx)
    for n in run_sizes:
        batch, inputs = setup.sub_batch(n)
        want, kv_want = setup.eager(eager_backend, batch, inputs)
        setup.restore_kv()
        got = runner.run(batch, inputs)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol)  # padded widths differ: not bitwise
        _assert_equal_outside_dummy(setup.kv(), kv_want, case.page_size)
    return runner


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_padded_to_captured_sizes_equals_eager(page_size):
    case = AttnCase(ForwardMode.DECODE, ((7, 1), (0, 1), (30, 1), (12, 1), (3, 1)), page_size=page_size, sinks=False)
    setup = Setup(case)
    # 5 -> 8, 3 -> 4, 1 -> 2, 2 exactly; larger batches first so stale rows would show
    _check_runner(setup, TorchNativeBackend, [2, 4, 8], [5, 3, 1, 2])
    # and the whole batch against the float64 reference
    setup.restore_kv()
    runner = CudaGraphRunner(TorchNativeBackend(setup.env.ctx), [8], setup.run_layers, setup.shapes)
    out = runner.run(setup.env.batch, setup.inputs)
    setup.restore_kv()
    for i, layer in enumerate(setup.layers):
        ref, _ = reference_for_layer(setup.env, layer, setup.per_layer[i])
        assert relative_error(out[:, i].reshape(ref.shape), ref) <= tolerance(torch.float32)


def test_verify_padded_to_captured_sizes_equals_eager():
    case = AttnCase(ForwardMode.TARGET_VERIFY, ((5, 3), (0, 3), (11, 3)), page_size=4)
    _check_runner(Setup(case), TorchNativeBackend, [2, 4], [3, 1, 2])


class FillThree(TorchNativeBackend):
    """torch_native with another padding fill value; records the replay arguments."""

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 3

    def replay_cuda_graph_metadata(self, step):
        self.replayed = (
            step.bs,
            step.req_pool_indices.clone(),
            step.seq_lens.clone(),
            step.seq_lens_sum,
            step.seq_lens_cpu.clone(),
        )
        super().replay_cuda_graph_metadata(step)


def test_padding_rows_use_fill_value_row_zero_and_dummy_slot():
    case = AttnCase(ForwardMode.DECODE, ((7, 1), (4, 1), (9, 1)))
    setup = Setup(case)
    runner = _check_runner(setup, FillThree, [5], [3])
    bs, rpi, seq, seq_sum, seq_cpu = runner.backend.replayed
    b = setup.env.batch
    assert bs == 5
    assert rpi.tolist() == b.req_pool_indices.tolist() + [0, 0]
    assert seq.tolist() == b.seq_lens.tolist() + [3, 3] == seq_cpu.tolist()
    assert seq_sum == b.seq_lens_sum + 6
    assert runner.out_cache_loc[:5].tolist() == b.out_cache_loc.tolist() + [0, 0]


def test_bad_input_is_refused():
    setup = Setup(AttnCase(ForwardMode.DECODE, ((7, 1), (4, 1), (9, 1))))
    ctx = setup.env.ctx
    runner = CudaGraphRunner(TorchNativeBackend(ctx), [2], setup.run_layers, setup.shapes)
    assert runner.modes == [ForwardMode.DECODE]
    with pytest.raises(InvalidArgumentError, match="forward_batch"):
        runner.run(setup.env.batch, setup.inputs)  # 3 > the largest captured size
    with pytest.raises(InvalidArgumentError, match="batch_sizes"):
        CudaGraphRunner(TorchNativeBackend(ctx), [], setup.run_layers, setup.shapes)
    with pytest.raises(InvalidArgumentError, match="use_cuda_graph"):
        CudaGraphRunner(TorchNativeBackend(ctx), [2], setup.run_layers, setup.shapes, use_cuda_graph=True)
    no_graphs = type(
        "NoGraphs",
        (TorchNativeBackend,),
        {"capabilities": CAPABILITIES.__class__(**{**CAPABILITIES.__dict__, "cuda_graph": CudaGraphLevel.NEVER})},
    )
    with pytest.raises(UnsupportedFeatureError, match="CUDA graphs"):
        CudaGraphRunner(no_graphs(ctx), [2], setup.run_layers, setup.shapes)
    extend = Setup(AttnCase(ForwardMode.EXTEND, ((1, 2),)))
    runner = CudaGraphRunner(TorchNativeBackend(extend.env.ctx), [2], extend.run_layers, extend.shapes)
    with pytest.raises(InvalidArgumentError, match="EXTEND"):
        runner.run(extend.env.batch, extend.inputs)


def _triton_backend_class():
    pytest.importorskip("attn_triton")
    from attn_triton.spec import SPEC

    return SPEC.load()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch_native", "triton"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_replay_equals_eager_on_gpu(backend, dtype):
    cls = TorchNativeBackend if backend == "torch_native" else _triton_backend_class()
    rtol = 1e-5 if dtype == "float32" else 2e-2
    decode = AttnCase(
        ForwardMode.DECODE,
        tuple((n, 1) for n in (700, 3, 129, 64, 1000)),
        head_dim=64,
        page_size=16,
        dtype=dtype,
        device="cuda",
    )
    _check_runner(Setup(decode), cls, [1, 2, 4, 8], [5, 3, 1, 2], rtol=rtol)
    verify = AttnCase(
        ForwardMode.TARGET_VERIFY, ((300, 4), (17, 4), (90, 4)), head_dim=64, page_size=16, dtype=dtype, device="cuda"
    )
    _check_runner(Setup(verify), cls, [2, 4], [3, 1, 2], rtol=rtol)
