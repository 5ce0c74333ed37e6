"""The ``Dispatcher`` interface: quantize + send before the experts, receive + reduce after.

A dispatcher declares the token layout it produces (the experts must take
the same), whether it quantizes activations before or after the exchange
between ranks, and the top-k id dtype. ``dispatch`` returns a ``Dispatched``
bundle; ``combine`` turns the experts' output back into [T, H], doing the
weighted reduce the experts left to it (``WeightedReduce``).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..config import MoEConfig, ParallelConfig
from ..contract import Dispatched, TokenLayout, WeightedReduce
from ..metadata import TopK
from ..quant import QTensor, QuantScheme, quantize
from ..weights import ExpertWeights


class Dispatcher:
    name: ClassVar[str]
    layout: ClassVar[TokenLayout]
    quantize_before_exchange: ClassVar[bool] = True
    topk_id_dtype: ClassVar[torch.dtype] = torch.int32
    distributed: ClassVar[bool] = False
    implemented: ClassVar[bool] = True
    packages: ClassVar[tuple[str, ...]] = ()
    platforms: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda", "rocm", "xpu"})
    note: ClassVar[str] = ""
    seed_names: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def why_not(cls, platform) -> str | None:
        """None if this dispatcher can run on ``platform``; otherwise why not."""
        why = platform.why_not_run(cls.platforms, cls.packages)
        if why is None and not cls.implemented:
            return f"declared only: {cls.note or 'not implemented yet'}"
        return why

    def __init__(self, config: MoEConfig, scheme: QuantScheme, parallel: ParallelConfig | None = None):
        self.config = config
        self.scheme = scheme
        self.parallel = parallel or ParallelConfig()

    def agree_num_chunks(self, n: int, num_tokens: int | None = None) -> int:
        """The number of chunks every rank runs (the maximum over ranks for distributed ones).

        ``num_tokens``: this rank's largest chunk; distributed dispatchers share the maximum
        over ranks with the next ``n`` dispatches, which then need no exchange of sizes.
        """
        return n

    def max_tokens_per_rank(self, num_tokens: int) -> int:
        """Rows per expert the batched layout must hold (an upper bound)."""
        return num_tokens

    def dispatch(
        self,
        x: torch.Tensor,
        topk: TopK,
        weights: ExpertWeights,
        *,
        expert_map: torch.Tensor | None = None,
        a1_scale: torch.Tensor | None = None,
    ) -> Dispatched:
        raise NotImplementedError

    def input_quantization(self, x: torch.Tensor, weights: ExpertWeights):
        """x's quantization as a launch not yet made (``kernels.act_quant.ActQuantLaunch``) that can
        run with the routing launch, the result to pass to ``dispatch(quantized=...)``; or None, where
        this dispatcher quantizes x itself in ``dispatch`` (the default: it may need the routing)."""
        return None

    def writes_output(self, reduce: WeightedReduce) -> bool:
        """True when the experts' output is already the layer's output (nothing to move or reduce):
        ``MoEKernel`` then hands the experts the output itself and skips ``combine``."""
        return False

    def output_shape(self, d: Dispatched, reduce: WeightedReduce) -> tuple[int, ...]:
        """Shape of the experts' output buffer."""
        raise NotImplementedError

    def combine(self, y: torch.Tensor, d: Dispatched, out: torch.Tensor, reduce: WeightedReduce) -> None:
        raise NotImplementedError

    # ---- shared helpers --------------------------------------------------
    def quantize_input(
        self,
        x: torch.Tensor,
        topk: TopK,
        weights: ExpertWeights,
        a1_scale: torch.Tensor | None = None,
    ) -> QTensor:
        """x (times the router weight when applied on input) quantized as scheme.a1.

        ``a1_scale`` pins a per-tensor dynamic scale computed over a whole
        input that is processed in chunks, so chunking does not change results.
        """
        tq = self.scheme.a1
        if self.config.apply_router_weight_on_input:
            # x * w stays in fp32 into the quantizer, as the reference does: a rounding to the
            # model dtype first moved fp8 steps enough to leave the tolerance in ~1% of inputs
            x32 = x.float() * topk.weights.reshape(-1, 1)
            x = x32.to(x.dtype) if tq is None else x32
        if tq is None:
            return QTensor(x, tuple(x.shape))
        static = weights.act_scales("a1", tq)
        if tq.dynamic and a1_scale is not None:
            static["scale"] = a1_scale  # pinned over a whole chunked input (MoEKernel)
        if x.is_cuda:  # one fused kernel instead of a chain of PyTorch ops
            from ..kernels.act_quant import quantize_activations

            return quantize_activations(x, tq, **static)
        return quantize(x, tq, **static)
