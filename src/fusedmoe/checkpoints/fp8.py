"""Serialized FP8 checkpoints: ``"quant_method": "fp8"`` (DeepSeek-V3 style and per-tensor).

quantization_config (transformers ``FineGrainedFP8Config``; vLLM ``Fp8Config``)::

    {"quant_method": "fp8", "activation_scheme": "dynamic" | "static",
     "weight_block_size": [128, 128] | null, "fmt": "e4m3", "scale_fmt": "float" | "ue8m0"}

Tensors of each Linear:

    weight            float8_e4m3fn [N, K]
    weight_scale_inv  fp32 [ceil(N/bn), ceil(K/bk)] with weight_block_size (DeepSeek-V3),
                      float8_e8m0fnu codes with scale_fmt "ue8m0"; a scalar without blocks
    weight_scale      fp32 scalar: vLLM's per-tensor name for the same thing
    input_scale       fp32 scalar with activation_scheme "static" (transformers: activation_scale)

Despite its name, ``weight_scale_inv`` IS the dequantization multiplier:
transformers' ``_dequantize_fp8_weight`` (integrations/finegrained_fp8.py, 5.23)
computes ``weight.to(dtype) * scale`` block by block, and DeepSeek-V3's
``weight_dequant`` kernel does ``y = x * s``. (It is the inverse of the
quantization multiplier 448/amax.) Blocks at the edges may be partial.

transformers' own FP8 save of a MoE model (``FineGrainedFP8Config``, 5.24:
its ``FP8Experts`` module holds fused scales and the save writes per-expert
weights beside them)::

    {block}.experts.{e}.w1/w3/w2.weight     float8_e4m3fn [N, K] (gate_proj/up_proj/down_proj names
                                            for models other than Mixtral)
    {block}.experts.gate_up_proj_scale_inv  fp32 [E, ceil(2I/bn), ceil(H/bk)]  gate rows then up rows
    {block}.experts.down_proj_scale_inv     fp32 [E, ceil(H/bn), ceil(I/bk)]
    (no blocks: [E, 1, 1], one scale for gate and up together)

The gate rows' scales are the first I/bn rows of the fused scale: unambiguous
when I is a whole number of blocks (or without blocks); otherwise one block
straddles gate and up, and the checkpoint is refused with that reason.

Scheme: blocks -> fp8_block(bn, bk) (activations dynamic per 1 x bk group);
no blocks -> fp8 per-tensor with dynamic or static activation scales. W1 and
W3 carry their own per-tensor scales; the layer requantizes both to the
larger one (as vLLM does).
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedError, expect
from ..quant import QuantScheme
from ..quant.fp4 import e8m0_decode
from .base import CheckpointFormat, CheckpointReader, check_tensor, scalar
from .layout import expert_of


def _fused_rows(scale: torch.Tensor, shard: str, n: int, bn: int, name: str) -> torch.Tensor:
    """The rows of a gate_up fused scale [ceil(2I/bn), G] that belong to ``shard`` (I = n rows)."""
    if scale.shape[0] == 1 and shard != "w2":  # one scale for gate and up (no blocks)
        return scale
    if shard == "w2":
        return scale
    expect(n % bn == 0, f"checkpoint tensor '{name}'", f"I = {n} a multiple of the block {bn} (gate/up boundary)")
    rows = n // bn
    return scale[:rows] if shard == "w1" else scale[rows : 2 * rows]


class Fp8Format(CheckpointFormat):
    name = "fp8"
    quant_methods = ("fp8",)

    @classmethod
    def from_config(cls, qc: dict) -> Fp8Format:
        act = str(qc.get("activation_scheme", "dynamic")).lower()
        expect(act in ("dynamic", "static"), "quantization_config.activation_scheme", "'dynamic' or 'static'", act)
        fmt = qc.get("fmt", "e4m3")
        expect(fmt == "e4m3", "quantization_config.fmt", "'e4m3'", fmt)
        block = qc.get("weight_block_size")
        if block is not None:
            expect(
                isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block),
                "quantization_config.weight_block_size",
                "[block_n, block_k]",
                block,
            )
            if act == "static":
                raise UnsupportedError("fp8 checkpoints with weight blocks and static activation scales")
            scheme = QuantScheme.fp8_block(int(block[0]), int(block[1]))
        else:
            scheme = QuantScheme.fp8_per_tensor(static_activations=act == "static")
        return cls(scheme, qc)

    def linear(self, reader: CheckpointReader, path: str) -> dict[str, torch.Tensor]:
        wname = f"{path}.weight"
        w = check_tensor(reader.get(wname), wname, dims=2, dtype=torch.float8_e4m3fn)
        n, k = w.shape
        gran = self.scheme.w1.granularity
        sname = f"{path}.weight_scale_inv"
        if not reader.has(sname) and gran.kind == "tensor":
            sname = f"{path}.weight_scale"
        s = reader.get(sname, f"the scale of {wname}") if reader.has(sname) else self._fused_scale(reader, path, n)
        if s.dtype == torch.float8_e8m0fnu:
            s = e8m0_decode(s)
        if gran.kind == "block":
            s = check_tensor(s, sname, shape=gran.scale_shape(n, k)).float()
        else:
            s = scalar(s, sname)
        out = {"weight": w, "weight_scale": s}
        a = self.scheme.a1
        if a is not None and not a.dynamic:
            iname = f"{path}.input_scale" if reader.has(f"{path}.input_scale") else f"{path}.activation_scale"
            out["input_scale"] = scalar(reader.get(iname, f"the static activation scale of {wname}"), iname)
        return out

    def _fused_scale(self, reader: CheckpointReader, path: str, n: int) -> torch.Tensor:
        """Expert ``path``'s scale from transformers' fused ``{experts}.{gate_up,down}_proj_scale_inv``."""
        hit = expert_of(path)
        if hit is None:
            return reader.get(f"{path}.weight_scale_inv", f"the scale of {path}.weight")
        experts, e, shard = hit
        name = f"{experts}.{'down_proj' if shard == 'w2' else 'gate_up_proj'}_scale_inv"
        fused = check_tensor(reader.get(name, f"the scale of {path}.weight"), name, dims=3)
        gran = self.scheme.w1.granularity
        bn = gran.block_n if gran.kind == "block" else n
        return _fused_rows(fused[e], shard, n, bn, name)
