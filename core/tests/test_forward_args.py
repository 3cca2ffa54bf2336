"""`AttentionBackend.forward`'s per-layer argument checks. The common case is decided by one cheap expression
and the diagnosis runs only outside it, so: every bad input must get the same typed error (class and
argument) before any kernel and KV write, on a layer's first call and on a call after a successful one
with the same layer; several faults at once get the first in the fixed check order; changing a layer's
settings after a successful call is seen; and valid inputs reach the kernel as the `[rows, heads, dim]`
views of the caller's tensors, whichever path accepted them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attn_core.backends.torch_native.backend import TorchNativeBackend
from attn_core.contract.capabilities import Feature
from attn_core.contract.errors import InvalidArgumentError, UnsupportedFeatureError
from attn_core.contract.forward_mode import ForwardMode
from attn_core.testing.harness import AttnCase, layer_inputs, make_env, make_layer

CASES = {
    "decode": AttnCase(ForwardMode.DECODE, ((5, 1), (9, 1), (2, 1)), page_size=4, num_layers=1),
    "extend": AttnCase(ForwardMode.EXTEND, ((3, 4), (0, 2)), page_size=4, num_layers=1),
}


class Recording(TorchNativeBackend):
    """torch_native that records the arguments its kernels were called with."""

    name = "recording"
    capabilities = dataclasses.replace(
        TorchNativeBackend.capabilities, features=TorchNativeBackend.capabilities.features - {Feature.LOGIT_CAP}
    )

    def __init__(self, ctx):
        super().__init__(ctx)
        self.calls: list[tuple] = []

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        self.calls.append((q, k, v))
        return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **extras)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **extras):
        self.calls.append((q, k, v))
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **extras)


def _ready(mode: str):
    env = make_env(CASES[mode])
    backend = Recording(env.ctx)
    env.batch.attn_backend = backend
    backend.init_forward_metadata(env.batch)
    inputs = layer_inputs(env, 0, torch.Generator().manual_seed(1))
    return env, backend, make_layer(env.case, 0), inputs


def _on_meta(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="meta")


# name -> (spoil(inputs, layer) -> (q, k, v, save_kv_cache, extras), error class, argument)
def _args(i, **change):
    a = {"q": i["q"], "k": i["k"], "v": i["v"], "save_kv_cache": True, "extras": {}}
    a.update(change)
    return a


def _set(layer, **fields):
    for name, value in fields.items():
        setattr(layer, name, value)


FAULTS = {
    "q_head_count": (lambda i, ly: _args(i, q=i["q"][:, :-1]), InvalidArgumentError, "q"),
    "q_flat_width": (lambda i, ly: _args(i, q=i["q"].flatten(1)[:, :-2]), InvalidArgumentError, "q"),
    "q_rows": (lambda i, ly: _args(i, q=i["q"][:-1]), InvalidArgumentError, "q"),
    "q_dtype": (lambda i, ly: _args(i, q=i["q"].double()), InvalidArgumentError, "q"),
    "q_device": (lambda i, ly: _args(i, q=_on_meta(i["q"])), InvalidArgumentError, "q"),
    "k_shape": (lambda i, ly: _args(i, k=i["k"][:, :1]), InvalidArgumentError, "k"),
    "k_dtype": (lambda i, ly: _args(i, k=i["k"].half()), InvalidArgumentError, "k"),
    "k_device": (lambda i, ly: _args(i, k=_on_meta(i["k"])), InvalidArgumentError, "k"),
    "v_shape": (lambda i, ly: _args(i, v=i["v"][..., :8]), InvalidArgumentError, "v"),
    "v_dtype": (lambda i, ly: _args(i, v=i["v"].double()), InvalidArgumentError, "v"),
    "v_device": (lambda i, ly: _args(i, v=_on_meta(i["v"])), InvalidArgumentError, "v"),
    "v_missing": (lambda i, ly: _args(i, v=None), InvalidArgumentError, "v"),
    "k_missing_with_save": (lambda i, ly: _args(i, k=None, v=None), InvalidArgumentError, "k"),
    "k_missing_v_given": (lambda i, ly: _args(i, k=None), InvalidArgumentError, "k"),
    "unknown_extra": (lambda i, ly: _args(i, extras={"bogus": 1}), InvalidArgumentError, "extras"),
    "sinks_shape": (lambda i, ly: _args(i, extras={"sinks": torch.zeros(3)}), InvalidArgumentError, "sinks"),
    "layer_q_heads": (lambda i, ly: (_set(ly, num_q_heads=8), _args(i))[1], InvalidArgumentError, "layer heads"),
    "layer_head_dim": (
        lambda i, ly: (_set(ly, head_dim=16), _args(i))[1],
        InvalidArgumentError,
        "layer head_dim/v_head_dim",
    ),
    "layer_logit_cap": (lambda i, ly: (_set(ly, logit_cap=5.0), _args(i))[1], UnsupportedFeatureError, None),
    # several faults: the first in the check order wins (extras, layer, q shape, q device, dtypes, k/v device,
    # k/v shape)
    "extras_before_layer": (
        lambda i, ly: (_set(ly, num_q_heads=8), _args(i, extras={"bogus": 1}))[1],
        InvalidArgumentError,
        "extras",
    ),
    "q_shape_before_q_device": (lambda i, ly: _args(i, q=_on_meta(i["q"][:-1])), InvalidArgumentError, "q"),
    "k_dtype_before_q_device": (lambda i, ly: _args(i, q=_on_meta(i["q"]), k=i["k"].half()), InvalidArgumentError, "q"),
    "v_dtype_before_k_device": (lambda i, ly: _args(i, k=_on_meta(i["k"]), v=i["v"].half()), InvalidArgumentError, "v"),
    "k_device_before_k_shape": (lambda i, ly: _args(i, k=_on_meta(i["k"][:, :1])), InvalidArgumentError, "k"),
}


def _forward(backend, layer, batch, a):
    return backend.forward(a["q"], a["k"], a["v"], layer, batch, a["save_kv_cache"], **a["extras"])


@pytest.mark.parametrize("after_success", [False, True], ids=["first_call", "after_a_good_call"])
@pytest.mark.parametrize("mode", sorted(CASES))
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_every_fault_gets_its_typed_error_before_any_kernel_or_kv_write(fault, mode, after_success):
    env, backend, layer, inputs = _ready(mode)
    if after_success:
        _forward(backend, layer, env.batch, _args(inputs))
        assert len(backend.calls) == 1
    k_before = env.kv_pool.get_key_buffer(0).clone()
    v_before = env.kv_pool.get_value_buffer(0).clone()
    spoil, error, argument = FAULTS[fault]
    args = spoil(inputs, layer)
    with pytest.raises(error) as caught:
        _forward(backend, layer, env.batch, args)
    assert type(caught.value) is error
    if argument is not None:
        assert caught.value.argument == argument
    assert len(backend.calls) == int(after_success)  # no kernel for the bad call
    for buf, before in ((env.kv_pool.get_key_buffer(0), k_before), (env.kv_pool.get_value_buffer(0), v_before)):
        assert torch.equal(torch.nan_to_num(buf, nan=7.0), torch.nan_to_num(before, nan=7.0))  # nothing written


@pytest.mark.parametrize("after_success", [False, True], ids=["first_call", "after_a_good_call"])
def test_cross_attention_keys_are_checked_against_the_encoder_rows_not_the_step_tokens(after_success):
    """A cross-attention layer's new K/V are the new requests' encoder tokens (5 here), not the step's
    4 decoder tokens: K/V of the decoder's row count are refused."""
    env = make_env(
        AttnCase(ForwardMode.EXTEND, ((0, 3, 5), (2, 1, 7)), page_size=4, num_layers=1, cross_attention=True)
    )
    backend = TorchNativeBackend(env.ctx)
    backend.init_forward_metadata(env.batch)
    layer = make_layer(env.case, 0)
    inputs = layer_inputs(env, 0, torch.Generator().manual_seed(1))
    T = env.batch.num_tokens
    assert (T, inputs["k"].shape[0]) == (4, 5)
    if after_success:
        backend.forward(inputs["q"], inputs["k"], inputs["v"], layer, env.batch)
    with pytest.raises(InvalidArgumentError) as caught:
        backend.forward(inputs["q"], inputs["k"][:T], inputs["v"][:T], layer, env.batch)
    assert caught.value.argument == "k"


