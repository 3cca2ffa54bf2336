"""Block tables in TensorRT-LLM's layout (attn-core's `page_table_from_req_to_token` padded with `PAD`, at
the width `args.padded_width` gives): the worked example, random batches against a plain loop, writes into
a fixed (CUDA-graph) buffer, widths and errors. CPU only."""

import random

import pytest
import torch

from attn_core.contract.errors import InvalidArgumentError
from attn_core.ops.kv_indices import page_table_from_req_to_token
from attn_trtllm_mla.args import PAD, check_width, padded_width


def test_worked_example():
    r2t = torch.zeros(3, 128, dtype=torch.int32)
    r2t[2, :70] = torch.cat([torch.arange(320, 352), torch.arange(96, 128), torch.arange(640, 646)]).to(torch.int32)
    r2t[0, :5] = torch.arange(32, 37, dtype=torch.int32)
    assert padded_width(70, 32) == 4
    lens = torch.tensor([70, 5], dtype=torch.int32)
    table = page_table_from_req_to_token(r2t, torch.tensor([2, 0]), lens, 32, 4, pad=PAD)
    assert table.dtype == torch.int32 and table.tolist() == [[10, 3, 20, -1], [1, -1, -1, -1]]


@pytest.mark.parametrize(
    ("max_len", "page", "width"), [(70, 32, 4), (300, 64, 6), (0, 64, 2), (128, 32, 4), (129, 32, 8), (1, 1, 128)]
)
def test_padded_width(max_len, page, width):
    assert padded_width(max_len, page) == width
    assert (width * page) % 128 == 0 and width * page >= max_len


@pytest.mark.parametrize("page", [3, 0, 256])
def test_padded_width_refuses_odd_pages(page):
    with pytest.raises(InvalidArgumentError, match="page_size"):
        padded_width(100, page)


def _loop_table(r2t, rows, lens, page, width):
    out = [[PAD] * width for _ in rows]
    for b, (row, n) in enumerate(zip(rows, lens)):
        for j in range(-(-n // page)):
            out[b][j] = int(r2t[row, j * page]) // page
    return out


@pytest.mark.parametrize("seed", range(20))
def test_random_batches_match_a_plain_loop(seed):
    rng = random.Random(seed)
    page = rng.choice([32, 64])
    rows_n, max_ctx = 9, rng.randint(1, 700)
    pages = list(range(400))
    rng.shuffle(pages)
    r2t = torch.full((rows_n, max_ctx), -7, dtype=torch.int32)  # poison: read past a request's keys shows up
    bs = rng.randint(1, rows_n)
    rows = rng.sample(range(rows_n), bs)
    lens = [rng.choice([0, 1, rng.randint(1, max_ctx), max_ctx]) for _ in rows]
    for row, n in zip(rows, lens):
        mine = [pages.pop() for _ in range(-(-n // page))]
        r2t[row, :n] = torch.tensor([mine[t // page] * page + t % page for t in range(n)], dtype=torch.int32)
    width = padded_width(max(lens), page)
    rows_t, lens_t = torch.tensor(rows), torch.tensor(lens, dtype=torch.int32)
    got = page_table_from_req_to_token(r2t, rows_t, lens_t, page, width, pad=PAD)
    assert got.tolist() == _loop_table(r2t, rows, lens, page, width)
    buf = torch.full((rows_n + 2, width), 123, dtype=torch.int32)  # a CUDA graph's fixed buffer
    view = page_table_from_req_to_token(r2t, rows_t, lens_t, page, width, pad=PAD, out=buf)
    assert view.data_ptr() == buf.data_ptr() and buf[:bs].tolist() == got.tolist() and (buf[bs:] == 123).all()


def test_check_width():
    check_width(128, 32, 4)
    with pytest.raises(InvalidArgumentError, match="at most 128 keys"):
        check_width(129, 32, 4)
