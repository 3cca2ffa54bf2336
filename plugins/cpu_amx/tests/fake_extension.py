"""A stand-in compile step for `attn_cpu_amx.build.ensure_built`: builds, in well under a second, a tiny
Python extension module of the requested name whose `answer()` returns 42 (plus 256 KiB of constant
data, so that a truncated copy loses mapped pages, as a truncated kernels library would)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

SOURCE = """
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static const unsigned char padding[1 << 18] = {1};
static PyObject* answer(PyObject* self, PyObject* unused) {
    return PyLong_FromLong(40 + padding[0] + padding[1 << 17] + 1);
}
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, "42"}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "NAME", NULL, -1, methods};
PyMODINIT_FUNC PyInit_NAME(void) { return PyModule_Create(&module); }
"""


def compile_fake(name: str, scratch: Path) -> Path:
    """The compile step: write and compile the stand-in module `name` in `scratch`."""
    src = scratch / f"{name}.c"
    src.write_text(SOURCE.replace("NAME", name))
    library = scratch / f"{name}.so"
    cc = os.environ.get("CC", "cc")
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O0", f"-I{sysconfig.get_paths()['include']}", str(src), "-o", str(library)],
        check=True,
    )
    return library


def compile_slowly(name: str, scratch: Path) -> Path:
    """Announce the build on stdout, take `SLOW_BUILD_SECONDS` (env), then build like `compile_fake`."""
    print("compiling", flush=True)
    time.sleep(float(os.environ.get("SLOW_BUILD_SECONDS", "1")))
    return compile_fake(name, scratch)


def compile_nothing(name: str, scratch: Path) -> Path:
    raise AssertionError("this process must not compile: a verified build is in the cache")


if __name__ == "__main__":
    # python fake_extension.py <compile step>: ensure_built with it, import the module, print
    # "<answer()> compiled=<bool> <the csrc folder of the attn_cpu_amx imported>"
    from attn_cpu_amx import build

    info = build.ensure_built(globals()[sys.argv[1]])
    print(
        build.import_library(build.module_name(), info.library).answer(),
        f"compiled={info.compiled}",
        build.CSRC,
        flush=True,
    )
