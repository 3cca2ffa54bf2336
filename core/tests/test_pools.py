import pytest
import torch

from attn_core.contract.errors import InvalidArgumentError, KVCacheError
from attn_core.memory import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool


def test_req_to_token_pool_rows():
    p = ReqToTokenPool(3, 16)
    assert p.req_to_token.shape == (3, 16) and p.req_to_token.dtype == torch.int32
    rows = p.alloc(2)
    assert len(set(rows)) == 2 and p.available_size() == 1
    assert p.alloc(2) is None and p.available_size() == 1
    p.write(rows[0], 3, torch.tensor([9, 10]))
    assert p.req_to_token[rows[0], 3:5].tolist() == [9, 10]
    with pytest.raises(InvalidArgumentError, match="max_context_len"):
        p.write(rows[0], 15, torch.tensor([1, 2]))
    p.free(rows)
    with pytest.raises(KVCacheError, match="double free"):
        p.free(rows[0])
    with pytest.raises(KVCacheError, match="out of range"):
        p.free(7)


@pytest.mark.parametrize("page_size", [1, 16])
def test_mha_pool_layout_and_writes(page_size):
    pool = MHATokenToKVPool(64, page_size, torch.bfloat16, head_num=2, head_dim=8, layer_num=3, v_head_dim=4)
    assert pool.get_key_buffer(2).shape == (64 + page_size, 2, 8)
    assert pool.get_value_buffer(2).shape == (64 + page_size, 2, 4)
    loc = torch.tensor([page_size + 1, page_size + 5])
    k, v = torch.randn(2, 2, 8), torch.randn(2, 8)  # v given flattened [T, H*Dv]
    pool.set_kv_buffer(1, loc, k, v)
    assert torch.equal(pool.get_key_buffer(1)[loc], k.to(torch.bfloat16))
    assert torch.equal(pool.get_value_buffer(1)[loc], v.view(2, 2, 4).to(torch.bfloat16))
    assert pool.get_key_buffer(0).abs().sum() == 0  # other layers untouched
    with pytest.raises(InvalidArgumentError, match="cache_k"):
        pool.set_kv_buffer(1, loc, torch.randn(3, 2, 8), torch.randn(3, 2, 4))
    with pytest.raises(InvalidArgumentError, match="layer_id"):
        pool.get_key_buffer(3)


def test_mha_pool_fp8_roundtrip_with_scale():
    pool = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, head_num=1, head_dim=4, layer_num=1)
    assert pool.k_buffer[0].dtype == torch.uint8  # stored as bytes, viewed as fp8
    k = torch.tensor([[[0.5, -1.0, 2.0, 4.0]]])
    pool.set_kv_buffer(0, torch.tensor([3]), k, k, k_scale=2.0, v_scale=1.0)
    assert pool.get_key_buffer(0).dtype == torch.float8_e4m3fn
    assert torch.equal(pool.get_key_buffer(0)[3].float() * 2.0, k[0])


def test_mla_pool_value_is_a_view_of_the_latent():
    pool = MLATokenToKVPool(32, 16, torch.float32, kv_lora_rank=8, qk_rope_head_dim=4, layer_num=2)
    assert pool.get_key_buffer(0).shape == (48, 1, 12)
    loc = torch.tensor([17, 20])
    nope, rope = torch.randn(2, 1, 8), torch.randn(2, 1, 4)
    pool.set_mla_kv_buffer(0, loc, nope, rope)
    assert torch.equal(pool.get_value_buffer(0)[loc], nope)
    assert torch.equal(pool.get_key_buffer(0)[loc][..., 8:], rope)
    assert pool.get_value_buffer(0).data_ptr() == pool.get_key_buffer(0).data_ptr()


def test_kv_layout_hnd_matches_nhd_slot_by_slot():
    """The same writes into an NHD and an HND pool read back the same rows by slot (token_rows), and the
    HND buffer is [num_pages, H, page_size, D] with slot s at (s // page_size, :, s % page_size)."""
    import random as _random

    from attn_core.memory import token_rows

    ps, h, d = 4, 3, 8
    nhd = MHATokenToKVPool(32, ps, torch.float32, h, d, 2)
    hnd = MHATokenToKVPool(32, ps, torch.float32, h, d, 2, kv_layout="HND")
    assert hnd.get_key_buffer(0).shape == (9, h, ps, d) and nhd.get_key_buffer(0).shape == (36, h, d)
    rng = _random.Random(0)
    loc = torch.tensor(rng.sample(range(ps, 36), 12))
    k, v = torch.randn(12, h, d), torch.randn(12, h, d)
    for pool in (nhd, hnd):
        pool.set_kv_buffer(1, loc, k, v)
    slots = torch.arange(36).reshape(6, 6)
    for get in ("get_key_buffer", "get_value_buffer"):
        a = token_rows(getattr(nhd, get)(1), slots, "NHD", ps)
        b = token_rows(getattr(hnd, get)(1), slots, "HND", ps)
        assert torch.equal(a, b) and a.shape == (6, 6, h, d)
    s = int(loc[0])
    assert torch.equal(hnd.get_key_buffer(1)[s // ps, :, s % ps], k[0])
    with pytest.raises(InvalidArgumentError, match="kv_layout"):
        MHATokenToKVPool(32, ps, torch.float32, h, d, 2, kv_layout="NDH")


def test_kv_layout_is_a_requirement():
    from attn_core import BackendContext

    pool = MHATokenToKVPool(32, 4, torch.float32, 2, 8, 1, kv_layout="HND")
    ctx = BackendContext("cpu", torch.float32, 4, 2, 8, page_size=4, token_to_kv_pool=pool)
    assert ctx.kv_layout == "HND" and ctx.requirements().kv_layout == "HND"
    with pytest.raises(InvalidArgumentError, match="kv_layout"):
        BackendContext("cpu", torch.float32, 4, 2, 8, kv_layout="XYZ")
