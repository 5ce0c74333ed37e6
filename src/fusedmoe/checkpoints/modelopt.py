"""NVIDIA ModelOpt checkpoints: ``"quant_method": "modelopt"`` with FP8 or NVFP4.

quantization_config in config.json ({"quant_method": "modelopt", "quant_algo": "NVFP4",
"group_size": 16, "ignore": [...]}) or, from older exports, hf_quant_config.json
({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": ..., "group_size": 16,
"exclude_modules": [...]}}). Both are read as vLLM's ``ModelOptQuantConfigBase.from_config``
does (vllm/model_executor/layers/quantization/modelopt.py, checked).

FP8 (``quant_algo`` "FP8"): per-tensor weights, static per-tensor activations::

    weight float8_e4m3fn [N, K], weight_scale fp32 scalar, input_scale fp32 scalar

FP8_PER_CHANNEL_PER_TOKEN: weight_scale fp32 [N] (or [N, 1]), dynamic per-token activations.

NVFP4 (``quant_algo`` "NVFP4"; "W4A16_NVFP4" for weight-only)::

    weight          uint8 [N, K/2]           two e2m1 codes per byte, the even column in the low nibble
    weight_scale    float8_e4m3fn [N, K/16]  block scales
    weight_scale_2  fp32 scalar              global scale = amax / (448 * 6): a dequantization multiplier
    input_scale     fp32 scalar              activation global scale, amax / (448 * 6), same convention

x ~= e2m1(code) * weight_scale * weight_scale_2. vLLM: "ModelOpt stores amax / (NVFP4_max
* fp8_e4m3_max) = amax / 2688" and uses it with no reciprocal; its NVFP4 embedding
dequantizes ``fp4_lut[low nibble first] * weight_scale * weight_scale_2``. vLLM's
MoE takes one input scale per layer (the max over experts) and warns when
w1/w3 ``weight_scale_2`` differ; the layer here requantizes W1/W3 to the larger.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedError, expect
from ..quant import QuantScheme
from .base import CheckpointFormat, CheckpointReader, check_tensor, scalar

_SCHEMES = {
    "FP8": lambda: QuantScheme.fp8_per_tensor(static_activations=True),
    "FP8_PER_CHANNEL_PER_TOKEN": QuantScheme.fp8_per_channel,
    "NVFP4": QuantScheme.nvfp4,
    "W4A16_NVFP4": QuantScheme.nvfp4_w4a16,
}


class ModelOptFormat(CheckpointFormat):
    name = "modelopt"
    quant_methods = ("modelopt", "modelopt_fp4", "modelopt_fp8")

    @classmethod
    def from_config(cls, qc: dict) -> ModelOptFormat:
        inner = qc.get("quantization", qc)
        expect(isinstance(inner, dict), "quantization_config.quantization", "a dict", type(inner))
        algo = str(inner.get("quant_algo", "")).upper()
        if algo not in _SCHEMES:
            raise UnsupportedError(f"quantization_config.quant_algo: expected one of {sorted(_SCHEMES)}, got {algo!r}")
        if algo.endswith("NVFP4"):
            g = inner.get("group_size", 16)
            expect(int(g) == 16, "quantization_config.group_size", "16 for NVFP4", g)
        fmt = cls(_SCHEMES[algo](), qc)
        fmt.algo = algo
        return fmt

    def linear(self, reader: CheckpointReader, path: str) -> dict[str, torch.Tensor]:
        wname, sname = f"{path}.weight", f"{path}.weight_scale"
        w1 = self.scheme.w1
        if self.scheme.family == "fp8":
            w = check_tensor(reader.get(wname), wname, dims=2, dtype=torch.float8_e4m3fn)
            s = reader.get(sname, f"the scale of {wname}")
            if w1.granularity.kind == "channel":
                s = check_tensor(s.reshape(-1), sname, shape=(w.shape[0],)).float().reshape(-1, 1)
            else:
                s = scalar(s, sname)
            out = {"weight": w, "weight_scale": s}
            if not self.scheme.a1.dynamic:
                out["input_scale"] = scalar(reader.get(f"{path}.input_scale", f"the input of {wname}"), "input_scale")
            return out
        w = check_tensor(reader.get(wname), wname, dims=2, dtype=torch.uint8)
        n, k = w.shape[0], 2 * w.shape[1]
        expect(k % 16 == 0, f"checkpoint tensor '{wname}'", "K a multiple of 16 (NVFP4 blocks)", (n, k))
        s = check_tensor(reader.get(sname, f"the block scales of {wname}"), sname, shape=(n, k // 16))
        check_tensor(s, sname, dtype=torch.float8_e4m3fn)
        g2 = f"{path}.weight_scale_2"
        out = {"weight": w, "weight_scale": s, "weight_global_scale": scalar(reader.get(g2, f"{wname}"), g2)}
        if self.scheme.a1 is not None:
            iname = f"{path}.input_scale"
            out["input_global_scale"] = scalar(reader.get(iname, f"the activation global scale of {wname}"), iname)
        return out
