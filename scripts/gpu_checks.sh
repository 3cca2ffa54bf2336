#!/usr/bin/env bash
# Every GPU check of the project in one command, for a machine with a CUDA GPU and torch + triton
# installed (the lent H100/H200 machine: no network; FlashInfer comes from wheels carried in .whl/ and
# its prebuilt kernels from .fi-cache/aot.tar.xz when present). Logs go to $OUT (default ./gpu-out).
#   bash scripts/gpu_checks.sh [tests | tests-core tests-triton tests-fi check] [bench] [triton-bench] [verify-bench] [fi-bench] [fi-window] [mla-bench] [cascade-bench] [mla] [engine] [engine-kv] [multi-gpu] [vendors] [fi-kit fi-tests fi-speed] [vision | vision-triton vision-fi vision-hf] [vision-bench] [hostile] [hostile-memcheck] [hostile-bench] [host-ab] [masked] [kv-write-bench] [hopper-clean]
#        [sparse-kit = sparse-kit-ds sparse-kit-dc] [sparse-tests] [sparse-bench]   (default: tests bench;
#   sparse-* = attn-sparse: the kit on cuda for double_sparsity / dual_chunk, its GPU tests, its benchmark;
#   fi-kit / fi-tests / fi-speed = attn-flashinfer per FlashInfer release: FI_SITE=/tmp/site07 for 0.7.2.post1, see scripts/gpu_fi07_wheels.sh;
#   vision = issue 40's GPU tests (non-causal / span / ragged checks, the vision-tower shape, HF towers); vision-bench = benchmarks/ragged_vs_peers.py;
#   engine-kv = engine-owned KV memory on cuda (tests/test_engine_kv_gpu.py) and benchmarks/engine_kv_layout.py;
#   hostile / hostile-memcheck / hostile-bench = issue 36 (safe by default): see the parts below;
#   host-ab = issue 36: host time per step against the base tree in one process (benchmarks/step_host_ab.py);
#   masked / kv-write-bench = issue 36: the K/V write's clean of non-finite values, the masked-values checks on cuda, the write's cost;
#   hopper-clean = the Hopper extend kernel with ExtendConfig.wgmma_clean_masked: its GPU tests and its extend rows against the default;
#   bench = every benchmark; mla = attn-triton's MLA kernel alone: its GPU tests and the MLA benchmark without the prefill row;
#   CHECK_JOBS (default 6) / CHECK_PER_PROCESS (default 8): `attn-core check --isolate`'s processes at once and checks a process (a crash fails one check);
#   BENCH_ONLY=meta limits the Triton benchmark's rows; FP8_CONFIGS="n,h,w,s[,v];..." the fp8 decode tiles swept in its fp8 row)
# FlashAttention-4 (attn-flashattention, issue 38) has parts of its own, each fitting one device call; its wheels come in
# three calls (scripts/fa4_wheels.sh): fa4-wheels-1 (carry .fa4/a), fa4-wheels-2 (carry .fa4/b), then fa4-install (carry
# .fa4/c) with any of fa4-tests fa4-kit fa4-check fa4-engine fa4-bench in the same or later calls (GPU_CHECKS_READY=1).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
what=" ${*:-tests bench} "
want() { [[ "$what" == *" $1 "* || "$what" == *" all "* ]]; }
asked() { [[ "$what" == *" $1 "* ]]; }  # parts that run only when named (not by "all"): FlashAttention-4's
# GPU_CHECKS_READY=1: setup already done by an earlier call on this machine (parts run side by side)
if asked fa4-wheels-1 || asked fa4-wheels-2; then
  GPU_CHECKS_READY=${GPU_CHECKS_READY:-1}  # these calls only move wheel pieces: no setup
