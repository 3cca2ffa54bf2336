"""Install-by-name from built wheels: attn-core and example plugins in a fresh venv, offline.

What it proves: a plugin built as a wheel and installed next to attn-core is found by name through its
entry point, passes `attn-core check` (and its 5-line pytest conformance file, through attn-core's
pytest11 plugin), and after `pip uninstall` the name gives the typed "unknown backend" error. Plugins
whose spec import raises, that claim a taken name, or that target another API major version each give
their typed error while `torch_native` stays usable.

Environment choice (time and disk): the venv gets torch, numpy, pluggy, pytest and hypothesis - and only them,
plus their own dependencies - by a `.pth` file pointing at a folder of symlinks into the running
interpreter's site-packages. That takes about a second and no disk, where installing torch into the venv
takes ~25 s and 2 GB (and `--system-site-packages` would need a base interpreter that has torch but not
attn-core, which CI does not promise). attn-core itself is not linked: it comes from the wheel built here.
Every pip call uses `--no-index`, so nothing is downloaded and no CUDA build can be pulled.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "tests" / "example_plugins"
EXAMPLES = ("attn_example", "attn_example_broken", "attn_example_dup", "attn_example_api2")
#: what the venv borrows from this interpreter (with their dependencies)
BORROWED = ("torch", "numpy", "pluggy", "pytest", "hypothesis")


def run(*cmd, ok: bool = True, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    if ok and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, cmd))} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def _requirement_names(dist: metadata.Distribution) -> list[str]:
    """Names of `dist`'s requirements that apply here (extras and failing markers dropped)."""
    from packaging.requirements import Requirement

    names = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.append(req.name)
    return names


def _closure(roots) -> list[metadata.Distribution]:
    seen: dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency this interpreter does not have
        seen[key] = dist
        todo += _requirement_names(dist)
    return list(seen.values())


