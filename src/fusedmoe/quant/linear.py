"""fp8 e4m3 and int8: one scale per group of elements, any granularity.

    q = saturate(round(x / scale)),   x ~= q * scale
    scale = amax(group) / QMAX        (dynamic, or given: static)

fp8 rounds to nearest even through torch's cast (after clamping to +-448, so
out-of-range values saturate instead of becoming NaN); int8 rounds half to
even and clamps to [-128, 127]. An all-zero group gets scale 1 (not 0) so the
round trip never divides by zero.
"""

from __future__ import annotations

import torch

from .scheme import TensorQuant
from .tensor import QTensor, check_scale_shape, expand_scale, group_amax

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
INT8_MAX = 127.0


class _Linear:
    def __init__(self, qmax: float, store: torch.dtype, integer: bool) -> None:
        self.qmax, self.store, self.integer = qmax, store, integer

    def scale_for(self, x: torch.Tensor, tq: TensorQuant) -> torch.Tensor:
        amax = group_amax(x, tq.granularity)
        s = amax / torch.full_like(amax, self.qmax)  # IEEE division on CUDA too (not * 1/qmax)
        # an all-zero group gets scale 1; a NaN abs-max stays NaN, so a NaN input poisons what
        # shares its scale instead of being quantized with a made-up scale of 1
        return torch.where(amax > 0, s, torch.where(torch.isnan(amax), amax, torch.ones_like(s)))

    def quantize(self, x, tq, *, scale=None, global_scale=None, g_idx=None) -> QTensor:
        n, k = x.shape[-2], x.shape[-1]
        if scale is None:
            scale = self.scale_for(x, tq)
        else:
            scale = check_scale_shape(scale, x, tq.granularity).float()
        y = x.float() / expand_scale(scale, tq.granularity, n, k)
        if self.integer:
            y = torch.round(y).clamp_(-self.qmax - 1, self.qmax)
        else:
            y = y.clamp(-self.qmax, self.qmax)
        return QTensor(data=y.to(self.store), shape=tuple(x.shape), scale=scale)

    def dequantize(self, q: QTensor, tq: TensorQuant, dtype: torch.dtype) -> torch.Tensor:
        n, k = q.shape[-2], q.shape[-1]
        ct = torch.float64 if dtype == torch.float64 else torch.float32  # round once, at the end
        s = expand_scale(q.scale.to(ct), tq.granularity, n, k)
        return (q.data.to(ct) * s).to(dtype)


fp8 = _Linear(FP8_MAX, torch.float8_e4m3fn, integer=False)
int8 = _Linear(INT8_MAX, torch.int8, integer=True)
