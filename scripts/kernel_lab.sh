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
#        hf       scripts/hf_generate_bench.py $HF_ARGS (transformers generate; under $OUT/hf)
# PACK=1: everything under $OUT packed into $OUT/lab.tgz at the end (the device returns 8 files at most).
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
      # TEST_FLAGS="-v -v": one line per test as it ends (-q is given: one -v cancels it)
      # SIGINT at the step's timeout: pytest stops and still reports what failed so far
      timeout -s INT -k 30 "$TO" python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/kernels/test_kernels_gemm_persistent.py} \
        -n "${GPU_WORKERS:-2}" --dist loadfile -o addopts="" -rs ${TEST_FLAGS:-} 2>&1 | tee "$OUT/lab_tests.log" \
        | grep -v " PASSED \| SKIPPED " | tail -25
      grep -c " PASSED " "$OUT/lab_tests.log" ;;
    prefill)
      timeout "$TO" python3 scripts/kbench_prefill.py ${PREFILL_ARGS:---quick} --out "$OUT" 2>&1 | tail -40 ;;
    w4)
      timeout "$TO" python3 scripts/kbench_w4.py ${W4_ARGS:---quick} --out "$OUT" 2>&1 | tail -40 ;;
    host)
      for p in ${HOST_PRESETS:-qwen3-30b-a3b}; do
        for s in ${HOST_SCHEMES:-bf16 fp8_tensor}; do
          timeout "$TO" python3 scripts/profile_host.py --preset "$p" --scheme "$s" --tokens 1 --calls 500 --top 30 \
            --out "$OUT" 2>&1 | head -${HOST_LINES:-60}
        done
      done ;;
    bench)
      timeout "$TO" python3 -m fusedmoe.cli bench ${BENCH_ARGS:-} --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -60 ;;
    hf)
      timeout "$TO" python3 scripts/hf_generate_bench.py ${HF_ARGS:-} --out "$OUT/hf" 2>&1 | tail -30 ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "kernel_lab total: ${SECONDS}s"
if [ "${PACK:-0}" = "1" ]; then
  (cd "$OUT" && tar czf /tmp/lab.tgz . && find . -mindepth 1 -delete && mv /tmp/lab.tgz lab.tgz)
fi