fi
if [ -n "${GPU_CHECKS_READY:-}" ]; then
  [ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  [ -d /tmp/fiws ] && export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
else
  if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e core -e plugins/triton_backend -e plugins/flashinfer_backend -e plugins/trtllm_mla \
    -e plugins/sparse -e plugins/flashattention || exit 1
  if ls .fi-cache/aot*.tar.xz >/dev/null 2>&1 && python3 -c "import flashinfer" 2>/dev/null; then  # each holds aot/<module>/
    for t in .fi-cache/aot*.tar.xz; do tar -C /tmp -xJf "$t" || exit 1; done
    python3 plugins/flashinfer_backend/tools/jit_cache.py install /tmp/aot || exit 1
  fi
  if ls .fi-cache/*_fi.tgz >/dev/null 2>&1; then  # FlashInfer JIT caches (.cache/flashinfer/...): benchmark peers, MLA kernels
    mkdir -p /tmp/fiws && export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
    for t in .fi-cache/*_fi.tgz; do tar -C /tmp/fiws -xzf "$t" || exit 1; done
  fi
fi
# ---- FlashAttention-4: its wheels in three calls, then its install (scripts/fa4_wheels.sh says why) ----
if asked fa4-wheels-1; then
  rm -rf /tmp/fa4 && mkdir -p /tmp/fa4 && cp .fa4/a/* /tmp/fa4/ || exit 1
  ls -la /tmp/fa4; exit 0
fi
if asked fa4-wheels-2; then
  [ -d /tmp/fa4 ] || { echo "fa4-wheels-2: /tmp/fa4 is missing (the machine was given back): start again with fa4-wheels-1"; exit 1; }
  cp .fa4/b/* /tmp/fa4/ || exit 1
  for sum in /tmp/fa4/*.whl.sha256; do
    whl=${sum%.sha256}
    cat "$whl".part0 "$whl".part1 > "$whl" && rm "$whl".part0 "$whl".part1 || exit 1
    [ "$(sha256sum "$whl" | awk '{print $1}')" = "$(cat "$sum")" ] || { echo "fa4-wheels-2: $whl does not match its checksum"; exit 1; }
    echo "rejoined $(basename "$whl")"
  done
  exit 0
fi
if asked fa4-install || asked fa4-tests || asked fa4-kit || asked fa4-check || asked fa4-engine || asked fa4-bench; then
  if asked fa4-install; then
    ls /tmp/fa4/nvidia_cutlass_dsl_libs_cu13-*.whl >/dev/null 2>&1 || { echo "fa4-install: /tmp/fa4 lacks the rejoined wheel: run fa4-wheels-1 and -2 first"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/fa4/*.whl .fa4/c/*.whl || exit 1
    python3 -m pip install -q --no-deps --no-build-isolation -e core -e plugins/triton_backend -e plugins/flashattention || exit 1
  fi
  case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;; esac
  export PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages  # what the wheel's .pth file would add
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-kernels  # compiled kernels kept between calls
  python3 -c "import flash_attn.cute as f, importlib.metadata as m; print('flash-attn-4', m.version('flash-attn-4'), f.flash_attn_varlen_func.__name__)" || exit 1
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
rc=0
# `tests` = tests-core tests-triton tests-fi check sparse-kit-ds sparse-kit-dc sparse-tests; the parts fit one 600 s device call each
if want tests || want tests-core; then
  python3 -m pytest -q -p no:cacheprovider -m gpu core/tests tests 2>&1 | tee "$OUT/pytest_gpu_core.log" || rc=1
fi
if want tests || want tests-triton; then
  python3 -m pytest -q -p no:cacheprovider -m gpu plugins/triton_backend/tests --ignore=plugins/triton_backend/tests/test_triton_ragged_gpu.py \
    2>&1 | tee "$OUT/pytest_gpu_triton.log" || rc=1  # (the ragged / non-causal suite: part vision-triton)
fi
if want tests || want tests-fi; then
  python3 -m pytest -q -p no:cacheprovider -m gpu plugins/flashinfer_backend/tests plugins/trtllm_mla/tests \
    --ignore=plugins/flashinfer_backend/tests/test_ragged_gpu.py 2>&1 | tee "$OUT/pytest_gpu_fi.log" || rc=1  # (part vision-fi)
fi
if want tests || want check; then
  for b in torch_native triton; do
    python3 -m attn_core.cli.main check "$b" --device cuda --quick --isolate --jobs "${CHECK_JOBS:-6}" --per-process "${CHECK_PER_PROCESS:-8}" 2>&1 | tee "$OUT/check_$b.log" || rc=1
  done
fi
if want engine; then  # the example engine (examples/hf_llama.py) vs transformers' generate, and its tokens/s (needs transformers wheels in .whl/)
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_example_engine.py 2>&1 | tee "$OUT/engine_gpu.log" || rc=1
  for args in "triton --attn-dtype float32" "triton --attn-dtype float32 --graphs" "flashinfer --attn-dtype float16" "flashinfer --attn-dtype float16 --graphs"; do
    python3 examples/hf_llama.py --device cuda --backend $args 2>&1 | tee -a "$OUT/engine_tps.log" || rc=1
  done
fi
if want engine-kv; then  # engine-owned KV memory on cuda (vLLM's cache layouts, hand-built engine steps): triton and flashinfer, then attn-triton on vLLM-layout caches vs its own pool
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_engine_kv_gpu.py 2>&1 | tee "$OUT/engine_kv_gpu.log" || rc=1
  python3 benchmarks/engine_kv_layout.py --out "$OUT/engine_kv_layout.json" 2>&1 | tee "$OUT/engine_kv_layout.log" || rc=1
fi
if want multi-gpu; then  # needs 2 GPUs (nvidia-h200-x2): DCP decode attention (eager and in CUDA graphs with NCCL captured), the TP=2 and DCP=2 example engine over NCCL
  python3 -m pytest -q -p no:cacheprovider -m gpu core/tests/test_dcp_distributed.py tests/test_engine_parallel.py 2>&1 | tee "$OUT/multi_gpu.log" || rc=1
  for mode in --tp --dcp "--dcp --graphs"; do
    python3 -m torch.distributed.run --nproc-per-node 2 examples/hf_llama.py $mode --device cuda --backend triton 2>&1 | tee -a "$OUT/multi_gpu.log" || rc=1
  done
  for b in triton flashinfer; do  # DCP=2 decode step vs one GPU (bs64 x 32768), collectives' share, KV tokens per GPU
    python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/dcp_decode.py --device cuda --backend $b --json "$OUT/dcp_decode_$b.json" \
      2>&1 | tee -a "$OUT/multi_gpu.log" || rc=1
  done
fi
if want hostile; then  # issue 36: the hostile section at the default validation on cuda (torch_native, triton, flashinfer), a fault one step late with the context usable, no sync
  python3 -m pytest -q -p no:cacheprovider -m gpu core/tests/test_safe_default_gpu.py 2>&1 | tee "$OUT/hostile_gpu.log" || rc=1
fi
if want hostile-memcheck; then  # issue 36: the device-side hostile cases under compute-sanitizer memcheck (no error may be reported)
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -1)
  if [ -z "$sanitizer" ]; then
    echo "hostile-memcheck: compute-sanitizer not found on this machine (CUDA toolkit not installed): NOT RUN" | tee "$OUT/hostile_memcheck.log"; rc=1
  else
    export ATTN_HOSTILE_SELECT=${HOSTILE_SELECT:-hostile-basic-row_,hostile-basic-slot_,hostile-basic-table_slot,hostile-basic-key_never,hostile-basic-seq_lens_device,hostile-basic-extend_device,hostile-basic-extend_start,hostile-basic-extend_row,hostile-basic-extend_last,hostile-basic-verify_mask_indptr,hostile-graph_run,hostile-draft}
    "$sanitizer" --tool memcheck --error-exitcode 9 --print-limit 20 python3 -m pytest -q -p no:cacheprovider -m gpu core/tests/test_safe_default_gpu.py \
      -k "hostile_section and (triton or flashinfer)" 2>&1 | tee "$OUT/hostile_memcheck.log" || rc=1
    unset ATTN_HOSTILE_SELECT
  fi
fi
if want host-ab; then  # issue 36: host time per step, this tree against $BASE_SRC (default scratch/base) in one process (benchmarks/step_host_ab.py)
  base=${BASE_SRC:-scratch/base}
  python3 benchmarks/step_host_ab.py --baseline-src "$base/core/src:$base/plugins/triton_backend/src" --device cuda \
    --samples "${AB_SAMPLES:-300}" --json "$OUT/step_host_ab.json" 2>&1 | tee "$OUT/step_host_ab.log" || rc=1
fi
if want masked; then  # issue 36: the K/V write's clean of non-finite values (one Triton launch), the kit's masked-values checks on cuda for every backend whatever it declares, the Hopper kernel's default
  python3 -m pytest -q -p no:cacheprovider -m gpu core/tests/test_kv_write_clean.py tests/test_masked_values_gpu.py \
    plugins/triton_backend/tests/test_triton_gpu.py -k "write or masked_value or masked_values" -s 2>&1 | tee "$OUT/masked_gpu.log" || rc=1
fi
if want kv-write-bench; then  # issue 36: the write's cost against the two scatters it replaced (GPU and host µs)
  python3 benchmarks/kv_write.py --json "$OUT/kv_write.json" 2>&1 | tee "$OUT/kv_write.log" || rc=1
fi
if want hopper-clean; then  # issues 36/37: the Hopper extend kernel's producer cleaning masked tiles (wgmma_clean_masked): tests, then its cost
  python3 -m pytest -q -p no:cacheprovider -m gpu plugins/triton_backend/tests/test_triton_gpu.py -k clean 2>&1 | tee "$OUT/hopper_clean_tests.log" || rc=1
  python3 benchmarks/triton_vs_peers.py --only extend --no-torch-native --reps 20 --out "$OUT/hopper_clean_speed.json" \
    --extend-configs "128,64,4,3,4,128,3,208;128,64,4,3,4,128,3,208,1" 2>&1 | tee "$OUT/hopper_clean_speed.log" || rc=1
fi
if want hostile-bench; then  # issue 36: host time per decode step (32 layers, bs 1 and 256, eager and CUDA graphs) before/after; base tree in $BASE_SRC (default scratch/base)
  base=${BASE_SRC:-scratch/base}
  args=(--steps --device cuda --no-layer-rows --json "$OUT/forward_host_cost_steps.json" --profile "$OUT/forward_host_cost_profile.txt")
  if [ -d "$base/core/src" ]; then args+=(--baseline-src "$base/core/src:$base/plugins/triton_backend/src" --rounds "${ROUNDS:-3}" --step-runs "${STEP_RUNS:-100}"); fi
  python3 benchmarks/forward_host_cost.py "${args[@]}" 2>&1 | tee "$OUT/forward_host_cost_steps.log" || rc=1
fi
# issue 39: attn-flashinfer with each supported FlashInfer release. Without FI_SITE: the one set up above (0.6.6 from
# .whl/); with FI_SITE=/tmp/site07 (scripts/gpu_fi07_wheels.sh): 0.7.2.post1 ahead of it. Logs are named by the
# version. fi-kit: the kit on cuda for both backends; fi-tests: attn-flashinfer's GPU tests (lean against public
# plans, graphs); fi-speed: the speed rows (our forward and metadata against FlashInfer's own calls).
if [ -n "${FI_SITE:-}" ] && { want fi-kit || want fi-tests || want fi-speed; }; then
  [ -d "$FI_SITE" ] || { echo "FI_SITE=$FI_SITE missing (scripts/gpu_fi07_wheels.sh)"; exit 1; }
  export PYTHONPATH=$FI_SITE${PYTHONPATH:+:$PYTHONPATH}
fi
if want fi-kit || want fi-tests || want fi-speed; then
  fiv=$(python3 -c "import flashinfer; print(flashinfer.__version__)" 2>/dev/null || echo none)
  echo "flashinfer-python $fiv" | tee -a "$OUT/device.txt"
fi
if want fi-kit; then
  for b in flashinfer flashinfer_mla; do
    python3 -m attn_core.cli.main check "$b" --device cuda --quick --isolate --jobs "${CHECK_JOBS:-6}" --per-process "${CHECK_PER_PROCESS:-8}" 2>&1 | tee "$OUT/fi_${fiv}_check_$b.log" || rc=1
  done
fi
if want fi-tests; then
  python3 -m pytest -q -p no:cacheprovider -m gpu plugins/flashinfer_backend/tests --ignore=plugins/flashinfer_backend/tests/test_ragged_gpu.py \
    2>&1 | tee "$OUT/fi_${fiv}_pytest_gpu.log" || rc=1
fi
if want fi-speed; then
  python3 benchmarks/flashinfer_overhead.py --rounds 8 --json "$OUT/fi_${fiv}_overhead.json" 2>&1 | tee "$OUT/fi_${fiv}_overhead.log" || rc=1
fi
if want fi-window; then  # issue 18: attn-flashinfer's sliding-window KV pool and chunked local attention (kit checks + two-step cases), unverified until this passes
  python3 -m pytest -q -p no:cacheprovider -m gpu plugins/flashinfer_backend/tests/test_gpu.py -k "window_pool or chunked_local" 2>&1 | tee "$OUT/fi_window_local.log" || rc=1
fi
if want mla; then  # issue 15: the MLA kernel at 512 + 64 x 128 heads (oracle, torch_native, graphs) and its ratios to FlashInfer's MLA run
  python3 -m pytest -q -p no:cacheprovider -m gpu plugins/triton_backend/tests/test_triton_gpu.py -k "mla" 2>&1 | tee "$OUT/mla_gpu.log" || rc=1
  python3 benchmarks/mla_vs_peers.py --no-prefill --mla-tiles "${MLA_TILES:-32x64x8x2:c1,64x32x8x2,32x64x4x3:c2}" --json "$OUT/mla_vs_peers_triton.json" 2>&1 | tee "$OUT/mla_vs_peers_triton.log" || rc=1
fi
if want bench || want triton-bench; then
  # FP8_CONFIGS: fp8 decode tiles timed next to the default in the fp8 row (issue 16; "" for none; the default list:
  # the former default tile, and 32-key tiles with 1 warp and 4 stages, the fastest of the 32-key sweeps).
  # EXTEND_CONFIGS: the extend rows' tiles (each row reports the fastest, the sweep lists each): the SM90 default (the
  # Hopper kernel, kernels/extend_wgmma.py, 128-key tiles in 3 buffers, its consumers at 208 registers a thread:
  # ExtendConfig.wgmma_regs), the same at 224 (the former default) and the portable kernel alone
  python3 benchmarks/triton_vs_peers.py --reps 20 --no-torch-native --only "${BENCH_ONLY:-decode,extend,verify,mixed,meta,fp8}" \
    --fp8-configs "${FP8_CONFIGS-64,16,4,2;32,16,1,4}" \
    --extend-configs "${EXTEND_CONFIGS-128,64,4,3,4,128,3,208;128,64,4,3,4,128,3,224;128,64,4,3,4}" --out "$OUT/triton_vs_peers.json" 2>&1 | tee "$OUT/triton_vs_peers.log" || rc=1
elif want verify-bench; then  # issue 15: MHA verify rows only (attn-triton verify / extend kernel / FlashInfer prefill, copy bandwidth)
  python3 benchmarks/triton_vs_peers.py --reps 20 --no-torch-native --only verify --out "$OUT/triton_verify.json" 2>&1 | tee "$OUT/triton_verify.log" || rc=1
fi
if want bench || want fi-bench; then
  python3 benchmarks/flashinfer_overhead.py --rounds 8 --json "$OUT/flashinfer_overhead.json" 2>&1 | tee "$OUT/flashinfer_overhead.log" || rc=1
fi
if want bench || want mla-bench; then
  python3 benchmarks/mla_vs_peers.py --json "$OUT/mla_vs_peers.json" 2>&1 | tee "$OUT/mla_vs_peers.log" || rc=1
fi
if want vendors; then  # issue 43: backends for hardware the lent machines lack (aiter / wave: AMD; trtllm_mha / cutlass_mla:
  # Blackwell). On an H100 / H200: their probes' reasons (attn-core list), the FlashInfer signatures accept trtllm_mha's
  # packed arguments, every AMD / Blackwell test skips with its reason (-rs). On the hardware itself: kernels vs stand-ins, kit.
  python3 -m pip install -q --no-deps --no-build-isolation -e plugins/aiter -e plugins/wave || rc=1
  python3 -m attn_core.cli.main list 2>&1 | tee "$OUT/vendors_list.log" || rc=1
  python3 -m pytest -q -rs -p no:cacheprovider -m gpu plugins/trtllm_mla/tests/test_blackwell_gpu.py plugins/aiter/tests/test_gpu.py \
    plugins/wave/tests/test_gpu.py 2>&1 | tee "$OUT/vendors_gpu.log" || rc=1
fi
# issue 40 (vision = vision-triton vision-fi vision-hf, each within one 600 s call): the kit's non-causal / span / ragged
# checks on cuda and the vision-tower shape (16 heads x 4 images of 1024-4096 patches) for triton and flashinfer, and the
# HF towers (SigLIP over packed images, an encoder-only BERT over the paged path; transformers wheels in .whl/)
if want vision || want vision-triton; then
  python3 -m pytest -q -p no:cacheprovider -m gpu plugins/triton_backend/tests/test_triton_ragged_gpu.py 2>&1 | tee "$OUT/vision_triton.log" || rc=1
fi
if want vision || want vision-fi; then
  python3 -m pytest -q -p no:cacheprovider -m gpu plugins/flashinfer_backend/tests/test_ragged_gpu.py 2>&1 | tee "$OUT/vision_fi.log" || rc=1
fi
if want vision || want vision-hf; then
  python3 -m pytest -q -p no:cacheprovider tests/test_hf_vision_encoder.py 2>&1 | tee "$OUT/vision_hf.log" || rc=1
fi
if want bench || want vision-bench; then  # issue 40: the ragged op, 16 heads x d80 x 4 images, attn-triton (tile sweep) vs FlashInfer / FA4 (RAGGED_DIMS: head dims; RAGGED_FI: FlashInfer kernels)
  python3 benchmarks/ragged_vs_peers.py --head-dims "${RAGGED_DIMS:-80}" --flashinfer-backends "${RAGGED_FI:-fa2,fa3}" \
    --json "$OUT/ragged_vs_peers.json" 2>&1 | tee "$OUT/ragged_vs_peers.log" || rc=1
fi
if want bench || want cascade-bench; then
  python3 benchmarks/cascade_attention.py --backend triton --out "$OUT/cascade_attention.json" 2>&1 | tee "$OUT/cascade_attention.log" || rc=1
fi
if want tests || want sparse-kit || want sparse-kit-ds; then  # issue 41: attn-core's kit on cuda, double_sparsity (dense regime)
  python3 -m pytest -q -p no:cacheprovider -m gpu plugins/sparse/tests/test_gpu_kit.py -k DoubleSparsity 2>&1 | tee "$OUT/sparse_kit_ds.log" || rc=1
fi
if want tests || want sparse-kit || want sparse-kit-dc; then  # issue 41: attn-core's kit on cuda, dual_chunk (dense regime)
  python3 -m pytest -q -p no:cacheprovider -m gpu plugins/sparse/tests/test_gpu_kit.py -k DualChunk 2>&1 | tee "$OUT/sparse_kit_dc.log" || rc=1
fi
if want tests || want sparse-tests; then  # issue 41: both backends' sparse regimes on cuda (bf16/fp16, real CUDA graphs) against float64
  python3 -m pytest -q -p no:cacheprovider -m gpu plugins/sparse/tests/test_gpu.py 2>&1 | tee "$OUT/sparse_gpu.log" || rc=1
fi
if want bench || want sparse-bench; then  # issue 41: double sparsity decode at 32k (heavy 1024) and dual chunk decode / prefill vs dense attn-triton
  python3 benchmarks/sparse_attention.py --json "$OUT/sparse_attention.json" 2>&1 | tee "$OUT/sparse_attention.log" || rc=1
fi
# FlashAttention-4 (issue 38). fa4-tests: the plugin's GPU tests but its kit (random batches over two steps, CUDA graphs
# with tree masks and windows equal to eager, no host sync inside forward, the CPU emulation against FA4 itself);
# fa4-kit: the kit's quick plan as pytest; fa4-check: the kit's whole plan (FA4_CHECK_ARGS, e.g. "-k graph", narrows it);
# fa4-engine: the example engine on fa4 and on the selected hybrid (prefill fa4, decode triton) against generate, and its
# tokens/s (needs transformers from .whl/); fa4-bench: the prefill/extend rows with fa4 through attn, FA4 called directly
# and the hybrid (benchmarks/triton_vs_peers.py --only fa4).
if asked fa4-tests; then
  python3 -m pytest -q -p no:cacheprovider -m gpu plugins/flashattention/tests -k "not TestConformanceOnCuda and not engine" 2>&1 | tee "$OUT/fa4_gpu.log" || rc=1
fi
if asked fa4-kit; then
  python3 -m pytest -q -p no:cacheprovider -m gpu plugins/flashattention/tests/test_gpu.py -k TestConformanceOnCuda 2>&1 | tee "$OUT/fa4_kit.log" || rc=1
fi
if asked fa4-check; then
  python3 -m attn_core.cli.main check fa4 --device cuda ${FA4_CHECK_ARGS:-} 2>&1 | tee "$OUT/check_fa4.log" || rc=1
fi
if asked fa4-engine; then
  python3 -m pytest -q -p no:cacheprovider -m gpu plugins/flashattention/tests/test_gpu_engine.py 2>&1 | tee "$OUT/fa4_engine.log" || rc=1
  for b in fa4 "hybrid(prefill=fa4,decode=triton)"; do  # tokens/s in float16 (equality with generate: the float32 tests above;
    # in float16 a few greedy tokens of the random tiny model flip at near ties: 3 of 16 requests on 2026-11-29)
    python3 examples/hf_llama.py --device cuda --backend "$b" --attn-dtype float16 2>&1 | tee -a "$OUT/fa4_engine_tps.log" || rc=1
  done
fi
if asked fa4-bench; then
  python3 benchmarks/triton_vs_peers.py --reps 20 --no-torch-native --only fa4 --out "$OUT/fa4_vs_peers.json" 2>&1 | tee "$OUT/fa4_vs_peers.log" || rc=1
fi
exit $rc
