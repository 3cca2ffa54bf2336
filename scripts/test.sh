#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run every test suite on the CPU: lint, attn-core, every plugin (Triton
# kernels under the interpreter), and the cross-package tests. GPU tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check core plugins tests benchmarks examples
suites=(core/tests)
for p in plugins/*/tests; do [ -d "$p" ] && suites+=("$p"); done
[ -d tests ] && suites+=(tests)
TRITON_INTERPRET=1 .venv/bin/python -m pytest "${suites[@]}" "$@"
