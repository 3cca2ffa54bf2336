"""A new user's first run: the README's usage example, taken verbatim from README.md, runs a prefill
then several decode steps of the same requests and gives every row and slot back."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def usage_example() -> str:
    text = README.read_text()
    section = text[text.index("## Usage") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_usage_example_runs_prefill_then_decodes():
    ns: dict = {}
    exec(compile(usage_example(), str(README), "exec"), ns)
    ac, batch, out, requests = ns["ac"], ns["batch"], ns["out"], ns["requests"]
    assert ns["step"] == 3
    assert batch.forward_mode == ac.ForwardMode.DECODE
    assert batch.seq_lens_cpu.tolist() == [103, 40]  # the same two requests, three tokens past their prompts
    assert batch.positions.tolist() == [102, 39]
    assert out.shape == (2, ns["H"] * ns["D"]) and torch.isfinite(out).all()
    assert requests.num_requests == 0
    assert requests.allocator.available_size() == requests.allocator.size
    assert ns["rows"].available_size() == ns["rows"].size
