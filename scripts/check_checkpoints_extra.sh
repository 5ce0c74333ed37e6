#!/usr/bin/env bash
# The `fusedmoe[checkpoints]` extra in a fresh virtual environment: install the package from this
# checkout with that extra only (CPU torch through constraints-ci.txt), then, in that environment,
# load one compressed-tensors fixture written by llm-compressor with fusedmoe.checkpoints and run
# the layer once on the CPU against the float64 reference on the loaded weights; the loaded experts
# are also compared with the tool's own dequantization saved beside the fixture (tool_dequantized/).
# Prints the versions and PASS or FAIL (exit 0 / 1).
#
#   scripts/check_checkpoints_extra.sh [VENV]      (default /tmp/fusedmoe-checkpoints-extra, recreated)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-/tmp/fusedmoe-checkpoints-extra}"
FIXTURE="$ROOT/tests/fixtures/checkpoints/llmc_fp8_dynamic_qwen3"
PYTHON="${PYTHON:-python3}"

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$VENV/bin/pip" install -q "$ROOT[checkpoints]" -c "$ROOT/constraints-ci.txt" >"$VENV/install.log" 2>&1; then
    tail -20 "$VENV/install.log"
    echo "FAIL: pip install '$ROOT[checkpoints]' (log: $VENV/install.log)"
    exit 1
fi

# run from / so that `import fusedmoe` is the installed package, not the checkout's src/
cd /
if TRITON_INTERPRET=1 "$VENV/bin/python" - "$FIXTURE" <<'EOF'; then
import importlib.metadata as md
import sys

import torch
from safetensors.torch import load_file

import fusedmoe
from fusedmoe.checkpoints import load_layer
from fusedmoe.experts.reference import moe_reference
from fusedmoe.testing import rel_error, tolerance

path = sys.argv[1]
print("python", sys.version.split()[0], "| fusedmoe", md.version("fusedmoe"), "from", fusedmoe.__file__)
print(" | ".join(f"{d} {md.version(d)}" for d in ("torch", "triton", "safetensors", "compressed-tensors")))
try:  # not in the extra itself: compressed-tensors depends on it
    print("transformers", md.version("transformers"), "(a dependency of compressed-tensors)")
except md.PackageNotFoundError:
    print("transformers: not installed")
moe = load_layer(path, 0, keep_reference=True)
cfg = moe.config
g = torch.Generator().manual_seed(0)
x = torch.randn(8, cfg.hidden_size, generator=g).to(cfg.dtype)
logits = torch.randn(8, cfg.num_experts, generator=g).to(cfg.dtype)
with torch.no_grad():
    out = moe(x, logits)
topk = moe.router.route(logits, moe.e_score_correction_bias)
ref = moe_reference(x, topk.ids, topk.weights, moe.reference_weights, cfg, moe.compute_scheme, dtype=torch.float64)
err, tol = rel_error(out, ref), tolerance(moe.compute_scheme, cfg.dtype)
print(f"{path}: scheme {moe.scheme.name}, backend {moe.choice.backend}, out {tuple(out.shape)} "
      f"finite {bool(torch.isfinite(out).all())}, rel error vs float64 reference {err:.2e} (tolerance {tol:.0e})")
# the weights against the tool's own dequantization (llm-compressor's environment, saved beside the fixture)
tool = load_file(f"{path}/tool_dequantized/experts.safetensors")
w13, w2 = moe.reference_weights.dequantized(moe.scheme)
werr = max(rel_error(w13, tool["model.layers.0.mlp.experts.gate_up_proj"]),
           rel_error(w2, tool["model.layers.0.mlp.experts.down_proj"]))
print(f"dequantized experts vs the tool's own dequantization: rel error {werr:.2e} (tolerance 4e-03)")
sys.exit(0 if torch.isfinite(out).all() and out.abs().sum() > 0 and err <= tol and werr < 4e-3 else 1)
EOF
    echo "PASS"
else
    echo "FAIL"
    exit 1
fi
