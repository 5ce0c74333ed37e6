#!/usr/bin/env bash
# Write tests/fixtures/checkpoints/ with the quantization tools themselves, one virtual environment per
# tool (their pins conflict), each made once under $FIXTURE_VENVS (default /tmp/fusedmoe-fixture-venvs)
# and reused. See scripts/make_checkpoint_fixtures.py for what each writes.
#
#   scripts/make_checkpoint_fixtures.sh                  every step below, in this order
#   scripts/make_checkpoint_fixtures.sh gptqmodel ...    only those steps
#
# steps (environment: what it installs):
#   llmcompressor         llmc: llmcompressor 0.14.0.1 (its pins: transformers 5.17, compressed-tensors 0.19.0)
#   ct-dequantize         ct: compressed-tensors 0.19.0 + transformers 5.17.0 (adds tool_dequantized/ to the
#                         llm-compressor fixtures whose transformers gave none; rewrites no checkpoint)
#   transformers          tf: transformers 5.24.0 + accelerate
#   modelopt              modelopt: nvidia-modelopt 0.47.0 + transformers 5.24.0 (+ requests, which its
#   modelopt-dequantize     export imports without declaring it)
#   autoawq               autoawq: autoawq 0.2.9 without its dependencies (it pins transformers 4) + transformers
#                         5.24.0 + datasets (its quantizer module imports it)
#   gptqmodel             gptqmodel: GPTQModel 7.7.0, which needs torch>=2.14.1 (the CUDA build, from this
#                         machine's local wheels; it quantizes on the CPU here)
# All but gptqmodel use the CPU torch of constraints-ci.txt. A step that fails is reported and the rest run.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENVS="${FIXTURE_VENVS:-/tmp/fusedmoe-fixture-venvs}"
OUT="${FIXTURE_OUT:-$ROOT/tests/fixtures/checkpoints}"
PYTHON="${PYTHON:-python3}"

venv() {  # venv NAME PIP-ARGS...: make $VENVS/NAME once, with the packages; print its python
    local dir="$VENVS/$1"
    shift
    if [ ! -x "$dir/bin/python" ]; then
        "$PYTHON" -m venv "$dir" >&2 || return 1
        "$dir/bin/pip" install -q --upgrade pip >/dev/null 2>&1
        for args in "$@"; do
            # shellcheck disable=SC2086  # each argument is one pip command line
            "$dir/bin/pip" install -q $args >&2 || { rm -rf "$dir"; return 1; }
        done
    fi
    echo "$dir/bin/python"
}

env_for() {
    local c="-c $ROOT/constraints-ci.txt"
    case "$1" in
        llmcompressor) venv llmc "$c torch llmcompressor==0.14.0.1 datasets" ;;
        ct-dequantize) venv ct "$c torch compressed-tensors==0.19.0 transformers==5.17.0" ;;
        transformers) venv tf "$c torch transformers==5.24.0 accelerate tokenizers" ;;
        modelopt | modelopt-dequantize) venv modelopt "$c torch nvidia-modelopt==0.47.0 transformers==5.24.0 requests" ;;
        autoawq) venv autoawq "$c torch transformers==5.24.0 accelerate datasets" "--no-deps autoawq==0.2.9" ;;
        # GPTQModel 7.7 builds with setuptools>=84.2.1,<85, which torch 2.14.1 brings: no build isolation
        gptqmodel) venv gptqmodel "torch==2.14.1" "--no-build-isolation gptqmodel==7.7.0 torch==2.14.1" ;;
        *) echo "unknown step $1" >&2; return 1 ;;
    esac
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(llmcompressor ct-dequantize transformers modelopt modelopt-dequantize autoawq gptqmodel)
mkdir -p "$VENVS"
failed=()
for step in "${steps[@]}"; do
    echo "== $step" >&2
    if ! py="$(env_for "$step")"; then
        failed+=("$step (environment)")
        continue
    fi
    (cd "$ROOT/scripts" && "$py" make_checkpoint_fixtures.py --tool "$step" --out "$OUT") || failed+=("$step")
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "done: ${steps[*]} -> $OUT"
