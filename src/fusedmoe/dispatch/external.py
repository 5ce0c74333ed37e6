"""Dispatchers still to come or from other libraries, declared so their status shows.

The expert-parallel dispatchers run over torch.distributed (NCCL on GPUs,
gloo on CPUs); DeepEP, pplx-kernels and FlashInfer bring their own
transports and are used only where their package is installed.
"""

from __future__ import annotations

from ..contract import TokenLayout
from .base import Dispatcher

_GPU = frozenset({"cuda"})


class DeepEPHighThroughputDispatcher(Dispatcher):
    name = "deepep_high_throughput"
    layout = TokenLayout.STANDARD
    distributed = True
    quantize_before_exchange = False  # per-token/tensor quantization happens after dispatch
    packages = ("deep_ep",)
    platforms = _GPU
    implemented = False
    seed_names = ("deepep_high_throughput",)


class DeepEPLowLatencyDispatcher(Dispatcher):
    name = "deepep_low_latency"
    layout = TokenLayout.BATCHED
    distributed = True
    quantize_before_exchange = False
    packages = ("deep_ep",)
    platforms = _GPU
    implemented = False
    seed_names = ("deepep low_latency",)


class PplxDispatcher(Dispatcher):
    name = "pplx"
    layout = TokenLayout.BATCHED
    distributed = True
    packages = ("pplx_kernels",)
    platforms = _GPU
    implemented = False
    seed_names = ("pplx",)


class FlashInferAll2AllvDispatcher(Dispatcher):
    name = "flashinfer_all2allv"
    layout = TokenLayout.STANDARD
    distributed = True
    packages = ("flashinfer",)
    platforms = _GPU
    implemented = False
    seed_names = ("flashinfer_all2allv",)


class FlashInferDispatcher(Dispatcher):
    name = "flashinfer"
    layout = TokenLayout.STANDARD
    packages = ("flashinfer",)
    platforms = _GPU
    implemented = False
    seed_names = ("flashinfer",)
