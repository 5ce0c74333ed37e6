#!/usr/bin/env bash
# Kernel experiments on the device machine, in one call: the new kernels' GPU tests, their
# variant benchmarks, and the host-time profile of eager calls. Results under $OUT (or ./.out).
#
#   STEPS="tests prefill w4 host" bash scripts/kernel_lab.sh
#
# steps: tests    gpu-marked tests of the new kernel files (TESTS="..." to choose)
#        prefill  scripts/kbench_prefill.py (PREFILL_ARGS, default --quick)
#        w4       scripts/kbench_w4.py (W4_ARGS, default --quick)
#        host     scripts/profile_host.py at T=1 for bf16 and fp8 (HOST_PRESETS, HOST_SCHEMES)
#        bench    the layer bench, fusedmoe bench $BENCH_ARGS (results under $OUT/bench)
# Each step is time-boxed (STEP_TIMEOUT seconds, default 240) so one hang leaves the others.
set -uo pipefail
OUT=${OUT:-./.out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
STEPS=${STEPS:-"tests prefill host"}
TO=${STEP_TIMEOUT:-240}  # per step; STEP_TIMEOUT_<STEP> (e.g. STEP_TIMEOUT_W4) overrides it for one
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
SECONDS=0
for step in $STEPS; do
  echo "=== $step (t=${SECONDS}s)"
  var="STEP_TIMEOUT_${step^^}"
  TO=${!var:-${STEP_TIMEOUT:-240}}
  case $step in
    tests)
      timeout "$TO" python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/kernels/test_kernels_gemm_persistent.py} \
        -n "${GPU_WORKERS:-2}" -o addopts="" -rs 2>&1 | tee "$OUT/lab_tests.log" | tail -15 ;;
    prefill)
      timeout "$TO" python3 scripts/kbench_prefill.py ${PREFILL_ARGS:---quick} --out "$OUT" 2>&1 | tail -40 ;;
    w4)
      timeout "$TO" python3 scripts/kbench_w4.py ${W4_ARGS:---quick} --out "$OUT" 2>&1 | tail -40 ;;
    host)
      for p in ${HOST_PRESETS:-qwen3-30b-a3b}; do
        for s in ${HOST_SCHEMES:-bf16 fp8_tensor}; do
          timeout "$TO" python3 scripts/profile_host.py --preset "$p" --scheme "$s" --tokens 1 --calls 500 --top 30 \
            --out "$OUT" 2>&1 | head -60
        done
      done ;;
    bench)
      timeout "$TO" python3 -m fusedmoe.cli bench ${BENCH_ARGS:-} --out "$OUT/bench" 2>&1 | tail -60 ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "kernel_lab total: ${SECONDS}s"
