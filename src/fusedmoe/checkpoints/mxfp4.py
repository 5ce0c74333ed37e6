"""gpt-oss MXFP4 checkpoints: ``"quant_method": "mxfp4"``.

quantization_config: {"quant_method": "mxfp4", "modules_to_not_convert": [...]}
(transformers ``Mxfp4Config``). Only the routed experts are MXFP4; they are
fused per layer, weights as blocks of 32 e2m1 values (16 bytes) with one e8m0
exponent each::

    {block}.experts.gate_up_proj_blocks uint8 [E, 2I, H/32, 16]   rows gate/up interleaved
    {block}.experts.gate_up_proj_scales uint8 [E, 2I, H/32]       e8m0: 2^(s - 127)
    {block}.experts.gate_up_proj_bias   bf16  [E, 2I]
    {block}.experts.down_proj_blocks    uint8 [E, H, I/32, 16]
    {block}.experts.down_proj_scales    uint8 [E, H, I/32]
    {block}.experts.down_proj_bias      bf16  [E, H]

Checked against transformers 5.23 ``integrations/mxfp4.py``
``_convert_moe_packed_tensors``: ``lut[blk & 0x0F]`` fills the even columns and
``lut[blk >> 4]`` the odd ones, ``ldexp(value, scales - 127)``, the result
[E, N, K] is transposed to the module's [E, K, N]. The blocks are therefore,
per row, the canonical packed layout [N, K/2] (low nibble = even column) and
the scales the canonical e8m0 codes [N, K/32]; ``gate_up_proj`` rows
alternate gate, up (gpt-oss: ``gate = gate_up[..., ::2]``).
"""

from __future__ import annotations

import torch

from ..quant import QuantScheme
from .base import CheckpointFormat, CheckpointReader, check_tensor


class GptOssMxfp4Format(CheckpointFormat):
    name = "mxfp4"
    quant_methods = ("mxfp4",)

    @classmethod
    def from_config(cls, qc: dict) -> GptOssMxfp4Format:
        return cls(QuantScheme.mxfp4_w4a16(), qc)

    def fused(self, reader: CheckpointReader, path: str, proj: str) -> dict[str, torch.Tensor]:
        bname, sname = f"{path}.{proj}_blocks", f"{path}.{proj}_scales"
        blocks = check_tensor(reader.get(bname), bname, dims=4, dtype=torch.uint8)
        e, n, groups, nbytes = blocks.shape
        check_tensor(blocks, bname, shape=(e, n, groups, 16))
        scales = reader.get(sname, f"the e8m0 scales of {bname}")
        if scales.dtype == torch.float8_e8m0fnu:
            scales = scales.view(torch.uint8)
        check_tensor(scales, sname, shape=(e, n, groups), dtype=torch.uint8)
        out = {"weight": blocks.reshape(e, n, groups * 16), "weight_scale": scales}
        bias = reader.get_optional(f"{path}.{proj}_bias")
        if bias is not None:
            out["bias"] = check_tensor(bias, f"{path}.{proj}_bias", shape=(e, n))
        return out
