"""Quantization: schemes (what), formats (how), and the QTensor container."""

from .scheme import Granularity, QDtype, QuantScheme, TensorQuant, all_schemes
from .tensor import FORMATS, QTensor, dequantize, fake_quantize, quantize

__all__ = [
    "FORMATS",
    "Granularity",
    "QDtype",
    "QTensor",
    "QuantScheme",
    "TensorQuant",
    "all_schemes",
    "dequantize",
    "fake_quantize",
    "quantize",
]
