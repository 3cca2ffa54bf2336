#!/usr/bin/env bash
# FlashInfer 0.7.2.post1 for the lent GPU machine (Python 3.12, x86-64; no network there), next to the 0.6.6 of
# scripts/gpu_wheels.sh. The flashinfer-python wheel alone is ~62 MB, close to the 64 MiB of files one device call
# takes along with the working tree, so this script downloads it into .fi07/ of this checkout (git-ignored) and
# splits it over two consecutive device calls on the same warm machine, each taking one folder:
#   call 1, carrying .fi07/a:  mkdir -p /tmp/fi07 && cp .fi07/a/* /tmp/fi07/
#   call 2, carrying .fi07/b:  bash .fi07/b/assemble.sh        (joins the parts, checks the zip, installs it with
#                              the small wheels of .fi07/b into /tmp/site07)
# and then, on that machine (the 0.6.6 setup of scripts/gpu_checks.sh done in an earlier call or the same one):
#   FI_SITE=/tmp/site07 GPU_CHECKS_READY=1 bash scripts/gpu_checks.sh fi-kit fi-tests fi-speed
# /tmp survives only while the machine stays warm: if call 2 finds /tmp/fi07 missing, start again at call 1.
# What 0.7.2.post1 needs to import beyond the GPU image and FlashInfer 0.6.6's wheels (found by importing it with
# --no-deps on a CPU machine): apache-tvm-ffi, requests (urllib3, certifi, idna, charset-normalizer), nvidia-ml-py
# (pynvml) and packaging (its SM90 checks). Its other declared dependencies (cuda-python, cuDNN frontend, CUTLASS
# DSL, NCCL bindings ...) serve kernels attn-flashinfer does not call (it asks for FA2 / "auto" MLA only).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
exclude=$(git rev-parse --git-path info/exclude)  # .git may be a file (a worktree)
mkdir -p "$(dirname "$exclude")" && { grep -qx '/.fi07/' "$exclude" 2>/dev/null || echo '/.fi07/' >> "$exclude"; }
rm -rf .fi07 && mkdir -p .fi07/dl .fi07/a .fi07/b
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d .fi07/dl \
  "flashinfer-python==0.7.2.post1" "apache-tvm-ffi==0.1.15.post2" "nvidia-ml-py" "requests" "urllib3" "certifi" "idna" \
  "charset-normalizer" "packaging" "$@"
big=$(ls .fi07/dl/flashinfer_python-*.whl)
name=$(basename "$big")
split -b 40M "$big" .fi07/a/part.
mv .fi07/a/part.ab .fi07/b/
for w in .fi07/dl/*.whl; do [ "$w" = "$big" ] || mv "$w" .fi07/b/; done
cat > .fi07/b/assemble.sh <<ASSEMBLE
set -euo pipefail
here=\$(cd "\$(dirname "\$0")" && pwd)
[ -f /tmp/fi07/part.aa ] || { echo "/tmp/fi07/part.aa missing: run call 1 again on this machine"; exit 1; }
cp "\$here"/part.ab /tmp/fi07/
cat /tmp/fi07/part.aa /tmp/fi07/part.ab > /tmp/fi07/$name && rm /tmp/fi07/part.*
python3 -c "import zipfile, sys; sys.exit(zipfile.ZipFile('/tmp/fi07/$name').testzip() is not None)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site07 /tmp/fi07/$name "\$here"/*.whl
PYTHONPATH=/tmp/site07 python3 -c "import flashinfer, flashinfer.mla; print('flashinfer', flashinfer.__version__, 'in /tmp/site07')"
ASSEMBLE
rm -rf .fi07/dl
du -sh .fi07/a .fi07/b
