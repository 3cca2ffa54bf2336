"""The repository stands on its own and keeps its layering: the design document is in the repo and every
reference to it names a section that exists; plugins import no private attn_core name."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# spelled in pieces so that this file does not match them itself (`git grep` must find nothing)
OUTSIDE_REFERENCES = ("DESIGN" + ".md", ".." + "/shared", "DESIGN" + " §")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".ini", ".yml", ".yaml"}


def tracked_text_files() -> list[Path]:
    """The repo's text files (git's list when this is a checkout, else a walk that skips build output)."""
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
        files = [ROOT / n for n in names]
    except (OSError, subprocess.CalledProcessError):
        skip = {".venv", ".git", "build", "dist", "__pycache__", ".whl"}
        files = [p for p in ROOT.rglob("*") if not skip & set(p.relative_to(ROOT).parts)]
    return [p for p in files if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.parent.name in ("scripts", ".ci"))]


def test_no_reference_outside_the_repo():
    offenders = []
    for path in tracked_text_files():
        for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if any(pattern in line for pattern in OUTSIDE_REFERENCES):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "cite docs/design.md instead:\n" + "\n".join(offenders)


def test_design_document_is_linked_and_its_cited_sections_exist():
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    assert "docs/design.md" in (ROOT / "README.md").read_text(encoding="utf-8")
    sections = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", design, re.M))
    assert {"1", "3", "3.1", "3.2", "8"} <= sections, sections
    cited = []
    for path in tracked_text_files():
        for m in re.finditer(r"docs/design\.md`?\s*§\s*(\d+(?:\.\d+)?)", path.read_text(encoding="utf-8", errors="replace")):
            cited.append((path.relative_to(ROOT), m.group(1)))
    assert cited, "nothing cites docs/design.md by section"
    missing = [f"{p}: §{s}" for p, s in cited if s not in sections]
    assert not missing, f"citations of sections docs/design.md does not have: {missing}"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_core_imports(source: str) -> list[str]:
    """`from attn_core... import _name`, `from attn_core._mod import ...` and `import attn_core._mod`
    in `source` (dunders such as `__version__` are public)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "attn_core":
            found += [f"from {node.module} import {a.name}" for a in node.names if _private(a.name)]
            found += [f"from {node.module} import ..." for part in node.module.split(".") if _private(part)]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "attn_core" and any(_private(p) for p in a.name.split("."))]
    return found


def test_the_private_import_scan_finds_what_it_must():
    assert _private_core_imports("from attn_core.context import _dtype_name\n") == ["from attn_core.context import _dtype_name"]
    assert _private_core_imports("from attn_core._impl import x\nimport attn_core._impl\n") == [
        "from attn_core._impl import ...",
        "attn_core._impl",
    ]
    assert _private_core_imports("from attn_core.context import dtype_name\nfrom attn_core import __version__ as v\n") == []


@pytest.mark.parametrize("plugin", sorted(p.name for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").exists()))
def test_plugins_import_no_private_attn_core_names(plugin):
    offenders = []
    for path in sorted((ROOT / "plugins" / plugin).rglob("*.py")):
        offenders += [f"{path.relative_to(ROOT)}: {imp}" for imp in _private_core_imports(path.read_text(encoding="utf-8"))]
    assert not offenders, "plugins use public attn_core names only:\n" + "\n".join(offenders)


def test_dtype_name_is_public_and_round_trips():
    import torch

    import attn_core

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.int32):
        name = attn_core.dtype_name(dtype)
        assert "torch" not in name and getattr(torch, name) is dtype


INTEGRATIONS = sorted(p.name for p in (ROOT / "integrations").iterdir() if (p / "pyproject.toml").exists())


@pytest.mark.parametrize("integration", INTEGRATIONS)
def test_integrations_import_no_private_attn_core_names(integration):
    offenders = []
    for path in sorted((ROOT / "integrations" / integration).rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        offenders += [f"{path.relative_to(ROOT)}: {imp}" for imp in _private_core_imports(source)]
    assert not offenders, "integrations use public attn_core names only:\n" + "\n".join(offenders)


def test_attn_core_never_imports_an_integration():
    """attn-core stays free of the engines it is integrated into (integrations/ depend on it, not back)."""
    names = [f"attn_{name}" for name in INTEGRATIONS]
    offenders = []
    for path in sorted((ROOT / "core" / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(ROOT)}: {m}" for m in mods if m.split(".")[0] in names + ["vllm"]]
    assert not offenders, offenders
