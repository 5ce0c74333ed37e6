"""fusedmoe: fused Mixture-of-Experts kernels for LLM inference.

One MoE layer = route -> dispatch (quantize, send) -> experts (grouped GEMMs +
activation) -> combine (weighted reduce). See docs/ARCHITECTURE in the repo.
"""

from .config import Activation, MoEConfig, ParallelConfig
from .errors import FusedMoEError, UnsupportedError
from .quant import Granularity, QDtype, QTensor, QuantScheme, TensorQuant
from .weights import ExpertWeights

__version__ = "0.1.0"

__all__ = [
    "Activation",
    "ExpertWeights",
    "FusedMoEError",
    "Granularity",
    "MoEConfig",
    "ParallelConfig",
    "QDtype",
    "QTensor",
    "QuantScheme",
    "TensorQuant",
    "UnsupportedError",
    "__version__",
]
