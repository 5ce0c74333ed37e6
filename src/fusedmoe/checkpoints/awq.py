"""AWQ int4 checkpoints: ``"quant_method": "awq"`` (GEMM packing).

quantization_config (AutoAWQ; vLLM ``AWQConfig``/``AWQMarlinConfig``)::

    {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"}

Tensors of each Linear (layout in ``fusedmoe.quant.int4``, checked against AutoAWQ's
``awq/utils/packing_utils.py``: nibble i of a word holds column AWQ_ORDER[i] =
[0, 2, 4, 6, 1, 3, 5, 7])::

    qweight int32 [K, N/8]    packed along N
    qzeros  int32 [G, N/8]    zero points, same order (no "- 1")
    scales  fp16  [G, N]

x ~= (code - zero) * scale. Only the GEMM layout with zero points is read
(GEMV and symmetric AWQ variants are refused with that reason).
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedError
from ..quant import QuantScheme
from ..quant.int4 import unpack_awq
from .base import CheckpointFormat, CheckpointReader, check_tensor
from .gptq import int4_pieces, int4_scheme


class AwqFormat(CheckpointFormat):
    name = "awq"
    quant_methods = ("awq",)

    @classmethod
    def from_config(cls, qc: dict) -> AwqFormat:
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise UnsupportedError(f"quantization_config.bits: expected 4 (int4 AWQ), got {bits!r}")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedError(f"quantization_config.version: expected 'gemm' (AWQ packing), got {version!r}")
        if not qc.get("zero_point", True):
            raise UnsupportedError("quantization_config.zero_point: expected true (AWQ without zero points)")
        g = int(qc.get("group_size", qc.get("q_group_size", 128)))
        fmt = cls(int4_scheme(g, True, False), qc)
        fmt.group_size = g
        return fmt

    def linear(self, reader: CheckpointReader, path: str) -> dict[str, torch.Tensor]:
        qwn, qzn, scn = f"{path}.qweight", f"{path}.qzeros", f"{path}.scales"
        qw = check_tensor(reader.get(qwn), qwn, dims=2, dtype=torch.int32)
        k, n = qw.shape[0], qw.shape[1] * 8
        g = self.group_size if self.group_size > 0 else k
        groups = -(-k // g)
        qz = check_tensor(reader.get(qzn), qzn, shape=(groups, n // 8), dtype=torch.int32)
        sc = check_tensor(reader.get(scn), scn, shape=(groups, n))
        q = unpack_awq(qw, qz, sc, g, symmetric=False)
        return int4_pieces(q, False, qwn)

    def layer_scheme(self, hidden: int, intermediate: int) -> QuantScheme:
        return self.scheme if self.group_size > 0 else int4_scheme(-1, True, False, hidden, intermediate)
