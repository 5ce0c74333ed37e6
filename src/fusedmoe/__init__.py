"""fusedmoe: fused Mixture-of-Experts kernels for LLM inference.

One MoE layer = route -> dispatch (quantize, send) -> experts (grouped GEMMs +
activation) -> combine (weighted reduce)::

    from fusedmoe import fused_moe, FusedMoE, MoEConfig, QuantScheme, ExpertWeights

``fused_moe`` is the functional entry point (the oracle's backend, cached per
configuration); ``FusedMoE`` the ``torch.nn.Module`` that loads checkpoint weights,
converts them once for its backend and runs them; ``select_experts`` the oracle itself,
which explains its choice.
"""

from .api import fused_moe
from .config import Activation, MoEConfig, ParallelConfig
from .errors import FusedMoEError, UnsupportedError
from .layer import FusedMoE
from .metadata import TopK
from .oracle import select_experts
from .quant import Granularity, QDtype, QTensor, QuantScheme, TensorQuant
from .routing import RouterConfig
from .weights import ExpertWeights

__version__ = "0.1.0"

__all__ = [
    "Activation",
    "ExpertWeights",
    "FusedMoE",
    "FusedMoEError",
    "Granularity",
    "MoEConfig",
    "ParallelConfig",
    "QDtype",
    "QTensor",
    "QuantScheme",
    "RouterConfig",
    "TensorQuant",
    "TopK",
    "UnsupportedError",
    "__version__",
    "fused_moe",
    "select_experts",
]
