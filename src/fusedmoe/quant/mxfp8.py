"""MXFP8 (OCP Microscaling v1.0): e4m3 values with an e8m0 scale per 32 along K.

    X  = 2^(floor(log2(amax(group))) - 8)      8 = emax of e4m3 (448 = 1.75 * 2^8)
    q  = e4m3(clamp(x / X, -448, 448))         round to nearest even
    x ~= fp32(q) * X

amax / X lies in [256, 512), so the top of a group can exceed e4m3's 448 and
saturates there, as the spec says (rather than bumping X, which would cost
every other element of the group one bit). Scales are stored as e8m0 codes
(uint8, value 2^(s-127)); an all-zero group gets s = 127 (X = 1). The data is
torch.float8_e4m3fn [*B, N, K], not packed, so one byte per value plus one
per 32 values: 8.25 bits per element. K must be a multiple of 32 (kernels
read whole groups; see ``shape_supported``). The quantizer and the exponent
helpers are shared with MXFP4 (``fp4.MXFormat``).
"""

from __future__ import annotations

import torch

from .fp4 import E4M3_MAX, MXFormat

MXFP8_EMAX = 8


class _MXFP8(MXFormat):
    name, emax = "mxfp8", MXFP8_EMAX

    def encode(self, y: torch.Tensor) -> torch.Tensor:
        return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)

    def decode(self, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return data.to(dtype)


mxfp8 = _MXFP8()
