"""attn's non-causal attention inside real `transformers` models (random weights, small configs made here,
float32), against the models' own eager attention:

- a SigLIP vision tower over a packed batch of images of different sizes (so different patch counts: 16,
  15, 12 and 1), its attention through attn's ragged op, either as an HF attention implementation calling
  `backend.ragged_attention` or with every layer's attention replaced by `attn_core.VisionAttention`
  loaded with the layer's weights; equal to HF's eager forward of each image alone (head dim 80: the
  Triton kernel's split of the channels into 64 + 16 runs);
- an encoder-only BERT over several steps of the paged path (`AttentionLayer(attn_type="encoder_only")`,
  requests of different lengths packed per step, a KV pool shared by the steps), equal to HF's eager
  forward of each sequence alone.

Backends: torch_native, and triton under the CPU interpreter (or on a GPU when there is one).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AttentionInterface, AttentionMaskInterface  # noqa: E402

import attn_core as ac  # noqa: E402
from attn_core.contract.ragged import ragged_context  # noqa: E402
from attn_core.discovery.probes import triton_interpreter_enabled  # noqa: E402

BACKENDS = ["torch_native", "triton"]
IMAGE_SIZES = [(32, 32), (24, 40), (48, 16), (8, 8)]  # patch 8: 16, 15, 12 and 1 patches
TOLERANCE = 1e-5  # float32: max |out - HF| / max |HF|


def _device(backend: str) -> str:
    if backend == "torch_native":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if not triton_interpreter_enabled():
        pytest.skip("triton runs on the CPU only under TRITON_INTERPRET=1")
    return "cpu"


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


class _Step:
    """What the attention implementations below read during one forward (HF's attention modules pass no
    extra keywords down to them in SigLIP)."""

    backend = None
    ragged = None


def _ragged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_):
    """HF attention implementation "attn_ragged": HF's q/k/v `[1, heads, T, D]` of packed images through
    the backend's ragged op."""
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    out = _Step.backend.ragged_attention(q, k, v, _Step.ragged, scaling=scaling)
    return out.view(1, q.shape[0], q.shape[1], q.shape[2]), None


AttentionInterface.register("attn_ragged", _ragged_attention)
AttentionMaskInterface.register("attn_ragged", lambda *args, **kwargs: None)


def _siglip(device: str):
    torch.manual_seed(0)
    cfg = transformers.SiglipVisionConfig(
        hidden_size=160, num_attention_heads=2, intermediate_size=96, num_hidden_layers=2, image_size=32, patch_size=8
    )
    cfg._attn_implementation = "eager"
    model = transformers.SiglipVisionModel(cfg).to(device).eval()
    images = [torch.randn(1, 3, h, w, device=device) for h, w in IMAGE_SIZES]
    with torch.no_grad():
        expected = [model(pixel_values=img, interpolate_pos_encoding=True).last_hidden_state[0] for img in images]
        embeds = [model.embeddings(img, interpolate_pos_encoding=True)[0] for img in images]
    return model, expected, embeds


def _packed_tower(model, embeds):
    """The tower's layers and final norm over the images' embeddings packed as one sequence."""
    with torch.no_grad():
        hidden = model.encoder(inputs_embeds=torch.cat(embeds)[None]).last_hidden_state
        return model.post_layernorm(hidden)[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_siglip_tower_through_the_ragged_op(backend):
    device = _device(backend)
    model, expected, embeds = _siglip(device)
    lens = [e.shape[0] for e in embeds]
    assert lens == [16, 15, 12, 1]
    _Step.backend = ac.create_backend(backend, ragged_context(device, torch.float32, 2, 2, 80))
    _Step.ragged = ac.ragged_batch(lens, device)
    _Step.backend.init_ragged_metadata(_Step.ragged)
    model.set_attn_implementation("attn_ragged")
    try:
        out = _packed_tower(model, embeds)
    finally:
        model.set_attn_implementation("eager")
    for got, want in zip(out.split(lens), expected):
        assert _rel(got, want) <= TOLERANCE


class _VisionAttentionLayer(torch.nn.Module):
    """A SigLIP layer's `self_attn` replaced by `attn_core.VisionAttention` holding its weights."""

    def __init__(self, hf_attn, backend: str):
        super().__init__()
        e, heads = hf_attn.embed_dim, hf_attn.num_heads
        self.attn = ac.VisionAttention(e, heads, backend=backend, device=hf_attn.q_proj.weight.device)
        with torch.no_grad():
            self.attn.qkv_proj.weight.copy_(
                torch.cat([hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight])
            )
            self.attn.qkv_proj.bias.copy_(torch.cat([hf_attn.q_proj.bias, hf_attn.k_proj.bias, hf_attn.v_proj.bias]))
            self.attn.proj.weight.copy_(hf_attn.out_proj.weight)
            self.attn.proj.bias.copy_(hf_attn.out_proj.bias)
        self.attn.eval()

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        return self.attn(hidden_states[0], cu_seqlens=_Step.ragged)[None], None


@pytest.mark.parametrize("backend", BACKENDS)
def test_siglip_tower_with_vision_attention(backend):
    device = _device(backend)
    model, expected, embeds = _siglip(device)
    lens = [e.shape[0] for e in embeds]
    for layer in model.encoder.layers:
        layer.self_attn = _VisionAttentionLayer(layer.self_attn, backend)
    _Step.ragged = ac.ragged_batch(lens, device)
    out = _packed_tower(model, embeds)
    for got, want in zip(out.split(lens), expected):
        assert _rel(got, want) <= TOLERANCE


# ---- BERT through the paged path ------------------------------------------------------------------
def _paged_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, forward_batch=None, attn_layers=None, **_
):
    """HF attention implementation "attn_paged": HF's q/k/v `[1, heads, T, D]` through an attn layer."""
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    out = attn_layers[module.layer_idx](q, k, v, forward_batch)
    return out.view(1, q.shape[0], q.shape[1], -1), None


