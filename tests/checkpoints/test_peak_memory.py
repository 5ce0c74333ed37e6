"""Loading one layer of a checkpoint much larger than the layer reads that layer and nothing else.

A compressed-tensors FP8 checkpoint (llm-compressor's FP8_DYNAMIC layout, config.json of the
``llmc_fp8_dynamic_qwen3`` fixture with larger sizes) of many MoE layers in several shards is
written under the test's tmp folder; a fresh interpreter loads its last layer with ``load_layer``
and reports the growth of its peak resident memory (VmHWM after the load, the peak reset just before
it, minus VmRSS then; a tiny layer of the same format is loaded first, so that the modules a load
imports are not counted). The truth is the byte count of the checkpoint and of the one layer's tensors,
counted from the safetensors headers here, not from the loader.

``FUSEDMOE_PEAK_MEMORY_GB=4 pytest tests/checkpoints/test_peak_memory.py -s`` writes a larger one
(the number in ``load_layer``'s docstring came from such a run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("compressed_tensors")

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "checkpoints", "llmc_fp8_dynamic_qwen3")
HIDDEN, INTER, EXPERTS = 512, 256, 16  # one layer: 16 x 3 x 512 x 256 fp8 = 6 MiB (+ scales)
MB = 1024**2

_MEASURE = r"""
import json, os, sys, time
import torch
from fusedmoe.checkpoints import load_layer

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

load_layer(sys.argv[3], 0)  # a tiny layer of the same format first: the modules a load imports are not its data
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current resident size
    reset = True
except OSError:
    reset = False
before = status("VmRSS")
t0 = time.perf_counter()
moe = load_layer(sys.argv[1], int(sys.argv[2]))
seconds = time.perf_counter() - t0
print(json.dumps({"before": before, "peak": status("VmHWM"), "after": status("VmRSS"), "reset": reset,
                  "seconds": seconds, "scheme": moe.scheme.name, "backend": moe.choice.backend}))
"""


def _fp8(shape, g: torch.Generator) -> torch.Tensor:
    """Random finite e4m3 codes (0x7f / 0xff are NaN): 0..0x7e with a random sign bit."""
    codes = torch.randint(0, 0x7F, shape, generator=g, dtype=torch.uint8)
    codes |= torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7
    return codes.view(torch.float8_e4m3fn)


def write_checkpoint(path: str, layers: int, per_file: int = 8) -> None:
    """An FP8_DYNAMIC Qwen3-MoE checkpoint of ``layers`` MoE layers (experts and routers only),
    ``per_file`` layers a file, with a model.safetensors.index.json as transformers writes one."""
    with open(os.path.join(FIXTURE, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=HIDDEN, moe_intermediate_size=INTER, intermediate_size=2 * INTER, num_experts=EXPERTS,
               num_hidden_layers=layers, num_attention_heads=8, head_dim=128)  # fmt: skip
    cfg["quantization_config"]["ignore"] = [f"model.layers.{L}.mlp.gate" for L in range(layers)] + ["lm_head"]
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    g = torch.Generator().manual_seed(0)
    one = {"mlp.gate.weight": torch.randn(EXPERTS, HIDDEN, generator=g).bfloat16()}  # one layer, copied to all
    for e in range(EXPERTS):
        for proj, (n, k) in (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)),
                             ("down_proj", (HIDDEN, INTER))):  # fmt: skip
            one[f"mlp.experts.{e}.{proj}.weight"] = _fp8((n, k), g)
            one[f"mlp.experts.{e}.{proj}.weight_scale"] = (torch.rand(n, 1, generator=g) * 0.01 + 0.001).bfloat16()
    shards = -(-layers // per_file)
    index = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        st = {}
        for L in range(s * per_file, min(layers, (s + 1) * per_file)):
            st.update({f"model.layers.{L}.{k}": v.clone() for k, v in one.items()})
        safetensors_torch.save_file(st, os.path.join(path, name), metadata={"format": "pt"})
        index.update(dict.fromkeys(st, name))
        del st
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)


def _tensor_bytes(path: str, prefix: str = "") -> int:
    """Bytes of the tensors whose names start with ``prefix``, from the safetensors headers."""
    from safetensors import safe_open

    total = 0
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as h:
                for k in h.keys():
                    if k.startswith(prefix):
                        s = h.get_slice(k)
                        n = 1
                        for d in s.get_shape():
                            n *= d
                        total += n * {"F8_E4M3": 1, "BF16": 2, "F32": 4}[s.get_dtype()]
    return total


def _tensor_count(path: str) -> int:
    from safetensors import safe_open

    total = 0
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as h:
                total += len(h.keys())
    return total


def measure(path: str, layer: int) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    cmd = [sys.executable, "-c", _MEASURE, path, str(layer), FIXTURE]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_one_layer_of_a_large_checkpoint_reads_only_that_layer(tmp_path):
    size_gb = float(os.environ.get("FUSEDMOE_PEAK_MEMORY_GB", "0.25"))
    layer_bytes = EXPERTS * 3 * HIDDEN * INTER  # fp8 experts of one layer
    layers = 8 * max(1, round(size_gb * 1024**3 / layer_bytes / 8))  # full files of 8 layers: the last one too
    path = str(tmp_path / "big")
    write_checkpoint(path, layers)
    total, one = _tensor_bytes(path), _tensor_bytes(path, f"model.layers.{layers - 1}.mlp.experts.")
    r = measure(path, layers - 1)
    grew = r["peak"] - r["before"]
    files = sum(f.endswith(".safetensors") for f in os.listdir(path))
    print(
        f"\n[peak memory] checkpoint {total / MB:.0f} MiB in {layers} layers, {files} files; "
        f"layer {layers - 1}'s experts {one / MB:.1f} MiB; "
        f"load_layer ({r['scheme']}, backend {r['backend']}, {r['seconds']:.1f} s): "
        f"peak RSS {r['peak'] / MB:.0f} MiB, {grew / MB:.1f} MiB above the {r['before'] / MB:.0f} MiB before it "
        f"(peak reset: {r['reset']}); {r['after'] / MB:.0f} MiB after"
    )
    # the layer's own tensors and what the backend makes of them (fp8 codes and a dequantized copy at
    # most) and the index of the checkpoint's tensor names (measured about 0.3 KiB a name), never the
    # rest of the checkpoint
    assert grew < 6 * one + 32 * MB + _tensor_count(path) * 1024, (grew, one)
    assert grew < total / 8, (grew, total)
