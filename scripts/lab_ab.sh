#!/usr/bin/env bash
# One device call for a kernel change: the GPU tests named in TESTS, then the layer bench at
# TOKENS for PRESETS x SCHEMES once per variant in VARIANTS ("name:ENV=value ...", space
# separated; "new" alone by default; the first run also records the per-kernel parts), and on
# the tree in .out/old/src if it is there (A/B against the last commit:
# `git archive HEAD src | tar -x -C .out/old`, carried). Results under $OUT. The tests spread over
# GPU_WORKERS by test (GPU_DIST=loadgroup): by file, one worker got all of tests/test_gpu_layer.py
# and a 200 s limit cut it at 81% (eleventh session), where by test it takes 33 s.
set -uo pipefail
OUT=${OUT:-./.out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
PRESETS=${PRESETS:-qwen3-30b-a3b,deepseek-v3,mixtral-8x7b,gpt-oss-20b}
TOKENS=${TOKENS:-1,2,8}
SCHEMES=${SCHEMES:-fp8_tensor,fp8_block}
VARIANTS=${VARIANTS:-new:}
# TEST_K: a pytest -k expression (it may hold spaces, which TESTS, split into words, cannot: a
# `-k "mxfp4 or int4"` there selected nothing in the twelfth session)
if [ -n "${TESTS:-}" ]; then
  timeout -s INT -k 20 "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -o addopts="" $TESTS \
    ${TEST_K:+-k "$TEST_K"} -n "${GPU_WORKERS:-8}" --dist "${GPU_DIST:-loadgroup}" -rfE 2>&1 | tail -40 > "$OUT/tests.log"
  tail -15 "$OUT/tests.log"
fi
bench() {  # name, env assignments (comma separated), extra args
  env ${2//,/ } timeout "${BENCH_TIMEOUT:-200}" python3 -m fusedmoe.cli bench --providers fusedmoe \
    --preset "$PRESETS" --scheme "$SCHEMES" --tokens "$TOKENS" $3 --out "$OUT/$1" 2>&1 | tail -3
}
RUNS="" PARTS=""
for v in $VARIANTS; do
  bench "${v%%:*}" "${v#*:}" "$PARTS"
  RUNS="$RUNS ${v%%:*}" PARTS=--no-parts
done
if [ -d .out/old/src ]; then bench old PYTHONPATH=.out/old/src --no-parts; RUNS="$RUNS old"; fi
for r in $RUNS; do
  grep -E "\| graph \|" "$OUT/$r/bench.md" | awk -F'|' -v r=$r '{printf "%s %s %s T=%s %s\n", r, $2, $3, $4, $7}'
done
first=${VARIANTS%% *}
grep "launches" "$OUT/${first%%:*}/bench.md" | grep -E "T=1:" | cut -c1-200
if [ -f "$OUT/old/bench.json" ]; then  # every variant against the old tree: per cell and geometric mean
  python3 scripts/ab_ratios.py "$OUT/old/bench.json" $(for r in $RUNS; do [ "$r" != old ] && echo "$OUT/$r/bench.json"; done)
fi
# the device returns 8 files at most (thirteenth session: two runs of this script in one call lost
# one): the plots go, and the markdown of every run but the first (its JSON has the same cells)
rm -f "$OUT"/*/bench.png
for r in $RUNS; do [ "$r" != "${first%%:*}" ] && rm -f "$OUT/$r/bench.md"; done
true
