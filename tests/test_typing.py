"""attn ships its types: every distribution under core/, plugins/ and integrations/ has the PEP 561 marker
`py.typed` in its package and declares it as package data, so a user's type checker reads attn's
annotations instead of treating the package as untyped. (That the marker really lands in a built wheel is
checked for attn-core by tests/test_packaging.py, which builds one.)"""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def distributions() -> list[Path]:
    """Every pyproject.toml of a shipped distribution (core, each plugin, each integration)."""
    found = [ROOT / "core" / "pyproject.toml"]
    for folder in ("plugins", "integrations"):
        found += sorted((ROOT / folder).glob("*/pyproject.toml"))
    return found


def test_every_plugin_and_integration_is_discovered():
    names = {p.parent.relative_to(ROOT).as_posix() for p in distributions()}
    for folder in ("plugins", "integrations"):
        for child in (ROOT / folder).iterdir():
            if (child / "src").is_dir():
                assert f"{folder}/{child.name}" in names, f"{folder}/{child.name} has src/ but no pyproject.toml"
    assert "core" in names and len(names) >= 3


@pytest.mark.parametrize("pyproject", distributions(), ids=lambda p: p.parent.relative_to(ROOT).as_posix())
def test_distribution_ships_py_typed(pyproject: Path):
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    where = config["tool"]["setuptools"]["packages"]["find"]["where"]
    assert where == ["src"], f"{pyproject}: packages are expected under src/"
    packages = [p for p in (pyproject.parent / "src").iterdir() if (p / "__init__.py").is_file()]
    assert len(packages) == 1, f"{pyproject}: expected one top-level package under src/, found {packages}"
    package = packages[0]
    marker = package / "py.typed"
    assert marker.is_file(), f"{marker.relative_to(ROOT)} is missing (PEP 561 marker)"
    package_data = config["tool"]["setuptools"].get("package-data", {})
    assert "py.typed" in package_data.get(package.name, []), (
        f'{pyproject.relative_to(ROOT)}: add `{package.name} = ["py.typed"]` under [tool.setuptools.package-data]'
    )


def test_a_type_checker_sees_the_contract(tmp_path: Path):
    """A user's mypy reads attn_core's annotations through its public names (`py.typed` and the exports
    spelled out for type checkers): a wrong use of `create_backend`'s result and of a batch's pool is an
    error naming the real types, not `Any` (which would pass silently)."""
    api = pytest.importorskip("mypy.api")
    user = tmp_path / "user_code.py"
    user.write_text(
        "import attn_core\n"
        "from attn_core import BackendContext, ForwardBatch\n"
        "def make(ctx: BackendContext) -> int:\n"
        "    return attn_core.create_backend('torch_native', ctx)\n"
        "def rows(batch: ForwardBatch) -> str:\n"
        "    return batch.req_to_token_pool\n",
        encoding="utf-8",
    )
    out, err, status = api.run([str(user), "--python-version", "3.12", "--no-incremental", "--follow-imports=silent"])
    assert status == 1, out + err
    assert '(got "AttentionBackend[Any]", expected "int")' in out, out
    assert '"ReqToTokenPool | None", expected "str"' in out, out