MLA = AttnCase(
    ForwardMode.DECODE, ((5, 1), (9, 1)), arch="mla", kv_lora_rank=24, qk_rope_head_dim=8, num_kv_heads=1, num_layers=1
)
MLA_FAULTS = {
    "k_shape": (lambda i: _args(i, k=i["k"][..., :-1]), "k"),
    "q_dtype": (lambda i: _args(i, q=i["q"].double()), "q"),
    "v_given_on_another_device": (lambda i: _args(i, v=_on_meta(i["k"])), "v"),
    "v_given_in_another_dtype": (lambda i: _args(i, v=i["k"].double()), "v"),
    "k_missing_with_save": (lambda i: _args(i, k=None), "k"),
}


@pytest.mark.parametrize("after_success", [False, True], ids=["first_call", "after_a_good_call"])
@pytest.mark.parametrize("fault", sorted(MLA_FAULTS))
def test_mla_faults_get_their_typed_error_and_v_may_be_none(fault, after_success):
    """MLA passes v as None (or as given, unshaped: the latent is the key), and the rest is checked as for MHA."""
    env = make_env(MLA)
    backend = Recording(env.ctx)
    backend.init_forward_metadata(env.batch)
    layer = make_layer(env.case, 0)
    inputs = layer_inputs(env, 0, torch.Generator().manual_seed(1))
    assert inputs["v"] is None
    if after_success:
        _forward(backend, layer, env.batch, _args(inputs))
        ((q, k, v),) = backend.calls
        assert q.data_ptr() == inputs["q"].data_ptr() and k.data_ptr() == inputs["k"].data_ptr() and v is None
    spoil, argument = MLA_FAULTS[fault]
    with pytest.raises(InvalidArgumentError) as caught:
        _forward(backend, layer, env.batch, spoil(inputs))
    assert caught.value.argument == argument
    assert len(backend.calls) == int(after_success)


