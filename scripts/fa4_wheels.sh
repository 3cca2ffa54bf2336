#!/usr/bin/env bash
# Fetch FlashAttention-4 (flash-attn-4, CuTe DSL) and the wheels it needs for the lent GPU machine (Python 3.12,
# x86-64, CUDA 13; it has torch and Triton but no network) into .fa4/ of this checkout (git-ignored).
#
# A device call takes at most 64 MiB of files along; these wheels are ~106 MiB, ~92 MiB of them the CUTLASS
# DSL compiler libraries (one wheel). So they travel in three device calls, one right after the other on the
# same warm machine (/tmp survives only while the machine is held; if a later call finds /tmp/fa4 missing or
# incomplete, the machine was given back: start again at call 1), each carrying one folder:
#   call 1, carry .fa4/a (first half of the big wheel):   bash scripts/gpu_checks.sh fa4-wheels-1
#   call 2, carry .fa4/b (second half, and its rejoiner): bash scripts/gpu_checks.sh fa4-wheels-2
#   call 3, carry .fa4/c (every other wheel):             bash scripts/gpu_checks.sh fa4-install [fa4 parts]
# fa4-install puts them into /tmp/site with `pip install --target` and adds /tmp/site and
# /tmp/site/nvidia_cutlass_dsl/dsl_packages to PYTHONPATH (a --target install does not run the wheel's .pth
# file, which would add the second). Extra requirement strings given as arguments go to .fa4/c.
#
# apache-tvm-ffi (needed by FA4) is fetched too, so the FA4 calls need nothing from .whl/; the version is the one
# scripts/gpu_wheels.sh pins for FlashInfer, so installing both into /tmp/site agrees.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
git_dir=$(git rev-parse --git-common-dir 2>/dev/null || echo .git)
mkdir -p "$git_dir/info"
grep -qx '/.fa4/' "$git_dir/info/exclude" 2>/dev/null || echo '/.fa4/' >> "$git_dir/info/exclude"

FA4_PINS=(
  "flash-attn-4==4.0.0b36"
  "nvidia-cutlass-dsl==4.8.1" "nvidia-cutlass-dsl-libs-base==4.8.1" "nvidia-cutlass-dsl-libs-core==4.8.1"
  "nvidia-cutlass-dsl-libs-cu13==4.8.1"
  "cuda-bindings==13.5.0" "cuda-pathfinder==1.9.1"
  "quack-kernels==0.6.5" "torch-c-dlpack-ext==0.1.5" "einops==0.8.2" "apache-tvm-ffi==0.1.15.post2"
)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done

rm -rf .fa4
mkdir -p .fa4/download .fa4/a .fa4/b .fa4/c
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .fa4/download "${FA4_PINS[@]}" "$@"

# the one wheel over the limit: cut in two pieces of at most 47 MiB, one per call, rejoined on the machine
big=$(ls .fa4/download/nvidia_cutlass_dsl_libs_cu13-*.whl)
name=$(basename "$big")
split -b 47M -d -a 1 "$big" ".fa4/a/$name.part"
mv ".fa4/a/$name.part1" .fa4/b/
[ ! -e ".fa4/a/$name.part2" ] || { echo "fa4_wheels.sh: $name needs more than two pieces" >&2; exit 1; }
sha256sum "$big" | awk '{print $1}' > ".fa4/b/$name.sha256"
rm "$big"
mv .fa4/download/*.whl .fa4/c/
rmdir .fa4/download
du -sh .fa4/a .fa4/b .fa4/c
echo "wrote $root/.fa4 (a: piece 1 of $name; b: piece 2 and its checksum; c: the other wheels)"
