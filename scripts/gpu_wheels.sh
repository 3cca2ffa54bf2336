#!/usr/bin/env bash
# Fetch the Python wheels the lent GPU machine lacks (it has torch 2.11 cu130, Triton 3.6 and nvcc, but no
# network) into .whl/ of this checkout (git-ignored), for Python 3.12 on x86-64 Linux. A device call then
# carries .whl/ and installs them first, as scripts/gpu_checks.sh does:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=$PWD/core/src:/tmp/site:$PYTHONPATH
# flashinfer-python is pinned to 0.6.6 (with the apache-tvm-ffi it was built against): it imports with the
# GPU machine's torch 2.11 / CUDA 13 and JIT-compiles its kernels there. Extra requirements may be given
# as arguments (e.g. pytest==9.2.0 pluggy iniconfig packaging pygments for the GPU test suites).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl "flashinfer-python==0.6.6" "apache-tvm-ffi==0.1.15.post2" "$@"
ls -la .whl
