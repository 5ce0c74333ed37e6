"""GPTQ int4 checkpoints: ``"quant_method": "gptq"``.

quantization_config (AutoGPTQ / GPTQModel ``BaseQuantizeConfig``, read by vLLM's
``GPTQMarlinConfig``)::

    {"quant_method": "gptq", "bits": 4, "group_size": 128 | -1, "desc_act": bool,
     "sym": bool, "checkpoint_format": "gptq" | "gptq_v2"}

Tensors of each Linear (layout in ``fusedmoe.quant.int4``: checked against
AutoGPTQ's ``QuantLinear.pack`` and AutoAWQ's ``pack_exllama``)::

    qweight int32 [K/8, N]   eight codes per word along K, low nibble first
    qzeros  int32 [G, N/8]   zero points along N; v1 ("gptq") stores zero - 1, v2 the zero
    scales  fp16  [G, N]
    g_idx   int32 [K]        group of each input column (meaningful with desc_act)

group_size -1 is one group per row (K/G = K). Symmetric checkpoints store
zero 8 (v1: 7). desc_act (act-order) keeps g_idx; without it a g_idx that is
not the identity k // group_size is an error.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedError, expect
from ..quant import Granularity, QDtype, QuantScheme, TensorQuant
from ..quant.int4 import pack_int32, unpack_gptq, unpack_int32
from .base import CheckpointFormat, CheckpointReader, check_tensor


def int4_scheme(group_size: int, zero_points: bool, act_order: bool, hidden: int = 0, inter: int = 0) -> QuantScheme:
    """int4 w4a16; group_size -1 (per channel) is one group over all of K (H for W13, I for W2)."""
    if group_size > 0:
        return QuantScheme.int4_w4a16(group_size, zero_points=zero_points, act_order=act_order)
    expect(not act_order, "group_size", "> 0 with act-order", group_size)
    if not hidden:  # sizes unknown until the model's config is read (CheckpointFormat.layer_scheme)
        return QuantScheme.int4_w4a16(128, zero_points=zero_points)

    def tq(k):
        return TensorQuant(QDtype.INT4, Granularity.group(k), symmetric=not zero_points)

    return QuantScheme(name="int4_channel" + ("_zp" if zero_points else ""), w1=tq(hidden), w2=tq(inter))


def int4_pieces(q, act_order: bool, where: str) -> dict[str, torch.Tensor]:
    """Canonical int4 QTensor [N, K] -> layer pieces."""
    out = {"weight": q.data, "weight_scale": q.scale}
    if q.zero is not None:
        out["weight_zero_point"] = q.zero
    if q.g_idx is not None:
        expect(act_order, where, "g_idx equal to k // group_size (the config says no act-order)")
        out["g_idx"] = q.g_idx
    return out


class GptqFormat(CheckpointFormat):
    name = "gptq"
    quant_methods = ("gptq",)

    @classmethod
    def from_config(cls, qc: dict) -> GptqFormat:
        bits = qc.get("bits")
        if bits != 4:
            raise UnsupportedError(f"quantization_config.bits: expected 4 (int4 GPTQ), got {bits!r}")
        ckpt = qc.get("checkpoint_format", "gptq")
        expect(ckpt in ("gptq", "gptq_v2"), "quantization_config.checkpoint_format", "'gptq' or 'gptq_v2'", ckpt)
        g = int(qc.get("group_size", 128))
        sym = bool(qc.get("sym", True))
        act = bool(qc.get("desc_act", False))
        fmt = cls(int4_scheme(g, not sym, act), qc)
        fmt.group_size, fmt.sym, fmt.act_order, fmt.v2 = g, sym, act, ckpt == "gptq_v2"
        return fmt

    def linear(self, reader: CheckpointReader, path: str) -> dict[str, torch.Tensor]:
        names = {k: f"{path}.{k}" for k in ("qweight", "qzeros", "scales", "g_idx")}
        qw = check_tensor(reader.get(names["qweight"]), names["qweight"], dims=2, dtype=torch.int32)
        k, n = qw.shape[0] * 8, qw.shape[1]
        g = self.group_size if self.group_size > 0 else k
        groups = -(-k // g)
        qz = check_tensor(reader.get(names["qzeros"]), names["qzeros"], shape=(groups, -(-n // 8)), dtype=torch.int32)
        sc = check_tensor(reader.get(names["scales"]), names["scales"], shape=(groups, n))
        gi = reader.get_optional(names["g_idx"])
        if gi is not None:
            check_tensor(gi, names["g_idx"], shape=(k,))
        if self.v2:
            qz = pack_int32((unpack_int32(qz, n) - 1) & 0xF)
        q = unpack_gptq(qw, qz, sc, gi, g, symmetric=self.sym)
        return int4_pieces(q, self.act_order, names["g_idx"])

    def layer_scheme(self, hidden: int, intermediate: int) -> QuantScheme:
        if self.group_size > 0:
            return self.scheme
        return int4_scheme(-1, not self.sym, False, hidden, intermediate)
