"""The user docs stay true to the repository: design.md names every plugin, the docs' file paths and
attn_core names exist, and docs/performance.md keeps its shape (short; a date and a reproduce command per
section; every script it names exists; one line per known gap)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
USER_DOCS = ["README.md", "docs/design.md", "docs/engine-authors.md", "docs/plugin-authors.md", "docs/performance.md"]
PATH = re.compile(r"`((?:core|plugins|tests|examples|benchmarks|scripts|docs)/[\w./-]*[\w/])`")
CORE_NAME = re.compile(r"`(attn_core(?:\.\w+)+)")


def _text(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def _plugins() -> list[str]:
    return sorted(p.name for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").exists())


def test_there_are_plugins():
    assert len(_plugins()) >= 2


@pytest.mark.parametrize("plugin", _plugins())
def test_design_names_every_plugin(plugin):
    design = _text("docs/design.md")
    assert f"plugins/{plugin}/" in design, (
        f"docs/design.md §2 does not name plugins/{plugin}/ (add a row to its plugin table)"
    )


@pytest.mark.parametrize("doc", USER_DOCS)
def test_the_paths_a_doc_names_exist(doc):
    roots = [ROOT, *(ROOT / "plugins" / name for name in _plugins())]  # a plugin's own `tests/...` counts
    missing = sorted({p for p in PATH.findall(_text(doc)) if not any((r / p).exists() for r in roots)})
    assert not missing, f"{doc} names paths the repository does not have: {missing}"


def _resolves(dotted: str) -> bool:
    """`attn_core.a.b.c` names a module, or an attribute (chain) of the longest importable module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("doc", ["docs/design.md", "docs/engine-authors.md", "docs/performance.md"])
def test_the_attn_core_names_a_doc_uses_exist(doc):
    missing = sorted({n for n in CORE_NAME.findall(_text(doc)) if not _resolves(n)})
    assert not missing, f"{doc} names attn_core modules or attributes that do not exist: {missing}"


def test_the_name_check_finds_what_it_must():
    assert _resolves("attn_core.contract.validation.SMALL_HOST_BATCH") and _resolves("attn_core.bench.timing")
    assert not _resolves("attn_core.contract.validation.NO_SUCH_NAME") and not _resolves("attn_core.no_such_module")


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def test_performance_page_is_short():
    lines = _text("docs/performance.md").splitlines()
    assert len(lines) <= 200, f"docs/performance.md has {len(lines)} lines (at most 200: current numbers only)"


def test_performance_page_scripts_exist():
    text = _text("docs/performance.md")
    named = set(re.findall(r"benchmarks/(\w+\.py)", text))
    assert named, "docs/performance.md names no benchmark script"
    missing = sorted(n for n in named if not (ROOT / "benchmarks" / n).exists())
    assert not missing, f"docs/performance.md names scripts that are not in benchmarks/: {missing}"


def test_every_number_section_has_a_date_and_a_reproduce_command():
    general = {"The knobs and what they did", "Known gaps", "Method"}
    sections = _sections(_text("docs/performance.md"))
    assert len(sections) > len(general)
    for title, body in sections.items():
        if title in general:
            continue
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", body), f"section {title!r} gives no date"
        assert re.search(r"(python|torchrun)\b[^\n]*benchmarks/\w+\.py", body), (
            f"section {title!r} gives no reproduce command"
        )


def test_known_gaps_are_one_line_each():
    body = _sections(_text("docs/performance.md"))["Known gaps"]
    lines = [line for line in body.splitlines() if line.strip()]
    assert lines and all(line.startswith("- ") for line in lines), "one line per known gap: " + repr(lines)


def test_readme_points_users_at_the_performance_page():
    assert "docs/performance.md" in _text("README.md")
