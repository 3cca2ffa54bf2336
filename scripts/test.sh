#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run every test suite on the CPU: lint, the type check, attn-core, every plugin (Triton
# kernels under the interpreter), and the cross-package tests. GPU tests skip without CUDA. Then vLLM's own
# engine on attn (integrations/vllm/tests) in .venv-vllm (setup.sh --vllm); ATTN_SKIP_VLLM=1 leaves it out.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${ATTN_SKIP_VLLM:-0}" = 1 ]; then bash scripts/setup.sh; else bash scripts/setup.sh --vllm; fi
.venv/bin/ruff check core plugins tests benchmarks examples integrations  # lines <= 120 columns ([tool.ruff])
.venv/bin/ruff format --check core plugins tests benchmarks examples integrations scripts
# the type check of attn-core ([tool.mypy] in pyproject.toml): any error fails the run
.venv/bin/mypy
suites=(core/tests)
for p in plugins/*/tests; do [ -d "$p" ] && suites+=("$p"); done
[ -d tests ] && suites+=(tests)
TRITON_INTERPRET=1 .venv/bin/python -m pytest "${suites[@]}" "$@"
if [ "${ATTN_SKIP_VLLM:-0}" != 1 ]; then
  .venv-vllm/bin/python -m pytest integrations/vllm/tests "$@"
fi
