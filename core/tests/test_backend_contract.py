"""forward() validates before any compute: typed errors naming the argument, undeclared features refused."""

import dataclasses

import pytest
import torch

from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.contract.capabilities import Feature
from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.contract.layer import AttentionLayer
from attn_core.testing.harness import AttnCase, layer_inputs, make_env, make_layer


@pytest.fixture
def env():
    e = make_env(AttnCase(ForwardMode.EXTEND, ((3, 4), (0, 2))))
    e.backend = TorchNativeBackend(e.ctx)
    e.batch.attn_backend = e.backend
    e.backend.init_forward_metadata(e.batch)
    e.inputs = layer_inputs(e, 0, torch.Generator().manual_seed(0))
    return e


def _call(env, layer=None, **override):
    args = {**env.inputs, **override}
    sinks = args.pop("sinks")
    extras = {k: args.pop(k) for k in list(args) if k not in ("q", "k", "v")}
    if sinks is not None:
        extras["sinks"] = sinks
    return env.backend.forward(args["q"], args["k"], args["v"], layer or make_layer(env.case, 0), env.batch, **extras)


def test_bad_shapes_and_dtypes_raise_before_compute(env):
    pool_before = env.kv_pool.get_key_buffer(0).clone()
    with pytest.raises(InvalidArgumentError, match=r"^q: expected shape \(6, 4, 32\)"):
        _call(env, q=env.inputs["q"][:5])
    with pytest.raises(InvalidArgumentError, match="^k: "):
        _call(env, k=env.inputs["k"][:, :1])
    with pytest.raises(InvalidArgumentError, match="^v: "):
        _call(env, v=env.inputs["v"][:, :, :8])
    with pytest.raises(InvalidArgumentError, match="^q: expected dtype torch.float32"):
        _call(env, q=env.inputs["q"].double())
    with pytest.raises(InvalidArgumentError, match="^k: expected the new tokens' keys"):
        _call(env, k=None)
    with pytest.raises(InvalidArgumentError, match="^extras"):
        _call(env, bogus=1)
    with pytest.raises(InvalidArgumentError, match="^sinks"):
        _call(env, sinks=torch.zeros(3))
    wrong = AttentionLayer(0, num_q_heads=8, num_kv_heads=2, head_dim=16)
    with pytest.raises(InvalidArgumentError, match="layer heads"):
        _call(env, layer=wrong)
    assert torch.equal(
        torch.nan_to_num(env.kv_pool.get_key_buffer(0), nan=7.0), torch.nan_to_num(pool_before, nan=7.0)
    )  # nothing written


def test_forward_without_metadata_is_refused(env):
    fresh = TorchNativeBackend(env.ctx)
    with pytest.raises(InvalidArgumentError, match="init_forward_metadata"):
        fresh.forward(env.inputs["q"], env.inputs["k"], env.inputs["v"], make_layer(env.case, 0), env.batch)


class _Limited(TorchNativeBackend):
    """A backend declaring less than it could do: the base class must refuse the rest."""

    name = "limited"
    capabilities = dataclasses.replace(
        TorchNativeBackend.capabilities,
        features=frozenset({Feature.LSE_OUTPUT}),
        forward_modes=frozenset({ForwardMode.DECODE, ForwardMode.IDLE}),
    )


def test_undeclared_capabilities_are_refused(env):
    b = _Limited(env.ctx)
    env.batch.attn_backend = b
    layer = make_layer(env.case, 0)
    with pytest.raises(UnsupportedFeatureError, match="forward mode EXTEND"):  # refused before any metadata
        b.init_forward_metadata(env.batch)
    object.__setattr__(
        b, "capabilities", dataclasses.replace(_Limited.capabilities, forward_modes=frozenset(ForwardMode))
    )
    b.init_forward_metadata(env.batch)
    for kw, what in [
        (dict(logit_cap=2.0), "logit_cap"),
        (dict(sliding_window_size=4), "sliding_window_size"),
        (dict(is_cross_attention=True), "cross attention"),
    ]:
        bad = AttentionLayer(1, 4, 2, 32, **kw)
        with pytest.raises(UnsupportedFeatureError, match=what):
            b.forward(env.inputs["q"], env.inputs["k"], env.inputs["v"], bad, env.batch)
    with pytest.raises(UnsupportedFeatureError, match="sinks"):
        b.forward(env.inputs["q"], env.inputs["k"], env.inputs["v"], layer, env.batch, sinks=torch.zeros(4))


def test_layer_and_context_validation():
    with pytest.raises(InvalidArgumentError, match="num_q_heads"):
        AttentionLayer(0, num_q_heads=6, num_kv_heads=4, head_dim=8)
    with pytest.raises(InvalidArgumentError, match="logit_cap"):
        AttentionLayer(0, 4, 2, 8, logit_cap=-1.0)
    from attn_core.contract.context import BackendContext

    with pytest.raises(InvalidArgumentError, match="head_dim"):
        BackendContext(
            device="cpu",
            dtype=torch.float32,
            num_q_heads=4,
            num_kv_heads=1,
            head_dim=10,
            attention_arch="mla",
            kv_lora_rank=8,
        )
    with pytest.raises(InvalidArgumentError, match="attention_arch"):
        BackendContext(
            device="cpu", dtype=torch.float32, num_q_heads=4, num_kv_heads=1, head_dim=8, attention_arch="gqa"
        )
    ctx = BackendContext(
        device="cpu",
        dtype=torch.bfloat16,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=8,
        sliding_window_size=128,
        speculative_num_draft_tokens=4,
        speculative_topk=4,
    )
    req = ctx.requirements()
    assert {Feature.SLIDING_WINDOW, Feature.CUSTOM_MASK, Feature.SPEC_TOPK_GT1} <= req.features
    assert ForwardMode.TARGET_VERIFY in req.forward_modes and req.q_dtype == "bfloat16"