AttentionInterface.register("attn_paged", _paged_attention)
AttentionMaskInterface.register("attn_paged", lambda *args, **kwargs: None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bert_encoder_through_the_paged_non_causal_path(backend):
    """Five sequences in three steps on one backend and one KV pool (page size 4): two, then two more
    while the first stay cached (their K/V must stay untouched), then the last after the first two are
    freed; every sequence's output equals HF's eager forward of it alone."""
    device = _device(backend)
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=97,
        hidden_size=64,
        num_attention_heads=2,
        num_hidden_layers=2,
        intermediate_size=96,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = "eager"
    model = transformers.BertModel(cfg, add_pooling_layer=False).to(device).eval()
    lengths = [9, 17, 4, 12, 1]
    seqs = [torch.randint(0, 97, (n,), device=device) for n in lengths]
    with torch.no_grad():
        expected = [model(input_ids=s[None]).last_hidden_state[0] for s in seqs]

    heads, d, page = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads, 4
    kv = ac.MHATokenToKVPool(
        size=256, page_size=page, dtype=torch.float32, head_num=heads, head_dim=d, layer_num=2, device=device
    )
    rows = ac.ReqToTokenPool(size=4, max_context_len=64, device=device)
    requests = ac.RequestPool(rows, ac.PagedTokenAllocator(256, page), kv)
    ctx = ac.BackendContext(
        device=device,
        dtype=torch.float32,
        num_q_heads=heads,
        num_kv_heads=heads,
        head_dim=d,
        page_size=page,
        max_batch_size=4,
        max_context_len=64,
        req_to_token_pool=rows,
        token_to_kv_pool=kv,
        validation="full",
        features=frozenset({ac.Feature.NON_CAUSAL}),
        forward_modes={"extend"},
    )
    backend_obj = ac.create_backend(backend, ctx)
    layers = [ac.AttentionLayer(i, heads, heads, d, attn_type="encoder_only") for i in range(2)]
    model.set_attn_implementation("attn_paged")
    handles, kept = {}, {}
    try:
        for step in ([0, 1], [2, 3], [4]):
            if step == [4]:
                for i in (0, 1):
                    requests.free(handles.pop(i))
            for i in step:
                handles[i] = requests.add()
            batch = ac.build_step(requests, [(handles[i], lengths[i]) for i in step], attn_backend=backend_obj)
            backend_obj.init_forward_metadata(batch)
            ids = torch.cat([seqs[i] for i in step])[None]
            with torch.no_grad():
                out = model(
                    input_ids=ids,
                    position_ids=batch.positions[None],
                    token_type_ids=torch.zeros_like(ids),
                    forward_batch=batch,
                    attn_layers=layers,
                ).last_hidden_state[0]
            for i, got in zip(step, out.split([lengths[i] for i in step])):
                assert _rel(got, expected[i]) <= TOLERANCE, f"sequence {i}"
            for i, snapshot in kept.items():  # cached requests' K/V untouched by later steps
                if i in handles:
                    slots = rows.req_to_token[handles[i].row, : lengths[i]].long()
                    assert torch.equal(kv.get_key_buffer(0)[slots], snapshot)
            for i in step:
                kept[i] = kv.get_key_buffer(0)[rows.req_to_token[handles[i].row, : lengths[i]].long()].clone()
    finally:
        model.set_attn_implementation("eager")
