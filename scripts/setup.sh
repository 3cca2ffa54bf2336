#!/usr/bin/env bash
# Create .venv with the CPU build of torch 2.13.0 (a file already on disk; never a CUDA build), the
# pinned Triton for the CPU interpreter, and every attn distribution installed editable.
# flashinfer-python is deliberately NOT installed: it is CUDA-only and ~300 MB (its plugin, and
# attn-trtllm-mla which depends on it, are installed with --no-deps; their GPU tests skip here). The same
# for flash-attn-4 (FlashAttention-4, CUDA only): attn-flashattention goes in with --no-deps and its CPU
# tests run over an emulation of FA4's forward.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SECONDS=0
say() { echo "setup [${SECONDS}s]: $*"; }  # progress: the steps below take about 2 minutes on a quiet machine, 4+ loaded
say "creating .venv (if missing) and updating pip"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPIP=".venv/bin/python -m pip"
$VPIP install -q --upgrade pip
# torch first, alone, so nothing later can resolve it to a CUDA build
say "installing torch 2.13.0 (the CPU build; about 30 s)"
$VPIP install -q torch==2.13.0
say "installing Triton 3.9.0, numpy, pluggy, pytest, hypothesis, matplotlib, ruff, build tools (about 40 s)"
$VPIP install -q "triton==3.9.0" "numpy>=2" "pluggy>=1.3" "pytest>=8" "hypothesis>=6.100" "matplotlib>=3.7" "ruff>=0.6" "build" "ninja" "setuptools>=68" "wheel"
say "installing attn-core and every plugin, editable"
say "(pip may print 'ERROR: ... dependency resolver ... flashinfer-python' here or below: expected, attn-flashinfer is installed without it on purpose)"
$VPIP install -q -e core
# every plugin editable (attn-sparse, plugins/sparse, included: its kernels need the Triton installed above)
for p in plugins/*/; do
  [ -f "$p/pyproject.toml" ] || continue
  case "$p" in
    plugins/flashinfer_backend/ | plugins/trtllm_mla/ | plugins/flashattention/) $VPIP install -q --no-deps -e "$p" ;;
    *) $VPIP install -q -e "$p" ;;
  esac
done
# Test-only (never a dependency of a shipped distribution): transformers for the example engine and its
# tests (examples/hf_llama.py, tests/test_example_engine.py), constrained to keep the CPU torch above.
echo "torch==2.13.0" > .venv/torch-pin.txt
say "installing transformers 5.23.0 for the example engine's tests (about 30 s)"
$VPIP install -q "transformers==5.23.0" -c .venv/torch-pin.txt
.venv/bin/python -c "import torch; assert not torch.version.cuda, 'a CUDA torch was installed'; print('torch', torch.__version__)"
# attn-ascend's torch-npu is an optional extra (it pins its own torch): never in the CPU environment
.venv/bin/python -c "import importlib.util as u; assert u.find_spec('torch_npu') is None, 'torch-npu was installed'"
.venv/bin/python -c "import importlib.util as u; assert u.find_spec('flash_attn') is None, 'flash-attn(-4) was installed'"
# attn-aiter's AITER (amd-aiter) and attn-wave's wave-lang are ROCm-only extras: never in the CPU environment
.venv/bin/python -c "import importlib.util as u; assert not any(u.find_spec(m) for m in ('aiter', 'wave_lang')), 'a ROCm vendor package was installed'"
say "done: .venv is ready (attn-core list shows the backends usable here)"
