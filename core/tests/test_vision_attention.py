"""`attn_core.VisionAttention` against a plain float64 reference written here (projections, RMS norms,
rotary, each image's softmax attention over its own patches, output projection), in every token layout,
with every option, on torch_native and on triton (under the CPU interpreter or on a GPU); the backend
shared by name and planned once per batch across layers; typed refusals."""

from __future__ import annotations

import math

import pytest
import torch

from attn_core import VisionAttention, ragged_batch, vision_backend
from attn_core.contract.errors import InvalidArgumentError, UnknownBackendError
from attn_core.discovery.probes import triton_interpreter_enabled

BACKENDS = ["torch_native", "triton"]


def _skip_unavailable(name: str) -> str:
    """The device a backend runs on here, or skip."""
    if name == "torch_native":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if not triton_interpreter_enabled():
        pytest.skip("triton runs on the CPU only under TRITON_INTERPRET=1")
    return "cpu"


def _rms(x, w, eps, width):
    return w * (x / torch.sqrt((x[..., :width] ** 2).mean(-1, keepdim=True) + eps))


def reference(m: VisionAttention, x: torch.Tensor, lens, s=None, rotary=None):
    """float64, from the module's parameters: x `[N, E]` rows of the images (lens), or, with `s`, images
    padded to s rows each (rows past an image's length: attention output 0)."""
    p = {k: v.detach().double().cpu() for k, v in m.state_dict().items()}
    x = x.detach().double().cpu().reshape(-1, m.embed_dim)
    H, Hkv, D = m.heads, m.kv_heads, m.head_dim
    rows = list(range(x.shape[0])) if s is None else [i * s + j for i, n in enumerate(lens) for j in range(n)]
    xa = x[rows]
    qkv = xa @ p["qkv_proj.weight"].T + (p["qkv_proj.bias"] if "qkv_proj.bias" in p else 0)
    q, k, v = qkv[:, : H * D], qkv[:, H * D : (H + Hkv) * D], qkv[:, (H + Hkv) * D :]
    if m.qk_normalization:
        q = _rms(q, p["q_norm.weight"], m.q_norm.eps, m.num_heads * D)
        k = _rms(k, p["k_norm.weight"], m.k_norm.eps, m.num_kv_heads * D)
    q, k, v = q.reshape(-1, H, D), k.reshape(-1, Hkv, D), v.reshape(-1, Hkv, D)
    if m.qk_normalization_by_head_size:
        q, k = _rms(q, p["q_norm.weight"], m.q_norm.eps, D), _rms(k, p["k_norm.weight"], m.k_norm.eps, D)
    if rotary is not None:
        cos, sin = (t.double().cpu() for t in rotary)
        cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
        rot = lambda t: torch.cat([-t[..., D // 2 :], t[..., : D // 2]], -1)  # noqa: E731
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    out, start = [], 0
    for n in lens:
        qs, ks, vs = q[start : start + n], k[start : start + n], v[start : start + n]
        w = torch.softmax(torch.einsum("qhd,khd->hqk", qs, ks) * m.scale, -1)
        out.append(torch.einsum("hqk,khd->qhd", w, vs).reshape(n, H * D))
        start += n
    o = torch.cat(out)
    if s is not None:
        full = torch.zeros(x.shape[0], H * D, dtype=torch.float64)
        full[rows] = o
        o = full
    return o @ p["proj.weight"].T + (p["proj.bias"] if "proj.bias" in p else 0)


def _module(dev, **kw):
    torch.manual_seed(0)
    m = VisionAttention(**{"embed_dim": 80, "num_heads": 2, **kw}, device=dev).eval()
    with torch.no_grad():
        for name, prm in m.named_parameters():
            if "norm" in name:
                prm.uniform_(0.5, 1.5)
    return m


def _close(got, want, tol=1e-5):
    want = want.reshape(got.shape)
    err = float((got.detach().double().cpu() - want).abs().max() / want.abs().max())
    assert err <= tol, err


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_images_every_option(backend):
    """Packed images of different patch counts (a RaggedBatch), head dim 40 (a non-power-of-two width),
    GQA, per-head q/k norm, rotary position embeddings and a custom softmax scale."""
    dev = _skip_unavailable(backend)
    lens = (7, 1, 12, 0, 5)
    m = _module(
        dev,
        num_heads=4,
        head_dim=40,
        num_kv_heads=2,
        qk_normalization_by_head_size=True,
        softmax_scale=0.2,
        backend=backend,
    )
    x = torch.randn(sum(lens), 80, device=dev)
    angles = torch.randn(sum(lens), 20, device=dev)
    rotary = (angles.cos(), angles.sin())
    with torch.no_grad():
        out = m(x, cu_seqlens=ragged_batch(lens, dev), position_embeddings=rotary)
    _close(out, reference(m, x, lens, rotary=rotary))


@pytest.mark.parametrize("backend", BACKENDS)
def test_layouts(backend):
    """[T, E] with an offsets tensor; [1, T, E] with flatten_batch; [b, s, E] without offsets; [b, s, E]
    with images shorter than s (padding rows: the projection's bias); an all-heads q/k norm."""
    dev = _skip_unavailable(backend)
    m = _module(dev, qk_normalization=True, backend=backend)
    flat = _module(dev, qk_normalization=True, backend=backend, flatten_batch=True)
    flat.load_state_dict(m.state_dict())
    lens = (6, 9, 3)
    x = torch.randn(sum(lens), 80, device=dev)
    cu = torch.tensor([0, 6, 15, 18], dtype=torch.int32, device=dev)
    with torch.no_grad():
        _close(m(x, cu_seqlens=cu), reference(m, x, lens))
        _close(flat(x[None], cu_seqlens=cu), reference(m, x, lens))
        xb = torch.randn(3, 8, 80, device=dev)
        _close(m(xb), reference(m, xb, (8, 8, 8)))
        out = m(xb, cu_seqlens=torch.tensor([0, 5, 13, 14], dtype=torch.int32, device=dev))
        _close(out, reference(m, xb, (5, 8, 1), s=8))
        assert torch.equal(out[0, 5:], m.proj.bias.expand(3, 80))


def test_layers_share_one_backend_and_plan_once_per_batch():
    """Three layers by name share one backend; an offsets tensor shared by the layers is turned into one
    RaggedBatch whose metadata is built once; a new tensor, once more."""
    layers = [_module("cpu") for _ in range(3)]
    backend = vision_backend(
        "torch_native", device="cpu", dtype=torch.float32, num_heads=2, num_kv_heads=2, head_dim=40
    )
    assert layers[0].attention_backend(torch.device("cpu"), torch.float32) is backend
    calls = []
    original = backend.init_ragged_metadata
    backend.init_ragged_metadata = lambda ragged: (calls.append(ragged), original(ragged))[1]
    try:
        x = torch.randn(11, 80)
        with torch.no_grad():
            for cu in (torch.tensor([0, 4, 11], dtype=torch.int32), torch.tensor([0, 2, 11], dtype=torch.int32)):
                h = x
                for layer in layers:
                    h = layer(h, cu_seqlens=cu)
    finally:
        del backend.init_ragged_metadata
    assert len(calls) == 2 and calls[0].cu_seqlens_cpu.tolist() == [0, 4, 11]


def test_custom_applier_and_dummy_heads():
    """A position applier replaces the rotary default; dummy heads (zero weights) change nothing."""
    seen = {}

    def applier(q, k, pe):
        seen["shapes"] = (tuple(q.shape), tuple(k.shape), pe)
        return q * 2.0, k

    m = _module("cpu", position_embedding_applier=applier)
    x = torch.randn(9, 80)
    with torch.no_grad():
        out = m(x, cu_seqlens=ragged_batch([4, 5], "cpu"), position_embeddings="grid")
    assert seen["shapes"] == ((9, 2, 40), (9, 2, 40), "grid")
    doubled = _module("cpu", softmax_scale=2.0 * 40**-0.5)
    doubled.load_state_dict(m.state_dict())
    with torch.no_grad():
        _close(out, reference(doubled, x, (4, 5)))
    padded = _module("cpu", num_dummy_heads=2)
    with torch.no_grad():
        padded.qkv_proj.weight.zero_()
        padded.qkv_proj.bias.zero_()
        padded.proj.weight.zero_()
        for i in range(3):  # q, k, v: the real heads' rows of each
            padded.qkv_proj.weight[i * 160 : i * 160 + 80] = m.qkv_proj.weight[i * 80 : (i + 1) * 80]
            padded.qkv_proj.bias[i * 160 : i * 160 + 80] = m.qkv_proj.bias[i * 80 : (i + 1) * 80]
        padded.proj.weight[:, :80] = m.proj.weight
        padded.proj.bias.copy_(m.proj.bias)
        _close(padded(x, cu_seqlens=ragged_batch([4, 5], "cpu")), reference(m, x, (4, 5)))


def test_typed_refusals():
    m = _module("cpu")
    x = torch.randn(6, 80)
    with pytest.raises(InvalidArgumentError, match="x"):
        m(torch.randn(6, 64))
    with pytest.raises(InvalidArgumentError, match="cu_seqlens"):
        m(torch.randn(2, 4, 80), cu_seqlens=torch.tensor([0, 3, 9], dtype=torch.int32))
    with pytest.raises(InvalidArgumentError, match="q"):
        m(x, cu_seqlens=ragged_batch([2, 3], "cpu"))  # 5 rows in the batch, 6 in x
    with pytest.raises(InvalidArgumentError, match="x"):
        _module("cpu", flatten_batch=True)(torch.randn(2, 3, 80))
    train = _module("cpu", dropout=0.1).train()
    with pytest.raises(InvalidArgumentError, match="dropout"):
        train(x)
    with torch.no_grad():
        train.eval()(x)
    for kw, name in (
        (dict(projection_size=81), "projection_size"),
        (dict(num_kv_heads=3, num_heads=4), "num_kv_heads"),
        (dict(qk_normalization=True, qk_normalization_by_head_size=True), "qk_normalization"),
        (dict(dropout=1.0), "dropout"),
        (dict(backend=3), "backend"),
        (dict(num_dummy_heads=-1), "num_dummy_heads"),
    ):
        with pytest.raises(InvalidArgumentError, match=name):
            VisionAttention(**{"embed_dim": 80, "num_heads": 2, **kw})
    wrong = vision_backend("torch_native", device="cpu", dtype=torch.float32, num_heads=4, num_kv_heads=4, head_dim=20)
    with pytest.raises(InvalidArgumentError, match="backend"):
        _module("cpu", backend=wrong)(x)
    with pytest.raises(UnknownBackendError):
        _module("cpu", backend="no_such_backend")(x)
    assert math.isclose(_module("cpu").scale, 40**-0.5)