def test_unsupported_layer_settings_are_refused_on_every_call_not_only_the_first():
    env, backend, layer, inputs = _ready("decode")
    _forward(backend, layer, env.batch, _args(inputs))
    layer.logit_cap = 5.0
    with pytest.raises(UnsupportedFeatureError, match="logit_cap"):
        _forward(backend, layer, env.batch, _args(inputs))
    layer.logit_cap = 0.0
    _forward(backend, layer, env.batch, _args(inputs))  # accepted again once undone
    assert len(backend.calls) == 2


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1)


@pytest.mark.parametrize("mode", sorted(CASES))
@pytest.mark.parametrize(
    "layout",
    [
        {"q": False, "k": False, "v": False},
        {"q": True, "k": False, "v": False},
        {"q": True, "k": True, "v": True},
        {"q": False, "k": True, "v": False},
    ],
    ids=["all_3d", "q_flat", "all_flat", "k_flat"],
)
@pytest.mark.parametrize("extras", [{}, {"return_lse": True}], ids=["no_extras", "return_lse"])
def test_valid_inputs_reach_the_kernel_as_head_views_of_the_callers_tensors(mode, layout, extras):
    env, backend, layer, inputs = _ready(mode)
    given = {name: _flat(inputs[name]) if flat else inputs[name] for name, flat in layout.items()}
    out = backend.forward(given["q"], given["k"], given["v"], layer, env.batch, **extras)
    ((q, k, v),) = backend.calls
    for name, seen in (("q", q), ("k", k), ("v", v)):
        assert seen.shape == inputs[name].shape and seen.data_ptr() == given[name].data_ptr()
        assert torch.equal(seen, inputs[name])
    T = env.batch.num_tokens
    o = out[0] if extras else out
    assert o.shape == (T, layer.num_q_heads * layer.v_head_dim)


def test_without_saving_k_and_v_may_be_left_out():
    env, backend, layer, inputs = _ready("decode")
    _forward(backend, layer, env.batch, _args(inputs))  # writes this step's K/V
    _forward(backend, layer, env.batch, _args(inputs, k=None, v=None, save_kv_cache=False))
    ((_, k1, _), (_, k2, v2)) = backend.calls
    assert k1 is not None and k2 is None and v2 is None
