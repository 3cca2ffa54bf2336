"""Bad input: a typed error before any kernel launch, and the KV pool untouched."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from triton_helpers import requires_interpreter

from attn_core.contract.context import BackendContext
from attn_core.contract.errors import BackendUnavailableError, IncompatibleBackendError, InvalidArgumentError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.memory import MHATokenToKVPool
from attn_core.testing.harness import AttnCase, layer_inputs, make_env, make_layer

pytestmark = requires_interpreter


@pytest.fixture
def no_launch(monkeypatch):
    """Replace the kernel entry points of the backend's launchers with functions that fail the test."""
    import attn_triton.launchers as be

    def boom(*a, **k):
        raise AssertionError("a kernel was launched")

    for name in ("decode_attention", "extend_attention", "verify_attention"):
        monkeypatch.setattr(be, name, boom)


def _setup(mode="EXTEND", requests=((3, 4), (0, 2)), **kw):
    from attn_triton.backend import TritonAttnBackend

    case = AttnCase(mode, requests, **kw)
    env = make_env(case)
    backend = TritonAttnBackend(env.ctx)
    env.batch.attn_backend = backend
    layer = make_layer(case, 0)
    inputs = layer_inputs(env, 0, torch.Generator().manual_seed(0))
    return env, backend, layer, inputs


def _pool_snapshot(env):
    return [t.clone() for t in (env.kv_pool.get_key_buffer(0), env.kv_pool.get_value_buffer(0))]


def _same(a, b):
    return all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) for x, y in zip(a, b))


def test_cpu_without_interpreter_is_unavailable(monkeypatch):
    from attn_triton.backend import TritonAttnBackend

    env = make_env(AttnCase("DECODE", [(3, 1)]))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        TritonAttnBackend(env.ctx)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(head_dim=512), IncompatibleBackendError, "mha head_dim 512 not in 8..256 step 8"),
        (dict(head_dim=36), IncompatibleBackendError, "mha head_dim 36"),
        (dict(dtype=torch.float64), IncompatibleBackendError, "q dtype float64"),
        (dict(num_kv_heads=1, num_q_heads=4), InvalidArgumentError, "token_to_kv_pool"),
    ],
)
def test_bad_context(change, error, match):
    from attn_triton.backend import TritonAttnBackend

    ctx = BackendContext(
        device="cpu",
        dtype=torch.float32,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        token_to_kv_pool=MHATokenToKVPool(16, 1, torch.float32, 2, 32, 1),
    )
    with pytest.raises(error, match=match):
        TritonAttnBackend(dataclasses.replace(ctx, **change))


def test_unknown_option_is_typed():
    from attn_triton.backend import TritonAttnBackend

    env = make_env(AttnCase("DECODE", [(3, 1)]))
    with pytest.raises(InvalidArgumentError, match="options"):
        TritonAttnBackend(env.ctx, block_size=3)


def test_forward_before_metadata(no_launch):
    env, backend, layer, x = _setup()
    before = _pool_snapshot(env)
    with pytest.raises(InvalidArgumentError, match="init_forward_metadata"):
        backend.forward(x["q"], x["k"], x["v"], layer, env.batch)
    assert _same(before, _pool_snapshot(env))


@pytest.mark.parametrize("bad", ["q_shape", "v_shape", "sinks_shape", "q_dtype"])
def test_bad_forward_inputs(no_launch, bad):
    env, backend, layer, x = _setup()
    backend.init_forward_metadata(env.batch)
    q, k, v, extras = x["q"], x["k"], x["v"], {}
    if bad == "q_shape":
        q = q[:, :, :16]
    elif bad == "v_shape":
        v = v[:-1]
    elif bad == "sinks_shape":
        extras["sinks"] = torch.zeros(3)
    else:
        q = q.double()
    before = _pool_snapshot(env)
    with pytest.raises(InvalidArgumentError):
        backend.forward(q, k, v, layer, env.batch, **extras)
    assert _same(before, _pool_snapshot(env))


def test_metadata_of_another_mode(no_launch):
    env, backend, layer, x = _setup()
    backend.init_forward_metadata(env.batch)
    decode = dataclasses.replace(env.batch, forward_mode=ForwardMode.DECODE)
    before = _pool_snapshot(env)
    with pytest.raises(InvalidArgumentError, match="DECODE"):
        backend.forward(x["q"][:2], x["k"][:2], x["v"][:2], layer, decode)
    assert _same(before, _pool_snapshot(env))


def test_cross_layer_without_encoder(no_launch):
    env, backend, _, x = _setup()
    backend.init_forward_metadata(env.batch)
    cross = make_layer(dataclasses.replace(env.case, cross_attention=True), 0)
    with pytest.raises(InvalidArgumentError, match="encoder"):
        backend.forward(x["q"], None, None, cross, env.batch, save_kv_cache=False)


