"""The storage formats by dtype, and the operations every caller uses: ``quantize``,
``dequantize``, ``fake_quantize``.

The format modules (``linear``, ``int4``, ``fp4``, ``mxfp8``) each define how one family of
codes is made and read; this module only looks the right one up, so nothing below it needs to
know which formats exist.
"""

from __future__ import annotations

import torch

from ..errors import expect
from . import fp4, int4, linear, mxfp8
from .scheme import QDtype, TensorQuant
from .tensor import Format, QTensor

# Every storage format, by the dtype a TensorQuant names (each module defines its formats).
FORMATS: dict[QDtype, Format] = {
    QDtype.FP8: linear.fp8,
    QDtype.INT8: linear.int8,
    QDtype.INT4: int4.int4,
    QDtype.MXFP4: fp4.mxfp4,
    QDtype.NVFP4: fp4.nvfp4,
    QDtype.MXFP8: mxfp8.mxfp8,
}

# Stored dtype of a quantized weight's data, per format (what ``quantize`` and the layer's loader
# produce); the 4-bit formats in ``PACKED`` hold two codes per uint8 along K.
WEIGHT_DATA_DTYPE: dict[QDtype, torch.dtype] = {
    QDtype.FP8: torch.float8_e4m3fn,
    QDtype.INT8: torch.int8,
    QDtype.INT4: torch.uint8,
    QDtype.MXFP4: torch.uint8,
    QDtype.NVFP4: torch.uint8,
}
PACKED = (QDtype.INT4, QDtype.MXFP4, QDtype.NVFP4)


def _format(tq: TensorQuant) -> Format:
    expect(tq.dtype in FORMATS, "TensorQuant.dtype", f"one of {list(FORMATS)}", tq.dtype)
    return FORMATS[tq.dtype]


def quantize(
    x: torch.Tensor,
    tq: TensorQuant,
    *,
    scale: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
) -> QTensor:
    """Quantize ``x`` ([*B, N, K], at least 2-D) as ``tq`` says.

    ``scale`` (static schemes), ``global_scale`` (NVFP4) and ``g_idx``
    (act-order) are used when given, computed from ``x`` otherwise.
    """
    expect(x.dim() >= 2, "x", "a tensor of at least 2 dims [*B, N, K]", tuple(x.shape))
    expect(x.is_floating_point(), "x", "a floating-point tensor", x.dtype)
    return _format(tq).quantize(x, tq, scale=scale, global_scale=global_scale, g_idx=g_idx)


def dequantize(q: QTensor, tq: TensorQuant, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The real values ``q`` stands for, as ``dtype`` [*B, N, K]."""
    return _format(tq).dequantize(q, tq, dtype)


def fake_quantize(x: torch.Tensor, tq: TensorQuant | None, dtype: torch.dtype | None = None, **static) -> torch.Tensor:
    """dequantize(quantize(x)): what a kernel sees after quantizing ``x``.

    ``tq=None`` returns ``x`` unchanged (cast to ``dtype`` if given).
    """
    dtype = dtype or x.dtype
    if tq is None:
        return x.to(dtype)
    return dequantize(quantize(x, tq, **static), tq, dtype)
