"""Dispatchers still to come or from other libraries, declared so their status shows.

The expert-parallel dispatchers run over torch.distributed (NCCL on GPUs,
gloo on CPUs); DeepEP, pplx-kernels and FlashInfer bring their own
transports and are used only where their package is installed.
"""

from __future__ import annotations

from ..contract import TokenLayout
from .base import Dispatcher


class _Declared(Dispatcher):
    """Declared, not written: a CUDA library's transport between ranks, in the standard layout
    (unless it says otherwise)."""

    layout = TokenLayout.STANDARD
    distributed = True
    platforms = frozenset({"cuda"})
    implemented = False


class _DeepEP(_Declared):
    """DeepEP's two modes: per-token/tensor quantization happens after dispatch."""

    quantize_before_exchange = False
    packages = ("deep_ep",)


class DeepEPHighThroughputDispatcher(_DeepEP):
    name = "deepep_high_throughput"
    seed_names = ("deepep_high_throughput",)


class DeepEPLowLatencyDispatcher(_DeepEP):
    name = "deepep_low_latency"
    layout = TokenLayout.BATCHED
    seed_names = ("deepep low_latency",)


class PplxDispatcher(_Declared):
    name = "pplx"
    layout = TokenLayout.BATCHED
    packages = ("pplx_kernels",)
    seed_names = ("pplx",)


class FlashInferAll2AllvDispatcher(_Declared):
    name = "flashinfer_all2allv"
    packages = ("flashinfer",)
    seed_names = ("flashinfer_all2allv",)


class FlashInferDispatcher(_Declared):
    name = "flashinfer"
    distributed = False
    packages = ("flashinfer",)
    seed_names = ("flashinfer",)
