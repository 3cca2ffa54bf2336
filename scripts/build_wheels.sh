#!/usr/bin/env bash
# Build a wheel of every attn distribution (attn-core and each plugin under plugins/) into dist/ (or $DIST),
# for installing attn outside this checkout:  pip install torch  (a CPU or CUDA build, first)  then
#   pip install dist/attn_core-*.whl dist/attn_triton-*.whl ...
# Uses .venv/bin/python when present (scripts/setup.sh), else python3; builds without network when setuptools
# is installed (--no-build-isolation), and never installs anything.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
DIST=${DIST:-dist}
mkdir -p "$DIST"
isolation=()
"$PY" -c "import setuptools" 2>/dev/null && isolation=(--no-build-isolation)
projects=(core)
for p in plugins/*/; do [ -f "$p/pyproject.toml" ] && projects+=("${p%/}"); done
echo "build_wheels: ${#projects[@]} distributions -> $DIST/"
for p in "${projects[@]}"; do
  echo "  building $p"
  "$PY" -m pip wheel -q --no-deps "${isolation[@]}" -w "$DIST" "./$p"
done
ls -1 "$DIST"/*.whl
