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

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here")


def section() -> str:
    text = (ROOT / "docs" / "engine-authors.md").read_text(encoding="utf-8")
    start = text.index("## Running vLLM on attn")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_the_shell_lines_install_this_repository_and_select_custom():
    (shell,) = blocks(section(), "bash")
    pip = shell.splitlines()[0].split("#")[0].split()
    assert pip[:2] == ["pip", "install"] and "./integrations/vllm" in pip
    for path in pip[2:]:
        assert (ROOT / path / "pyproject.toml").exists(), f"{path}: not a distribution of this repository"
    assert "export ATTN_VLLM_BACKEND=" in shell and "--attention-backend CUSTOM" in shell
    assert shell in (ROOT / "README.md").read_text(encoding="utf-8"), "the README shows the same three lines"
    setup = (ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8")
    assert f"VLLM_PIN={attn_vllm.TESTED_VLLM}" in setup, "setup.sh installs the tested vLLM release"


def test_the_python_example_runs_verbatim(tmp_path):
    (example,) = blocks(section(), "python")[-1:]
    script = tmp_path / "try_vllm_on_attn.py"
    script.write_text(example)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = [line for line in proc.stdout.splitlines() if re.fullmatch(r"\[\d+(, \d+)*\]", line.strip())]
    assert len(printed) == 1, proc.stdout[-3000:]  # the example prints one list of token ids
    assert len(printed[0].split(",")) == 5
