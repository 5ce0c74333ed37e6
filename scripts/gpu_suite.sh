#!/usr/bin/env bash
# Everything that needs a GPU, in one call on the device machine:
#   bash scripts/gpu_suite.sh            (results under $OUT, or ./.out)
# 1. the gpu-marked tests of every file (kernels at real shapes, the layer per scheme, graphs,
#    determinism, memory, compile, fuzzing, the bench's PyTorch provider);
# 2. the layer benchmark against PyTorch grouped GEMM and the measured roofline.
set -uo pipefail
OUT=${OUT:-./.out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv >> "$OUT/env.txt" 2>&1
SECONDS=0
# every file with gpu-marked tests; GPU_WORKERS processes share the GPU, a file each (compiles are
# CPU-bound; 3 workers ran an H100 out of memory). The whole set takes more than one 10-minute
# device call: split it with GPU_TESTS="tests/kernels/test_a.py ..."
ALL_GPU_TESTS=$(grep -rl "mark.gpu" tests --include="test_*.py" | sort | tr '\n' ' ')
python3 -m pytest -q -p no:cacheprovider -m gpu ${GPU_TESTS:-$ALL_GPU_TESTS} -n "${GPU_WORKERS:-2}" --dist loadfile \
  -o addopts="" -rs --timeout 1200 -s 2>&1 | tee "$OUT/gpu_tests.log" | grep -v "^MAXERR" | tail -40
grep "^MAXERR" "$OUT/gpu_tests.log" || true
# how many fuzz examples ran, per backend (one file per xdist worker)
for f in "${TMPDIR:-/tmp}"/fusedmoe_fuzz_counts*.json; do [ -f "$f" ] && { echo "$f"; cat "$f"; echo; }; done > "$OUT/fuzz_counts.txt"
echo "gpu tests: ${SECONDS}s"
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  python3 -m fusedmoe.cli bench --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -80
fi
echo "total: ${SECONDS}s"
