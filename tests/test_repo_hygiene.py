"""The repository stands on its own and keeps its layering: the design document is in the repo and every
reference to it names a section that exists; plugins import no private attn_core name, no private name of
another plugin, and subclass no class of another plugin."""

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
        for m in re.finditer(
            r"docs/design\.md`?\s*§\s*(\d+(?:\.\d+)?)", path.read_text(encoding="utf-8", errors="replace")
        ):
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
            found += [
                a.name
                for a in node.names
                if a.name.split(".")[0] == "attn_core" and any(_private(p) for p in a.name.split("."))
            ]
    return found


def test_the_private_import_scan_finds_what_it_must():
    found = _private_core_imports("from attn_core.contract.context import _dtype_name\n")
    assert found == ["from attn_core.contract.context import _dtype_name"]
    assert _private_core_imports("from attn_core._impl import x\nimport attn_core._impl\n") == [
        "from attn_core._impl import ...",
        "attn_core._impl",
    ]
    assert (
        _private_core_imports(
            "from attn_core.contract.context import dtype_name\nfrom attn_core import __version__ as v\n"
        )
        == []
    )


@pytest.mark.parametrize(
    "plugin", sorted(p.name for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").exists())
)
def test_plugins_import_no_private_attn_core_names(plugin):
    offenders = []
    for path in sorted((ROOT / "plugins" / plugin).rglob("*.py")):
        offenders += [
            f"{path.relative_to(ROOT)}: {imp}" for imp in _private_core_imports(path.read_text(encoding="utf-8"))
        ]
    assert not offenders, "plugins use public attn_core names only:\n" + "\n".join(offenders)


def test_dtype_name_is_public_and_round_trips():
    import torch

    import attn_core

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.int32):
        name = attn_core.dtype_name(dtype)
        assert "torch" not in name and getattr(torch, name) is dtype


# ---- plugins stand on public ground: no other plugin's private names, no other plugin's classes as bases ----
def _plugin_packages() -> dict[str, str]:
    """Top-level package name -> plugin directory, for every plugin distribution under plugins/."""
    out = {}
    for plugin in (p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").exists()):
        for pkg in (plugin / "src").glob("*/__init__.py"):
            out[pkg.parent.name] = plugin.name
    return out


def _foreign_private_imports(source: str, own: str, foreign: set[str]) -> list[str]:
    """Imports in `source` (a module of package `own`) of a `_`-prefixed name or module of another
    plugin's package (`foreign`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            top = (node.module or "").split(".")[0]
            if top in foreign and top != own:
                found += [f"from {node.module} import {a.name}" for a in node.names if _private(a.name)]
                found += [f"from {node.module} import ..." for part in node.module.split(".") if _private(part)]
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] in foreign and parts[0] != own and any(_private(p) for p in parts):
                    found.append(a.name)
    return found


def _foreign_subclasses(source: str, own: str, foreign: set[str]) -> list[str]:
    """Classes in `source` (a module of package `own`) with a base class imported from another plugin's
    package: `from attn_x.m import C` then `class D(C)`, or `import attn_x.m as m` / `from attn_x import
    m` then `class D(m.C)`."""
    tree = ast.parse(source)
    names, modules = set(), set()  # local names bound to another plugin's classes / modules
    others = foreign - {own}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in others:
            for a in node.names:
                (names if a.name[:1].isupper() else modules).add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in others:
                    modules.add(a.asname or a.name.split(".")[0])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                root = base
                while isinstance(root, ast.Attribute):
                    root = root.value
                if (isinstance(base, ast.Name) and base.id in names) or (
                    isinstance(base, ast.Attribute) and isinstance(root, ast.Name) and root.id in modules
                ):
                    found.append(f"class {node.name}({ast.unparse(base)})")
    return found


def test_the_plugin_scans_find_what_they_must():
    foreign = {"attn_a", "attn_b"}
    src = (
        "from attn_b.backend import _Step, Public\nimport attn_b._impl\nfrom attn_b._x import y\n"
        "from attn_a.m import _own\n"
    )
    assert _foreign_private_imports(src, "attn_a", foreign) == [
        "from attn_b.backend import _Step",
        "attn_b._impl",
        "from attn_b._x import ...",
    ]
    sub = (
        "from attn_b.backend import Base\nimport attn_b.mla as mla\nfrom attn_b import plans\n"
        "from attn_a.x import Own\n"
        "class A(Base): ...\nclass B(mla.Backend): ...\nclass C(plans.Plan): ...\n"
        "class D(Own): ...\nclass E(object): ...\n"
    )
    want = ["class A(Base)", "class B(mla.Backend)", "class C(plans.Plan)"]
    assert _foreign_subclasses(sub, "attn_a", foreign) == want
    assert _foreign_private_imports("from attn_b.backend import Public\n", "attn_a", foreign) == []


PLUGINS = sorted(p.name for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").exists())


@pytest.mark.parametrize("plugin", PLUGINS)
def test_plugins_use_no_private_name_and_no_class_of_another_plugin(plugin):
    """A plugin may use another plugin's public names (attn-trtllm-mla holds attn-flashinfer's MLA backend
    through its documented extension point) but none of its `_`-prefixed names (in any of its files), and
    its shipped code (src/) subclasses no class of another plugin (its tests may build stand-ins)."""
    packages = _plugin_packages()
    own = {pkg for pkg, p in packages.items() if p == plugin}
    foreign = set(packages)
    offenders = []
    for path in sorted((ROOT / "plugins" / plugin).rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        for pkg in own or {""}:
            offenders += [f"{path.relative_to(ROOT)}: {imp}" for imp in _foreign_private_imports(source, pkg, foreign)]
            if "src" in path.relative_to(ROOT / "plugins" / plugin).parts:
                offenders += [f"{path.relative_to(ROOT)}: {cls}" for cls in _foreign_subclasses(source, pkg, foreign)]
    assert not offenders, "plugins build on each other's public, documented ground only:\n" + "\n".join(offenders)


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
