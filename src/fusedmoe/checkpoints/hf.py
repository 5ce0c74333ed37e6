"""Checkpoints in the model dtype (no ``quantization_config``), and FP8 online quantization.

Hugging Face ``save_pretrained`` writes each expert as its own Linear even in
transformers 5.x, whose modules fuse them (checked by saving tiny Mixtral,
Qwen2/3-MoE, OLMoE and DeepSeek-V3 models with transformers 5.23)::

    {block}.experts.{e}.gate_proj.weight [I, H]   (Mixtral: w1)
    {block}.experts.{e}.up_proj.weight   [I, H]   (Mixtral: w3)
    {block}.experts.{e}.down_proj.weight [H, I]   (Mixtral: w2)

gpt-oss keeps its experts fused, transposed with respect to nn.Linear, with
gate and up interleaved along 2I::

    {block}.experts.gate_up_proj [E, H, 2I], gate_up_proj_bias [E, 2I]
    {block}.experts.down_proj    [E, I, H],  down_proj_bias    [E, H]

FP8 online (vLLM's ``Fp8OnlineMoEMethod``, "--quantization fp8" on a bf16
checkpoint): the layer is created in the model dtype, loaded as above, and
quantized once after loading (per-tensor weight scales and dynamic
per-tensor activation scales by default, or 128x128 blocks).
"""

from __future__ import annotations

import torch

from ..errors import expect
from ..quant import QuantScheme
from .base import CheckpointFormat, CheckpointReader, check_tensor

ONLINE_SCHEMES = {"fp8": QuantScheme.fp8_per_tensor, "fp8_block": QuantScheme.fp8_block}


class UnquantizedFormat(CheckpointFormat):
    """bf16 / fp16 / fp32 checkpoints; ``online`` names a scheme to quantize to after loading."""

    name = "unquantized"

    def __init__(self, online: str | None = None) -> None:
        if online is None:
            super().__init__(QuantScheme.unquantized())
            return
        expect(online in ONLINE_SCHEMES, "online", f"one of {sorted(ONLINE_SCHEMES)}", online)
        super().__init__(ONLINE_SCHEMES[online]())
        self.name = f"{online}_online"
        self.online = True

    def linear(self, reader: CheckpointReader, path: str) -> dict[str, torch.Tensor]:
        name = f"{path}.weight"
        w = check_tensor(reader.get(name), name, dims=2)
        expect(w.is_floating_point() and w.element_size() > 1, f"checkpoint tensor '{name}'", "a float weight", w.dtype)
        out = {"weight": w}
        b = reader.get_optional(f"{path}.bias")
        if b is not None:
            out["bias"] = b
        return out

    def fused(self, reader: CheckpointReader, path: str, proj: str) -> dict[str, torch.Tensor]:
        name = f"{path}.{proj}"
        w = check_tensor(reader.get(name), name, dims=3)
        out = {"weight": w.transpose(1, 2)}
        b = reader.get_optional(f"{name}_bias")
        if b is not None:
            out["bias"] = check_tensor(b, f"{name}_bias", shape=(w.shape[0], w.shape[2]))
        return out
