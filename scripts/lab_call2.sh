#!/usr/bin/env bash
# One device call: GPU checks of the 4-bit and persistent paths, the host profile, a focused layer bench.
set -uo pipefail
OUT=${OUT:-./.out}; mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
SECONDS=0
timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" -x -n 3 \
  tests/experts/test_triton_w4.py tests/kernels/test_kernels_gemm_w4.py tests/kernels/test_launch_intercept.py \
  tests/kernels/test_kernels_gemm_persistent.py -m "gpu or not gpu" 2>&1 | tee "$OUT/call2_tests.log" | tail -12
echo "tests ${SECONDS}s"
timeout 90 python3 scripts/profile_host.py --preset qwen3-30b-a3b --scheme bf16 --tokens 1 --calls 500 --top 25 --out "$OUT" 2>&1 | head -45
echo "host ${SECONDS}s"
timeout 300 python3 -m fusedmoe.cli bench --preset qwen3-30b-a3b,mixtral-8x7b --scheme int4_g128,mxfp4,bf16,fp8_tensor \
  --tokens 1,16,256,4096 --providers fusedmoe --no-parts --out "$OUT" 2>&1 | tail -60
echo "total ${SECONDS}s"
