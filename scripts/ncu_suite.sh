#!/usr/bin/env bash
# Nsight Compute on one layer call per case, in one device call (a Firecracker machine: ncu reads
# the hardware counters there; the device README's METHOD.md says to leave the clocks alone):
#   CASES="mixtral-8x7b:mxfp4:16 deepseek-v3:fp8_block:4096" KERNELS='w4|persistent' bash scripts/ncu_suite.sh
# Per case, the kernels whose names match KERNELS (a regex; all by default) of the call that
# scripts/profile_kernels.py runs between cudaProfilerStart/Stop: speed of light, occupancy,
# warp states (why warps did not issue), scheduler and memory sections, and the source counters
# (stall samples per SASS instruction). Writes under $OUT: the report's details page, the stall
# reasons per kernel (scripts/ncu_stalls.py) and, where ncu has it, the hottest SASS lines.
set -uo pipefail
OUT=${OUT:-./.out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 2; }
"$NCU" --version | tail -1
ARGS=""
for c in ${CASES:?CASES="preset:scheme:T ..."}; do ARGS="$ARGS --case $c"; done
SECTIONS="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
--section LaunchStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters"
timeout "${NCU_TIMEOUT:-480}" "$NCU" --clock-control none --profile-from-start off --target-processes all \
  $SECTIONS --import-source no -k "regex:${KERNELS:-.}" -f -o "$OUT/prof" \
  python3 scripts/profile_kernels.py $ARGS 2>&1 | grep -v "^==PROF==" | tail -20
"$NCU" --import "$OUT/prof.ncu-rep" --page details > "$OUT/details.txt" 2>&1
"$NCU" --import "$OUT/prof.ncu-rep" --page raw --csv > "$OUT/raw.csv" 2>&1
python3 scripts/ncu_stalls.py "$OUT/raw.csv" | tee "$OUT/stalls.md"
# the hottest SASS lines of each profiled kernel, where this ncu prints the source page
"$NCU" --import "$OUT/prof.ncu-rep" --page source --csv --print-source sass > "$OUT/source.csv" 2> "$OUT/source.err" \
  && python3 scripts/ncu_stalls.py --source "$OUT/source.csv" > "$OUT/hot_sass.md" 2>&1
rm -f "$OUT/raw.csv" "$OUT/source.csv"  # large; the summaries above are what comes back
gzip -f "$OUT/prof.ncu-rep"
ls -la "$OUT"
