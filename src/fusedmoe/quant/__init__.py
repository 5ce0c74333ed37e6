"""Quantization: schemes (what), formats (how), and the QTensor container."""

from .formats import FORMATS, dequantize, fake_quantize, quantize
from .scheme import Granularity, QDtype, QuantScheme, TensorQuant, all_schemes
from .tensor import Operand, QTensor

__all__ = [
    "FORMATS",
    "Granularity",
    "Operand",
    "QDtype",
    "QTensor",
    "QuantScheme",
    "TensorQuant",
    "all_schemes",
    "dequantize",
    "fake_quantize",
    "quantize",
]
