"""The public functional entry point: ``fused_moe``."""

from __future__ import annotations

import torch

from .config import MoEConfig
from .errors import expect
from .experts.base import TokenLayout
from .kernel import MoEKernel
from .metadata import TopK
from .oracle import select_experts
from .platform import Platform
from .quant import QuantScheme
from .registry import get_dispatcher, get_experts
from .validation import validate_call
from .weights import ExpertWeights


def fused_moe(
    x: torch.Tensor,
    routing,
    weights: ExpertWeights,
    config: MoEConfig,
    scheme: QuantScheme | None = None,
    *,
    backend: str = "auto",
    dispatcher: str = "local",
    router=None,
    expert_map: torch.Tensor | None = None,
    chunk_size: int | None = None,
    platform: Platform | None = None,
) -> torch.Tensor:
    """One MoE layer: x [T, H] -> [T, H].

    routing: router logits [T, E] (routed with ``router``, a
    ``routing.RouterConfig``; default softmax top-k with renormalization), or
    a ``TopK`` / ``(topk_ids [T, K] int, topk_weights [T, K] float)`` pair.
    backend: an Experts backend name or "auto" (the oracle's choice).
    """
    scheme = scheme or QuantScheme.unquantized()
    topk = _as_topk(routing, config, router)
    disp_cls = get_dispatcher(dispatcher)
    layout = disp_cls.layout
    choice = select_experts(
        config, scheme, platform=platform, layout=layout, backend=backend, expert_map=expert_map is not None
    )
    # after the oracle: a configuration no backend runs is refused before its inputs are looked at
    validate_call(x, topk.ids, topk.weights, weights, config, scheme, expert_map)
    # the backend may compute with another activation precision than asked (e.g. mxfp8 for mxfp4)
    scheme = choice.effective_scheme or scheme
    experts = get_experts(choice.backend)(config, scheme)
    kernel = MoEKernel(disp_cls(config, scheme), experts, chunk_size=chunk_size)
    return kernel(x, topk, weights, expert_map=expert_map)


def _as_topk(routing, config: MoEConfig, router) -> TopK:
    if isinstance(routing, TopK):
        return routing
    if isinstance(routing, tuple):
        expect(len(routing) == 2, "routing", "(topk_ids, topk_weights)", len(routing))
        return TopK(routing[0], routing[1])
    expect(
        isinstance(routing, torch.Tensor), "routing", "router logits [T, E], a TopK or (ids, weights)", type(routing)
    )
    from .routing import RouterConfig

    router = router or RouterConfig(num_experts=config.num_experts, top_k=config.top_k, renormalize=True)
    return router.route(routing)


__all__ = ["fused_moe", "TokenLayout"]
