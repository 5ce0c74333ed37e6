#!/usr/bin/env bash
# Tune the grouped-GEMM launch configs we ship, on this GPU, in one device call (~9 minutes):
#   bash scripts/tune_suite.sh            (results under $OUT, or ./.out)
# The four presets x bf16, fp8_tensor, fp8_block at T = 1,16,64,256,1024,4096 first, then the
# extra token counts while the budget lasts. $OUT gets three files:
#   tuned_configs.tgz   <gpu>/<scheme>/E=..,N=..,K=...json (the shipped files merged with this run's
#                       entries): tar xzf it in src/fusedmoe/kernels/configs/
#   tune_summary.md     per file and token count: config, ms, speedup over the heuristic config
#   tune.log            the environment and the tuner's progress
# Knobs (environment): BUDGET_S (the tuner's wall-clock budget, default 480 s), TOKENS,
# EXTRA_TOKENS, PRESETS, SCHEMES, SPACE, WORKERS, TUNE_ARGS (more `fusedmoe tune` options).
# SCHEMES=int4_g128,mxfp4,nvfp4_w4a16 tunes the 4-bit kernel (its tables: <gpu>/int4_g128_w4, mxfp4_g32_w4,
# nvfp4_g16_w4).
# APPLY=1 also unpacks the tables into src/fusedmoe/kernels/configs/ of this tree, so that a
# `bash scripts/lab_ab.sh` later in the same device call benches them against .out/old's.
set -uo pipefail
OUT=${OUT:-./.out}
BUDGET_S=${BUDGET_S:-480}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
WORK=$(mktemp -d)  # the JSON tree stays out of $OUT: only the tarball comes back
# start from the shipped files: a run of some token counts replaces those entries, keeps the rest
mkdir -p "$WORK/configs" && cp -r src/fusedmoe/kernels/configs/. "$WORK/configs/"
LOG="$OUT/tune.log"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' | tee "$LOG"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >> "$LOG" 2>&1
echo "cpus $(nproc)" | tee -a "$LOG"
SECONDS=0
# SIGINT after the budget plus a margin: the tuner writes what finished and its summary; then KILL.
timeout -s INT -k 20 $((BUDGET_S + 40)) python3 -m fusedmoe.cli tune \
  --preset "${PRESETS:-all}" --scheme "${SCHEMES:-bf16,fp8_tensor,fp8_block}" \
  --tokens "${TOKENS:-1,16,64,256,1024,4096}" --extra-tokens "${EXTRA_TOKENS-8,32,128,512,2048}" \
  --space "${SPACE:-quick}" --budget-s "$BUDGET_S" ${WORKERS:+--workers "$WORKERS"} \
  --out "$WORK/configs" --summary "$OUT/tune_summary.md" ${TUNE_ARGS:-} >> "$LOG" 2>&1
rc=$?
echo "fusedmoe tune: exit $rc after ${SECONDS}s" | tee -a "$LOG"
mkdir -p "$WORK/configs"
tar czf "$OUT/tuned_configs.tgz" -C "$WORK/configs" .
echo "$(tar tzf "$OUT/tuned_configs.tgz" | grep -c '\.json$') files in $OUT/tuned_configs.tgz" | tee -a "$LOG"
if [ "${APPLY:-0}" = 1 ]; then
  tar xzf "$OUT/tuned_configs.tgz" -C src/fusedmoe/kernels/configs/ && echo "applied to src/fusedmoe/kernels/configs/" | tee -a "$LOG"
fi
grep -E "^\[|^# |stopped|Not tuned" "$LOG" | grep -vE "rejected|did not compile" | tail -30
[ -f "$OUT/tune_summary.md" ] && head -c 6000 "$OUT/tune_summary.md"
exit $rc
