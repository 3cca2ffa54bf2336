"""`attn_core.vision.utils` on real `transformers` config objects and real weight tensors (a random SigLIP
attention block's), against expectations worked out by hand in the tests; and a `VisionAttention` loaded
with the padded weights computes what the unpadded one does."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attn_core import VisionAttention, pad_vit_attn_dummy_heads, update_vit_attn_dummy_heads_config  # noqa: E402
from attn_core.contract.errors import InvalidArgumentError  # noqa: E402


def _siglip(hidden=96, heads=6):
    vision = dict(
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=64,
        num_hidden_layers=1,
        image_size=32,
        patch_size=8,
    )
    return transformers.SiglipConfig(
        vision_config=vision, text_config=dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=1)
    )


@pytest.mark.parametrize("tp_size, dummy", [(1, 0), (2, 0), (3, 0), (4, 2), (5, 4), (8, 2)])
def test_update_config_on_a_multimodal_config(tp_size, dummy):
    """6 heads of 16: the fewest zero heads making the count a multiple of tp_size (4 → 8, 5 → 10, 8 → 8)."""
    cfg = _siglip()
    update_vit_attn_dummy_heads_config(cfg, tp_size)
    assert (cfg.vision_config.head_dim, cfg.vision_config.num_dummy_heads) == (16, dummy)


def test_update_config_on_a_vision_config_and_bad_sizes():
    vision = transformers.SiglipVisionConfig(hidden_size=3200, num_attention_heads=25)  # InternViT-6B's shape
    update_vit_attn_dummy_heads_config(vision, 4)
    assert (vision.head_dim, vision.num_dummy_heads) == (128, 3)
    for bad in (0, -2, 2.0, True):
        with pytest.raises(InvalidArgumentError, match="tp_size"):
            update_vit_attn_dummy_heads_config(vision, bad)


def _attention_weights(hidden=96, heads=6, seed=0):
    """A real SigLIP attention block's q/k/v/out projections (random init, seeded)."""
    torch.manual_seed(seed)
    from transformers.models.siglip.modeling_siglip import SiglipAttention

    return SiglipAttention(_siglip(hidden, heads).vision_config)


def test_pad_fused_qkv_separate_projections_proj_and_norms():
    cfg = _siglip()
    update_vit_attn_dummy_heads_config(cfg, 4)  # 2 dummy heads of 16: 32 zero rows per q / k / v
    hf = _attention_weights()
    wq, wk, wv = hf.q_proj.weight.detach(), hf.k_proj.weight.detach(), hf.v_proj.weight.detach()
    bq, bk, bv = hf.q_proj.bias.detach(), hf.k_proj.bias.detach(), hf.v_proj.bias.detach()
    zeros = torch.zeros(32, 96)

    w = pad_vit_attn_dummy_heads(cfg, "vision_model.encoder.layers.0.attn.qkv_proj.weight", torch.cat([wq, wk, wv]))
    assert w.shape == (384, 96)
    torch.testing.assert_close(w, torch.cat([wq, zeros, wk, zeros, wv, zeros]), rtol=0, atol=0)
    b = pad_vit_attn_dummy_heads(cfg, "vision_model.encoder.layers.0.attn.qkv_proj.bias", torch.cat([bq, bk, bv]))
    torch.testing.assert_close(
        b, torch.cat([bq, torch.zeros(32), bk, torch.zeros(32), bv, torch.zeros(32)]), rtol=0, atol=0
    )

    for name, x in (("q_proj", wq), ("k_proj", wk), ("v_proj", wv)):
        padded = pad_vit_attn_dummy_heads(cfg, f"encoder.layers.3.attn.{name}.weight", x)
        assert padded.shape == (128, 96) and torch.equal(padded[:96], x) and not padded[96:].any()
    padded_bias = pad_vit_attn_dummy_heads(cfg, "encoder.layers.3.attn.q_proj.bias", bq)
    assert padded_bias.shape == (128,) and torch.equal(padded_bias[:96], bq) and not padded_bias[96:].any()

    wo = hf.out_proj.weight.detach()  # [96 out, 96 = 6 heads x 16]
    p = pad_vit_attn_dummy_heads(cfg, "encoder.layers.0.attn.proj.weight", wo)
    assert p.shape == (96, 128) and torch.equal(p[:, :96], wo) and not p[:, 96:].any()
    bo = hf.out_proj.bias.detach()
    assert pad_vit_attn_dummy_heads(cfg, "encoder.layers.0.attn.proj.bias", bo) is bo  # output features unchanged

    norm = torch.arange(96, dtype=torch.float32)
    padded_norm = pad_vit_attn_dummy_heads(cfg, "encoder.layers.0.attn.q_norm.weight", norm)
    assert padded_norm.tolist() == list(range(96)) + [0.0] * 32
    per_head = torch.ones(16)
    assert pad_vit_attn_dummy_heads(cfg, "encoder.layers.0.attn.k_norm.weight", per_head) is per_head
    other = torch.ones(7, 96)
    assert pad_vit_attn_dummy_heads(cfg, "encoder.layers.0.mlp.fc1.weight", other) is other


def test_pad_is_identity_without_dummy_heads_and_refuses_odd_shapes():
    cfg = _siglip()
    update_vit_attn_dummy_heads_config(cfg, 3)
    w = torch.randn(288, 96)
    assert pad_vit_attn_dummy_heads(cfg, "attn.qkv_proj.weight", w) is w
    update_vit_attn_dummy_heads_config(cfg, 4)
    with pytest.raises(InvalidArgumentError, match="qkv_proj"):
        pad_vit_attn_dummy_heads(cfg, "attn.qkv_proj.weight", torch.randn(100, 96))
    with pytest.raises(InvalidArgumentError, match="proj.weight"):
        pad_vit_attn_dummy_heads(cfg, "attn.proj.weight", torch.randn(96, 90))


def test_vision_attention_with_padded_weights_computes_the_same():
    """A VisionAttention with 2 dummy heads, loaded through pad_vit_attn_dummy_heads (and with an InternVL
    q/k norm over all heads), equals the one without dummy heads on the same checkpoint."""
    torch.manual_seed(1)
    plain = VisionAttention(96, 6, qk_normalization=True).eval()
    with torch.no_grad():
        plain.q_norm.weight.uniform_(0.5, 1.5)
        plain.k_norm.weight.uniform_(0.5, 1.5)
    cfg = _siglip()
    update_vit_attn_dummy_heads_config(cfg, 4)
    padded = VisionAttention(96, 6, qk_normalization=True, num_dummy_heads=2).eval()
    state = {f"attn.{k}": v for k, v in plain.state_dict().items()}
    padded.load_state_dict({k.removeprefix("attn."): pad_vit_attn_dummy_heads(cfg, k, v) for k, v in state.items()})
    x = torch.randn(2, 9, 96)
    with torch.no_grad():
        torch.testing.assert_close(padded(x), plain(x), rtol=1e-5, atol=1e-6)
