#!/usr/bin/env bash
# GEMM2's a2 quantization on load by the default rule (auto), never (FUSEDMOE_QUANT_ON_LOAD=0)
# and forced up to QUANT_WIDE pairs (if set), through scripts/lab_ab.sh (same variables).
VARIANTS="auto:FUSEDMOE_QUANT_ON_LOAD=auto off:FUSEDMOE_QUANT_ON_LOAD=0"
if [ -n "${QUANT_WIDE:-}" ]; then VARIANTS="$VARIANTS wide:FUSEDMOE_QUANT_ON_LOAD=$QUANT_WIDE"; fi
VARIANTS=$VARIANTS exec bash "$(dirname "$0")/lab_ab.sh"