def link_site(dest: Path, roots) -> None:
    """Symlink the top-level files and folders of `roots` and their dependencies into `dest`."""
    dest.mkdir()
    for dist in _closure(roots):
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        base = Path(dist.locate_file(""))
        for top in tops:
            src = base / top
            if src.exists() and not (dest / top).exists() and not top.endswith(".pth"):
                (dest / top).symlink_to(src)


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> dict:
    pytest.importorskip("setuptools")
    pytest.importorskip("packaging")
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("*.egg-info", "build", "dist", "__pycache__", ".pytest_cache")
    shutil.copytree(ROOT / "core", src / "core", ignore=ignore)  # build outside the shared checkout
    for name in EXAMPLES:
        shutil.copytree(PLUGINS / name, src / name, ignore=ignore)
    wheels = tmp / "wheels"
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-q",
        "-w",
        wheels,
        src / "core",
        *(src / n for n in EXAMPLES),
    )
    env_dir = tmp / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", env_dir)
    py = env_dir / "bin" / "python"
    site = Path(run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    link_site(tmp / "borrowed", BORROWED)
    (site / "_attn_borrowed.pth").write_text(str(tmp / "borrowed") + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PIP_NO_INDEX"] = "1"

    def pip(*args, ok=True):
        return run(sys.executable, "-m", "pip", "--python", py, *args, ok=ok, env=env)

    pip("install", "-q", "--find-links", wheels, "attn-core", "attn-example")
    return {"py": py, "bin": env_dir / "bin", "env": env, "pip": pip, "wheels": wheels, "src": src, "site": site}


def attn(v, *args, ok=True):
    return run(v["bin"] / "attn-core", *args, ok=ok, env=v["env"], cwd=v["src"])


def test_wheel_is_what_runs(venv):
    where = run(
        venv["py"], "-c", "import attn_core, torch; print(attn_core.__file__); print(torch.__file__)", env=venv["env"]
    ).stdout
    core_file, torch_file = where.split()
    assert core_file.startswith(str(venv["site"])), "attn_core must come from the installed wheel, not the checkout"
    assert "borrowed" in torch_file
    assert sysconfig.get_paths()["purelib"] not in core_file


def test_core_wheel_ships_its_types(venv):
    """The PEP 561 marker reaches the installed package, so a user's type checker reads attn-core's hints."""
    assert (venv["site"] / "attn_core" / "py.typed").is_file()


def test_example_found_by_name_and_passes_the_kit(venv):
    listing = attn(venv, "list").stdout
    assert re.search(r"^example\s+attn-example\s+0\.1\.0\s+available", listing, re.M), listing
    out = attn(venv, "check", "example", "--quick", "--device", "cpu").stdout
    assert re.search(r"^check: \d+ passed, 0 failed, 0 skipped", out, re.M), out
    assert (
        "PASS  refuse-logit_cap" in out
        and "PASS  refuse-mode-TARGET_VERIFY" in out
        and "PASS  spec-import_light" in out
    )


def test_plugin_conformance_file_runs_through_the_pytest_plugin(venv):
    tests = venv["src"] / "attn_example" / "tests"
    proc = run(
        venv["py"],
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        tests,
        "--attn-quick",
        "--attn-device",
        "cpu",
        env=venv["env"],
        cwd=tests,
        ok=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed, \d+ skipped", summary), summary  # skipped: the file's own skip list (long-*)


def test_broken_plugins_give_typed_errors_and_torch_native_stays_usable(venv):
    venv["pip"](
        "install", "-q", "--find-links", venv["wheels"], "attn-example-broken", "attn-example-dup", "attn-example-api2"
    )
    probe = textwrap.dedent(
        """
        import json
        from attn_core.contract import errors
        from attn_core.discovery import registry
        out = {}
        for name in ("example", "example_broken", "example_api2", "torch_native"):
            try:
                registry.get_backend_class(name)
                out[name] = "ok"
            except errors.AttnError as exc:
                out[name] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(out))
        """
    )
    result = json.loads(run(venv["py"], "-c", probe, env=venv["env"]).stdout)
    assert result["torch_native"] == "ok"
    assert result["example"].startswith("DuplicateBackendError:") and "attn-example-dup" in result["example"]
    assert result["example_broken"].startswith("BackendLoadError:") and "libexample.so" in result["example_broken"]
    assert result["example_api2"].startswith("ApiVersionMismatchError:") and "2.0" in result["example_api2"]
    listing = attn(venv, "list").stdout
    assert re.search(r"^torch_native\s+attn-core\s+0\.1\.0\s+available", listing, re.M), listing
    assert "failed: attention backend 'example_broken' failed to load" in listing
    out = attn(venv, "check", "torch_native", "--quick", "--device", "cpu", "-k", "mode-DECODE").stdout
    assert "check: 1 passed, 0 failed" in out
    dup = attn(venv, "check", "example", ok=False)
    assert dup.returncode == 2 and "claimed by several distributions" in dup.stderr
    venv["pip"]("uninstall", "-y", "-q", "attn-example-broken", "attn-example-dup", "attn-example-api2")


def test_ascend_wheel_keeps_torch_npu_optional_and_lists_its_reason(venv):
    """attn-ascend as a wheel: torch-npu only behind the `npu` extra (it pins its own torch), installed
    without it, `attn-core list` shows the backend unavailable with the reason and how far it is verified."""
    src = venv["src"] / "ascend"
    shutil.copytree(
        ROOT / "plugins" / "ascend", src, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__", "tests")
    )
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-q",
        "-w",
        venv["wheels"],
        src,
    )
    wheel = next(venv["wheels"].glob("attn_ascend-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [ln.split(":", 1)[1].strip() for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    npu = [r for r in requires if r.lower().startswith(("torch-npu", "torch_npu"))]
    assert npu and all('extra == "npu"' in r for r in npu), requires
    venv["pip"]("install", "-q", "--find-links", venv["wheels"], "attn-ascend")
    try:
        found = run(
            venv["py"], "-c", "import importlib.util; print(importlib.util.find_spec('torch_npu'))", env=venv["env"]
        ).stdout
        assert found.strip() == "None"
        listing = attn(venv, "list").stdout
        line = re.search(r"^ascend\s+attn-ascend\s+0\.1\.0\s+unavailable: (.*)$", listing, re.M)
        assert line, listing
        assert line.group(1).startswith("needs torch_npu and an Ascend NPU (pip install attn-ascend[npu])")
        assert "emulation of the documented torch_npu operators" in line.group(
            1
        ) and "not on NPU hardware" in line.group(1)
    finally:
        venv["pip"]("uninstall", "-y", "-q", "attn-ascend")


def test_uninstalled_plugin_is_unknown(venv):
    venv["pip"]("uninstall", "-y", "-q", "attn-example")
    gone = attn(venv, "check", "example", ok=False)
    assert gone.returncode == 2 and "unknown attention backend 'example'" in gone.stderr, gone.stderr
    known = attn(venv, "check", "trtllm_mla", ok=False)
    assert known.returncode == 2 and "is not installed: pip install attn-trtllm-mla" in known.stderr


def test_trtllm_mla_installs_next_to_attn_flashinfer_without_pulling_flashinfer(venv):
    """attn-trtllm-mla's wheel declares attn-flashinfer; installed (both with --no-deps, as CPU CI does)
    its backend is listed by name with its probe reason and the unverified Blackwell path, and neither
    flashinfer nor the backend classes are imported by discovery."""
    ignore = shutil.ignore_patterns("*.egg-info", "build", "dist", "__pycache__", ".pytest_cache")
    for name in ("flashinfer_backend", "trtllm_mla"):
        shutil.copytree(ROOT / "plugins" / name, venv["src"] / name, ignore=ignore)
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-q",
        "-w",
        venv["wheels"],
        venv["src"] / "flashinfer_backend",
        venv["src"] / "trtllm_mla",
    )
    venv["pip"]("install", "-q", "--no-deps", "--find-links", venv["wheels"], "attn-flashinfer", "attn-trtllm-mla")
    requires = run(
        venv["py"], "-c", "from importlib import metadata; print(metadata.requires('attn-trtllm-mla'))", env=venv["env"]
    ).stdout
    assert "attn-flashinfer" in requires
    listing = attn(venv, "list").stdout
    row = next(line for line in listing.splitlines() if line.startswith("trtllm_mla"))
    assert re.search(r"^trtllm_mla\s+attn-trtllm-mla\s+0\.1\.0\s+unavailable: ", row), row
    assert "SM100/SM120" in row and "never run on hardware" in row
    assert re.search(r"^flashinfer_mla\s+attn-flashinfer\s+0\.1\.0\s+unavailable: ", listing, re.M), listing
    probe = (
        "import sys; from attn_core.discovery import registry; registry.list_backends(); "
        "print(sorted(m for m in sys.modules if 'infer' in m))"
    )
    loaded = run(venv["py"], "-c", probe, env=venv["env"]).stdout
    assert "'flashinfer'" not in loaded and "attn_flashinfer.mla_backend" not in loaded, loaded
    venv["pip"]("uninstall", "-y", "-q", "attn-trtllm-mla", "attn-flashinfer")


def doc_files(doc: Path) -> dict[str, str]:
    """The files a doc spells out: every fenced block right after an `<!-- file: PATH ... -->` line,
    by PATH."""
    text = doc.read_text(encoding="utf-8")
    found = re.findall(r"^<!-- file: (\S+)[^\n]*-->\n```[a-z]*\n(.*?)^```", text, re.M | re.S)
    return {path: body for path, body in found}


def test_plugin_authors_doc_snippet_installs_and_passes_the_kit(venv, tmp_path):
    """docs/plugin-authors.md's own pyproject.toml (complete: version, [build-system]) and starter files,
    extracted from the doc, built as a wheel, installed next to attn-core: found by name, and the kit passes."""
    files = doc_files(ROOT / "docs" / "plugin-authors.md")
    assert {
        "pyproject.toml",
        "src/attn_mybackend/spec.py",
        "src/attn_mybackend/backend.py",
        "tests/test_conformance.py",
    } <= set(files)
    project = tmp_path / "attn-mybackend"
    for path, body in files.items():
        (project / path).parent.mkdir(parents=True, exist_ok=True)
        (project / path).write_text(body, encoding="utf-8")
    (project / "src" / "attn_mybackend" / "__init__.py").write_text("", encoding="utf-8")
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-q",
        "-w",
        venv["wheels"],
        project,
    )
    venv["pip"]("install", "-q", "--find-links", venv["wheels"], "attn-mybackend")
    try:
        listing = attn(venv, "list").stdout
        assert re.search(r"^mybackend\s+attn-mybackend\s+0\.1\.0\s+available", listing, re.M), listing
        out = attn(venv, "check", "mybackend", "--quick", "--device", "cpu").stdout
        assert re.search(r"^check: \d+ passed, 0 failed, 0 skipped", out, re.M), out
    finally:
        venv["pip"]("uninstall", "-y", "-q", "attn-mybackend")
