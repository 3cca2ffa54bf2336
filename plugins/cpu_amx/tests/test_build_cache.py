"""The kernels' build cache: hash-checked loads, an OS lock that dies with its holder, 0700 folders and a
key without paths. A stand-in compile step (fake_extension.py) builds a tiny module in well under a
second; the real build is exercised by every test that creates the backend."""

import hashlib
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from fake_extension import compile_fake, compile_nothing

from attn_cpu_amx import build

HERE = Path(__file__).parent
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="needs a C compiler")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(build.CACHE_ENV, str(root))
    return root


def _env(cache: Path, pythonpath=(), **extra) -> dict:
    return {
        **os.environ,
        build.CACHE_ENV: str(cache),
        "PYTHONPATH": os.pathsep.join([*map(str, pythonpath), str(HERE), os.environ.get("PYTHONPATH", "")]),
        **extra,
    }


def _build_in_subprocess(step: str, cache: Path, pythonpath=()) -> list[str]:
    """Run ensure_built(step) and import the result in a fresh process; its words of output."""
    out = subprocess.run(
        [sys.executable, str(HERE / "fake_extension.py"), step],
        env=_env(cache, pythonpath),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"exit status {out.returncode} (-7 is SIGBUS)\n{out.stderr}"
    return out.stdout.split()


def _start_slow_build(cache: Path, seconds: float) -> subprocess.Popen:
    slow = subprocess.Popen(
        [sys.executable, str(HERE / "fake_extension.py"), "compile_slowly"],
        env=_env(cache, SLOW_BUILD_SECONDS=str(seconds)),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert slow.stdout.readline().strip() == "compiling"  # it holds the build lock from here on
    return slow


def test_a_build_records_its_hash_in_private_folders_and_is_reused(cache):
    info = build.ensure_built(compile_fake)
    assert info.compiled and info.library.parent == info.directory == build.build_dir()
    recorded = (info.directory / (info.library.name + ".sha256")).read_text().strip()
    assert recorded == hashlib.sha256(info.library.read_bytes()).hexdigest()
    for folder in (cache, info.directory):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert not list(info.directory.glob("scratch-*"))
    again = build.ensure_built(compile_nothing)
    assert not again.compiled and again.library == info.library and build.is_built()


@pytest.mark.parametrize("damage", ["truncate", "flip_a_byte", "lose_the_hash"])
def test_a_damaged_library_is_rebuilt_never_loaded(cache, damage):
    library = build.ensure_built(compile_fake).library
    data = library.read_bytes()
    if damage == "truncate":
        library.write_bytes(data[: len(data) // 2])
        # loading it as it is kills the process (SIGBUS) or fails: the damage is real
        load = f"from attn_cpu_amx import build; build.import_library({build.module_name()!r}, {str(library)!r})"
        assert (
            subprocess.run([sys.executable, "-c", load], env=_env(cache), capture_output=True, timeout=60).returncode
            != 0
        )
    elif damage == "flip_a_byte":
        library.write_bytes(data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1 :])
    else:
        (library.parent / (library.name + ".sha256")).unlink()
    assert _build_in_subprocess("compile_fake", cache)[:2] == ["42", "compiled=True"]
    assert build.is_verified(library)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_build_never_blocks_later_processes(cache, sig):
    slow = _start_slow_build(cache, seconds=600)
    slow.send_signal(sig)
    assert slow.wait(timeout=30) == -sig
    assert list(build.build_dir().glob("scratch-*"))  # the killed build left its scratch folder
    assert _build_in_subprocess("compile_fake", cache)[:2] == ["42", "compiled=True"]  # no wait on a dead lock
    assert not list(build.build_dir().glob("scratch-*"))


def test_a_live_build_is_waited_for_then_reused(cache):
    slow = _start_slow_build(cache, seconds=1.5)
    assert _build_in_subprocess("compile_nothing", cache)[:2] == ["42", "compiled=False"]
    assert slow.wait(timeout=60) == 0 and slow.stdout.read().split()[:2] == ["42", "compiled=True"]


def test_two_checkouts_share_one_build(cache, tmp_path):
    package = Path(build.__file__).parent
    for checkout in ("a", "b"):
        shutil.copytree(package, tmp_path / checkout / "attn_cpu_amx", ignore=shutil.ignore_patterns("__pycache__"))
    first = _build_in_subprocess("compile_fake", cache, pythonpath=[tmp_path / "a"])
    assert first == ["42", "compiled=True", str(tmp_path / "a" / "attn_cpu_amx" / "csrc")]
    second = _build_in_subprocess("compile_nothing", cache, pythonpath=[tmp_path / "b"])
    assert second == ["42", "compiled=False", str(tmp_path / "b" / "attn_cpu_amx" / "csrc")]
    header = tmp_path / "b" / "attn_cpu_amx" / "csrc" / "common.h"
    header.write_text(header.read_text() + "\n// edited\n")  # an edited source is another key
    assert _build_in_subprocess("compile_fake", cache, pythonpath=[tmp_path / "b"])[:2] == ["42", "compiled=True"]
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 2
