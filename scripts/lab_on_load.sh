#!/usr/bin/env bash
# One device call: the GPU tests named in TESTS, then the layer bench at decode sizes with
# GEMM2's a2 quantization on load by the default rule (auto), never (FUSEDMOE_QUANT_ON_LOAD=0),
# forced up to QUANT_WIDE pairs (if set), and the tree in .out/old/src if there (A/B against the
# last commit: `git archive HEAD src | tar -x -C .out/old`, carried). Results under $OUT.
set -uo pipefail
OUT=${OUT:-./.out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
PRESETS=${PRESETS:-qwen3-30b-a3b,deepseek-v3,mixtral-8x7b,gpt-oss-20b}
TOKENS=${TOKENS:-1,2,8}
SCHEMES=${SCHEMES:-fp8_tensor,fp8_block}
if [ -n "${TESTS:-}" ]; then
  timeout -s INT -k 20 "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -o addopts="" $TESTS \
    -n "${GPU_WORKERS:-8}" --dist loadfile -rfE 2>&1 | tail -40 > "$OUT/tests.log"
  tail -15 "$OUT/tests.log"
fi
bench() {  # name, env assignment, extra args
  env $2 timeout 200 python3 -m fusedmoe.cli bench --providers fusedmoe --preset "$PRESETS" --scheme "$SCHEMES" \
    --tokens "$TOKENS" $3 --out "$OUT/$1" 2>&1 | tail -3
}
RUNS="auto off"
bench auto FUSEDMOE_QUANT_ON_LOAD=auto ""
bench off FUSEDMOE_QUANT_ON_LOAD=0 --no-parts
if [ -n "${QUANT_WIDE:-}" ]; then bench wide FUSEDMOE_QUANT_ON_LOAD=$QUANT_WIDE --no-parts; RUNS="$RUNS wide"; fi
if [ -d .out/old/src ]; then bench old PYTHONPATH=.out/old/src --no-parts; RUNS="$RUNS old"; fi  # the tree before (A/B)
for r in $RUNS; do
  grep -E "\| graph \|" "$OUT/$r/bench.md" | awk -F'|' -v r=$r '{printf "%s %s %s T=%s %s\n", r, $2, $3, $4, $7}'
done
grep "launches" "$OUT/auto/bench.md" | grep -E "T=1:" | cut -c1-200
rm -f "$OUT"/*/bench.png  # the device returns 8 files at most: the tables, not the plots
