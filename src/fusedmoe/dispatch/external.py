"""Dispatchers still to come or from other libraries, declared so their status shows.

The expert-parallel dispatchers run over torch.distributed (NCCL on GPUs,
gloo on CPUs); DeepEP, pplx-kernels and FlashInfer bring their own
transports and are used only where their package is installed.
"""

from __future__ import annotations

from ..contract import TokenLayout
from .base import Dispatcher


class _Declared(Dispatcher):
    """Declared, not written: a CUDA library's transport between ranks (unless it says otherwise)."""

    distributed = True
    platforms = frozenset({"cuda"})
    implemented = False


class DeepEPHighThroughputDispatcher(_Declared):
    name = "deepep_high_throughput"
    layout = TokenLayout.STANDARD
    quantize_before_exchange = False  # per-token/tensor quantization happens after dispatch
    packages = ("deep_ep",)
    seed_names = ("deepep_high_throughput",)


class DeepEPLowLatencyDispatcher(_Declared):
    name = "deepep_low_latency"
    layout = TokenLayout.BATCHED
    quantize_before_exchange = False
    packages = ("deep_ep",)
    seed_names = ("deepep low_latency",)


class PplxDispatcher(_Declared):
    name = "pplx"
    layout = TokenLayout.BATCHED
    packages = ("pplx_kernels",)
    seed_names = ("pplx",)


class FlashInferAll2AllvDispatcher(_Declared):
    name = "flashinfer_all2allv"
    layout = TokenLayout.STANDARD
    packages = ("flashinfer",)
    seed_names = ("flashinfer_all2allv",)


class FlashInferDispatcher(_Declared):
    name = "flashinfer"
    layout = TokenLayout.STANDARD
    distributed = False
    packages = ("flashinfer",)
    seed_names = ("flashinfer",)
