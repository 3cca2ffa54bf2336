"""cpu_amx kernels against the float64 reference on the shapes that exercise their internals, on every
kernel path this CPU runs: K tiles loaded in place (pages >= 16) or gathered (small pages), items
split into row groups and KV splits, wide GQA groups, head dims outside the AMX path, mixed dtypes,
masks crossing blocks, and random batches."""

from __future__ import annotations

import random

import pytest
from cpu_amx_helpers import ALL_PATHS

from attn_core.testing.harness import AttnCase, assert_case
from attn_cpu_amx.backend import CpuAmxBackend

GQA = dict(num_q_heads=8, num_kv_heads=2, head_dim=64)


class Recorder:
    """A factory that keeps the backends it made (to read their last plan)."""

    def __init__(self, path: str, **options):
        self.path, self.options, self.made = path, options, []

    def __call__(self, ctx):
        self.made.append(CpuAmxBackend(ctx, isa=self.path, **self.options))
        return self.made[-1]


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_decode_pages(path, dtype, page_size):
    """Contexts crossing several key blocks; pages of 16+ let AMX load K tiles straight from the pool."""
    assert_case(
        Recorder(path),
        AttnCase("DECODE", [(150, 1), (63, 1), (0, 1), (300, 1)], dtype=dtype, page_size=page_size, **GQA),
    )


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_extend_row_groups(path, dtype):
    """70 new tokens x 4 q heads per KV head = 280 rows: items of 256 rows in groups of 32/64 rows,
    with a window and a cap so groups see different key ranges."""
    case = AttnCase(
        "EXTEND",
        [(100, 70), (5, 33), (0, 1)],
        dtype=dtype,
        page_size=16,
        sliding_window=50,
        logit_cap=30.0,
        return_lse=True,
        **GQA,
    )
    rec = Recorder(path)
    assert_case(rec, case)
    assert rec.made[0].last_plan[2] > 64  # an item wider than one row group ran


@pytest.mark.parametrize("path", ALL_PATHS)
def test_kv_splits_merge(path):
    """Few long requests: items are split over the keys and merged by LSE (with sinks and LSE output)."""
    rec = Recorder(path, min_split_keys=32, max_splits=8)
    case = AttnCase("DECODE", [(700, 1), (333, 1)], dtype="bfloat16", page_size=8, sinks=True, return_lse=True, **GQA)
    assert_case(rec, case)
    assert rec.made[0].last_plan[1] > 0  # split groups were merged


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("heads", [(80, 1), (272, 1), (6, 6)])
def test_gqa_layouts(path, heads):
    """A group wider than one row group (80), wider than an item (272: heads chunked), and MHA."""
    hq, hkv = heads
    assert_case(
        Recorder(path),
        AttnCase("EXTEND", [(40, 3), (0, 2)], num_q_heads=hq, num_kv_heads=hkv, head_dim=32, dtype="bfloat16"),
    )


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("head_dim,v_head_dim", [(16, 16), (80, 80), (256, 256), (64, 32), (96, 128)])
def test_head_dims(path, head_dim, v_head_dim):
    """Dims that are not multiples of 32 run the AVX-512 kernels on an AMX machine."""
    rec = Recorder(path)
    case = AttnCase(
        "MIXED",
        [(70, 1), (9, 20)],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        dtype="bfloat16",
    )
    assert_case(rec, case)
    expect = path if (path != "amx" or (head_dim % 32 == 0 and v_head_dim % 32 == 0)) else "avx512"
    assert rec.made[0].kernel_path == expect


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("dtype,kv_dtype", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_mixed_dtypes(path, dtype, kv_dtype):
    rec = Recorder(path)
    assert_case(rec, AttnCase("EXTEND", [(33, 5), (0, 9)], dtype=dtype, kv_dtype=kv_dtype, **GQA))
    assert rec.made[0].kernel_path == ("avx512" if path == "amx" else path)


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("custom_mask", [True, False])
def test_verify_masks_across_blocks(path, custom_mask):
    """Draft-tree masks over prefixes longer than a key block (and verify without a mask: causal)."""
    case = AttnCase(
        "TARGET_VERIFY",
        [(130, 5), (64, 5), (1, 5)],
        dtype="bfloat16",
        page_size=4,
        custom_mask=custom_mask,
        return_lse=True,
        **GQA,
    )
    assert_case(Recorder(path), case)


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("seed", range(4))
def test_random_batches(path, seed):
    """Random mode, batch, lengths, page size, dtype and features."""
    rnd = random.Random(1000 + seed)
    mode = rnd.choice(["EXTEND", "DECODE", "MIXED", "DRAFT_EXTEND", "TARGET_VERIFY"])
    n = rnd.randint(1, 5)
    if mode == "DECODE":
        reqs = [(rnd.randint(0, 200), 1) for _ in range(n)]
    elif mode == "TARGET_VERIFY":
        k = rnd.randint(1, 6)
        reqs = [(rnd.randint(1, 200), k) for _ in range(n)]
    else:
        reqs = [(rnd.randint(0, 150), rnd.randint(1 if mode != "EXTEND" else 0, 40)) for _ in range(n)]
        if mode == "MIXED":
            reqs.append((rnd.randint(0, 90), 1))
        if not any(e for _, e in reqs):
            reqs.append((3, 4))
    hkv = rnd.choice([1, 2, 4])
    case = AttnCase(
        mode,
        reqs,
        num_q_heads=hkv * rnd.choice([1, 2, 4, 8]),
        num_kv_heads=hkv,
        head_dim=rnd.choice([32, 64, 128]),
        dtype=rnd.choice(["bfloat16", "float32"]),
        page_size=rnd.choice([1, 2, 4, 8, 16, 32, 64, 128]),
        sliding_window=rnd.choice([None, None, rnd.randint(1, 80)]) if mode != "TARGET_VERIFY" else None,
        logit_cap=rnd.choice([0.0, 0.0, 20.0]),
        sinks=rnd.random() < 0.3,
        return_lse=rnd.random() < 0.5,
        seed=seed,
    )
    assert_case(Recorder(path, min_split_keys=rnd.choice([32, 256])), case)