@pytest.mark.parametrize("bad", ["seq_lens_dtype", "too_long", "no_extend_lens", "mask_size", "mask_dtype", "rows"])
def test_bad_batch_metadata(bad):
    mode = "TARGET_VERIFY" if bad.startswith("mask") else "EXTEND"
    env, backend, _, _ = _setup(mode, ((3, 2), (5, 2)))
    b = env.batch
    if bad == "seq_lens_dtype":
        b.seq_lens = b.seq_lens.long()
    elif bad == "too_long":
        b.seq_lens_cpu = b.seq_lens_cpu + 10_000
    elif bad == "no_extend_lens":
        b.extend_seq_lens = None
    elif bad == "mask_size":
        b.spec_info.custom_mask = b.spec_info.custom_mask[:-1]
    elif bad == "mask_dtype":
        b.spec_info.custom_mask = b.spec_info.custom_mask.to(torch.uint8)
    else:
        b.req_pool_indices = b.req_pool_indices[:1]
    with pytest.raises(InvalidArgumentError):
        backend.init_forward_metadata(b)


def test_idle_returns_empty():
    env, backend, layer, x = _setup()
    idle = dataclasses.replace(env.batch, forward_mode=ForwardMode.IDLE, batch_size=0)
    backend.init_forward_metadata(idle)
    o, lse = backend.forward(x["q"][:0], None, None, layer, idle, save_kv_cache=False, return_lse=True)
    assert o.shape == (0, 4 * 32) and lse.shape == (0, 4)


def _assert_verify_mask_and_graph_capture_refused(case: AttnCase) -> None:
    """`case` (a TARGET_VERIFY batch of two requests): its custom-mask verify step and a CUDA-graph
    capture of a 2-request decode are both refused with `UnsupportedFeatureError`."""
    from attn_core.contract.errors import UnsupportedFeatureError
    from attn_core.contract.graph_step import CudaGraphStep
    from attn_triton.backend import TritonAttnBackend

    env = make_env(case)
    backend = TritonAttnBackend(env.ctx)
    with pytest.raises(UnsupportedFeatureError, match="custom mask"):
        backend.init_forward_metadata(env.batch)
    backend.init_cuda_graph_state(4, 4)
    step = CudaGraphStep(
        forward_mode=ForwardMode.DECODE,
        bs=2,
        req_pool_indices=env.batch.req_pool_indices,
        seq_lens=env.batch.seq_lens,
        num_tokens=2,
    )
    with pytest.raises(UnsupportedFeatureError, match="CUDA graphs"):
        backend.capture_cuda_graph_metadata(step)


def test_chunked_local_refusals(no_launch):
    """Chunked local attention: a layer whose chunk size is not the context's, a verify step with a
    custom mask, and CUDA-graph capture are refused with typed errors before any kernel."""
    from attn_core.contract.layer import AttentionLayer

    env, backend, layer, inputs = _setup(attention_chunk_size=4)[:4]
    backend.init_forward_metadata(env.batch)
    other = AttentionLayer(0, layer.num_q_heads, layer.num_kv_heads, layer.head_dim, attention_chunk_size=8)
    with pytest.raises(InvalidArgumentError, match="attention_chunk_size"):
        other(inputs["q"], inputs["k"], inputs["v"], env.batch)

    _assert_verify_mask_and_graph_capture_refused(AttnCase("TARGET_VERIFY", [(5, 3), (9, 3)], attention_chunk_size=4))


def test_window_pool_refusals(no_launch):
    """A sliding-window KV pool with a verify custom mask and with CUDA-graph capture: typed refusals."""

    _assert_verify_mask_and_graph_capture_refused(
        AttnCase("TARGET_VERIFY", [(5, 3), (9, 3)], sliding_window=4, window_pool=True)
    )


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_bf16_queries_over_another_kv_dtype_are_refused(kv_dtype):
    """Both dtypes are declared, but the kernels compute the pair wrongly: construction refuses the mix
    (triton does not declare Feature.MIXED_KV_DTYPE) with a typed error."""
    from attn_triton.backend import TritonAttnBackend

    env = make_env(AttnCase("DECODE", ((5, 1),), dtype="bfloat16", kv_dtype=kv_dtype))
    with pytest.raises(IncompatibleBackendError, match="mixed dtypes"):
        TritonAttnBackend(env.ctx)


@pytest.mark.parametrize(
    "cc,hip,refused", [((8, 0), None, "compute capability 8.0"), ((9, 0), "6.2", "ROCm"), ((8, 9), None, None)]
)
def test_fp8_kv_needs_an_fp8e4nv_gpu(monkeypatch, cc, hip, refused):
    """fp8 caches on a GPU whose Triton has no fp8e4nv conversion are refused at construction, naming
    the kv_dtype (the device query is faked: no GPU here)."""
    import attn_triton.backend as be
    from attn_core.contract.errors import UnsupportedFeatureError

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    monkeypatch.setattr(torch.version, "hip", hip)
    ctx = dataclasses.replace(make_env(AttnCase("DECODE", [(3, 1)], kv_dtype="float8_e4m3fn")).ctx)
    object.__setattr__(ctx, "device", torch.device("cuda", 0))
    if refused is None:
        be._check_fp8_device(ctx)
        return
    with pytest.raises(UnsupportedFeatureError, match=f"kv_dtype torch.float8_e4m3fn.*{refused}"):
        be._check_fp8_device(ctx)
