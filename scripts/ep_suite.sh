#!/usr/bin/env bash
# Expert parallelism on every GPU of the machine (2 or 4 H200), NCCL through torchrun, in one call:
#   bash scripts/ep_suite.sh            (results under $OUT, or ./.out; 7 files, no folders)
# 1. the gloo CPU tests (tests/dispatch/test_ep.py) under this machine's torch, a check of the 2.11 API paths;
# 2. fusedmoe.ep_check: every EP dispatcher x experts (triton where it runs, reference) x scheme
#    against the float64 reference on every rank, each through every exchange path (sizes exchanged,
#    fixed blocks of a workspace, MoEKernel with and without allocate), config-mismatch,
#    capacity-overflow and token-bound errors;
# 3. fusedmoe.bench_ep: dispatch/combine eager and as CUDA graphs against raw NCCL all_to_all_single
#    of the same bytes (eager and graph) at 1..4096 tokens per rank, the ratio per row and the bar
#    (<= 1.5x at 128 tokens per rank), the layer under EP against one GPU, identity checks under
#    CUDA graphs; DeepSeek-V3 shape (bench_ep_w$NGPU.md / .json).
# Expected: about 5 minutes on 4 GPUs; each step has a timeout, so the whole stays under 10.
# Knobs: NGPU, SKIP_TESTS=1, SKIP_CHECK=1, SKIP_BENCH=1, BENCH_EP_ARGS (e.g. "--tokens 1,128 --iters 10"),
#        TESTS_TIMEOUT (150 s), EP_CHECK_TIMEOUT (180 s), BENCH_EP_TIMEOUT (240 s).
set -uo pipefail
OUT=${OUT:-./.out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
# NVLink multicast stays off on these machines
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
NGPU=${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "nccl", torch.cuda.nccl.version(), torch.cuda.get_device_name())' | tee "$OUT/ep_env.txt"
nvidia-smi topo -m >> "$OUT/ep_env.txt" 2>&1
echo "GPUs: $NGPU" | tee -a "$OUT/ep_env.txt"
status=0
SECONDS=0
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  xdist=$(python3 -c 'import xdist' 2>/dev/null && echo "-n 4" || echo "")
  timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -o addopts="" $xdist tests/dispatch/test_ep.py 2>&1 \
    | tee "$OUT/ep_tests.log" | tail -15
  [ "${PIPESTATUS[0]}" = "0" ] || status=1
  echo "gloo tests: ${SECONDS}s" | tee -a "$OUT/ep_env.txt"
fi
if [ "$NGPU" -lt 2 ]; then
  echo "expert parallelism needs at least 2 GPUs, found $NGPU"
  exit 1
fi
if [ "${SKIP_CHECK:-0}" != "1" ]; then
  timeout "${EP_CHECK_TIMEOUT:-180}" python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
    -m fusedmoe.ep_check --out "$OUT" 2>&1 | tee "$OUT/ep_check.log" | tail -60
  [ "${PIPESTATUS[0]}" = "0" ] || status=1
  echo "ep_check: ${SECONDS}s" | tee -a "$OUT/ep_env.txt"
fi
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  timeout "${BENCH_EP_TIMEOUT:-240}" python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
    -m fusedmoe.bench_ep --out "$OUT" ${BENCH_EP_ARGS:-} 2>&1 | tee "$OUT/bench_ep.log" | grep -v '^{' | tail -80
  [ "${PIPESTATUS[0]}" = "0" ] || status=1
  echo "bench_ep: ${SECONDS}s" | tee -a "$OUT/ep_env.txt"
fi
echo "total: ${SECONDS}s, status $status" | tee -a "$OUT/ep_env.txt"
exit $status
