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
read whole groups; see ``shape_supported``). Exponent helpers are shared with
MXFP4 in ``fp4``.
"""

from __future__ import annotations

import torch

from ..errors import expect
from .fp4 import (
    E4M3_MAX,
    check_group_multiple,
    compute_dtype,
    e8m0_decode,
    e8m0_reciprocal,
    mx_scale_code,
    mx_static_code,
)
from .scheme import TensorQuant
from .tensor import QTensor, expand_scale, group_amax

MXFP8_EMAX = 8


class _MXFP8:
    def quantize(self, x, tq, *, scale=None, global_scale=None, g_idx=None) -> QTensor:
        expect(global_scale is None, "global_scale", "None for mxfp8")
        expect(g_idx is None, "g_idx", "None for mxfp8")
        check_group_multiple(x, tq)
        n, k = x.shape[-2], x.shape[-1]
        if scale is None:
            code = mx_scale_code(group_amax(x, tq.granularity), MXFP8_EMAX)
        else:
            code = mx_static_code(scale, x, tq)
        y = x.float() * expand_scale(e8m0_reciprocal(code), tq.granularity, n, k)
        data = y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return QTensor(data=data, shape=tuple(x.shape), scale=code)

    def dequantize(self, q: QTensor, tq: TensorQuant, dtype: torch.dtype) -> torch.Tensor:
        n, k = q.shape[-2], q.shape[-1]
        ct = compute_dtype(dtype)
        s = expand_scale(e8m0_decode(q.scale).to(ct), tq.granularity, n, k)
        return (q.data.to(ct) * s).to(dtype)


mxfp8 = _MXFP8()
