"""Installing attn outside the checkout, as the README's "Install" section says: `scripts/build_wheels.sh`
builds a wheel of every distribution, and a fresh venv with the CPU build of torch 2.13.0 (installed
first, alone, from the machine's wheel folder; a constraint keeps it) takes attn-core with its
dependencies and every plugin with `--no-deps` (so no plugin pulls triton, flashinfer-python or a CUDA
torch). Then `attn-core list` names every backend with its version and state, one backend runs the kit,
and a plugin whose library is missing gives the registry's one line with the command that installs it.

Costs about a minute and 2 GB of temporary disk (torch in the venv); marked `packaging`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parents[1]


def _package_names() -> tuple[str, ...]:
    """The wheel name of every distribution in the checkout (core and each `plugins/*/pyproject.toml`),
    read from the `name = "attn-..."` line of its pyproject: every one must be built and installed."""
    found = []
    for pyproject in [ROOT / "core" / "pyproject.toml", *sorted((ROOT / "plugins").glob("*/pyproject.toml"))]:
        name = re.search(r'^name = "([^"]+)"', pyproject.read_text(), re.M).group(1)
        found.append(name.replace("-", "_"))
    return tuple(found)


DISTRIBUTIONS = _package_names()


def run(*cmd, ok: bool = True, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    if ok and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, cmd))} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    pytest.importorskip("setuptools")
    tmp = tmp_path_factory.mktemp("wheels")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("*.egg-info", "build", "dist", "__pycache__", ".pytest_cache", "tests")
    for part in ("core", "plugins", "scripts"):  # build from a copy: the checkout stays untouched
        shutil.copytree(ROOT / part, src / part, ignore=ignore)
    dist = tmp / "dist"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    built = run(
        "bash", src / "scripts" / "build_wheels.sh", env={**env, "DIST": str(dist), "PYTHON": sys.executable}
    ).stdout
    wheels = {w.name.split("-")[0]: w for w in dist.glob("*.whl")}
    assert sorted(wheels) == sorted(DISTRIBUTIONS), built
    venv = tmp / "venv"
    run(sys.executable, "-m", "venv", venv)
    py, bin_dir = venv / "bin" / "python", venv / "bin"
    pin = tmp / "torch-pin.txt"
    pin.write_text("torch==2.13.0\n")
    run(py, "-m", "pip", "install", "-q", "torch==2.13.0", env=env)  # first and alone: the CPU wheel on disk
    run(py, "-m", "pip", "install", "-q", "-c", pin, wheels["attn_core"], env=env)  # + pluggy, numpy
    plugins = [wheels[d] for d in DISTRIBUTIONS if d != "attn_core"]
    run(py, "-m", "pip", "install", "-q", "--no-deps", *plugins, env=env)
    return {"py": py, "bin": bin_dir, "env": {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"}, "cwd": tmp}


def test_the_venv_runs_the_wheels_on_cpu_torch(installed):
    probe = "import attn_core, torch; print(attn_core.__file__); print(torch.__version__, torch.version.cuda)"
    core_file, torch_line = run(
        installed["py"], "-c", probe, env=installed["env"], cwd=installed["cwd"]
    ).stdout.splitlines()
    assert "site-packages" in core_file and str(ROOT) not in core_file
    assert torch_line.startswith("2.13.0") and torch_line.endswith("None"), torch_line  # no CUDA build


def test_list_names_every_backend_and_one_runs(installed):
    attn = installed["bin"] / "attn-core"
    version = run(attn, "--version", env=installed["env"], cwd=installed["cwd"]).stdout
    assert version.startswith("attn-core 0.1.0") and "attn-flashinfer 0.1.0 (flashinfer, flashinfer_mla)" in version
    listing = run(attn, "list", env=installed["env"], cwd=installed["cwd"]).stdout
    assert re.search(r"^torch_native\s+attn-core\s+0\.1\.0\s+available", listing, re.M), listing
    for name, dist in (
        ("triton", "attn-triton"),
        ("flashinfer", "attn-flashinfer"),
        ("ascend", "attn-ascend"),
        ("aiter", "attn-aiter"),
        ("wave", "attn-wave"),
    ):
        assert re.search(rf"^{name}\s+{dist}\s+0\.1\.0\s+unavailable: ", listing, re.M), listing
    assert "triton not installed (pip install triton)" in listing
    where = dict(env=installed["env"], cwd=installed["cwd"])
    out = run(attn, "check", "torch_native", "--device", "cpu", "--quick", "-k", "mode-DECODE", **where).stdout
    assert "check: 1 passed, 0 failed" in out, out
    refused = run(attn, "check", "flashinfer", ok=False, **where)
    line = "attn-core check: attention backend 'flashinfer' cannot run here: flashinfer-python not installed"
    assert refused.returncode == 2 and refused.stderr.strip().startswith(line), refused.stderr
