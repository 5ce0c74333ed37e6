"""The public functional entry point: ``fused_moe``.

Each call needs a ``MoEKernel`` (dispatcher x experts backend). Building one per call would
cost a registration and, under ``torch.compile``, could not be traced at all (a kernel built
while tracing would be gone when the graph runs). So kernels are cached per
(config, effective scheme, backend, dispatcher, chunk size, the environment knobs a kernel
reads when built), at most ``KERNEL_CACHE_SIZE`` of them, least recently used dropped first.
The oracle still runs each eager call (its choice follows ``FUSEDMOE_BACKEND`` and friends);
under ``torch.compile`` the choice and the kernel are taken once, while tracing, and the
graph holds the kernel's name in ``fusedmoe::moe_forward`` (``fusedmoe.modular.ops``). A graph
outlives its kernel only if more than ``KERNEL_CACHE_SIZE`` other configurations were used
since it was compiled; it then raises, naming the kernel.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from . import env
from .config import MoEConfig
from .contract import TokenLayout
from .errors import expect
from .metadata import TopK
from .modular.kernel import MoEKernel
from .modular.ops import call_moe_forward
from .modular.validation import validate_call
from .oracle import select_experts
from .oracle.registry import get_dispatcher, get_experts
from .platform import Platform
from .quant import QuantScheme
from .weights import ExpertWeights

KERNEL_CACHE_SIZE = 64
_KERNELS: OrderedDict[tuple, MoEKernel] = OrderedDict()


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

    Compiles with ``torch.compile(fullgraph=True)``: the configuration arguments are
    constants of the graph (a new value recompiles).
    """
    scheme = scheme or QuantScheme.unquantized()
    topk = _as_topk(routing, config, router)
    key = (config, scheme, backend, dispatcher, chunk_size, platform, expert_map is not None)
    if torch.compiler.is_compiling():
        # the kernel is chosen and built while tracing; the graph records its name
        name = _kernel_name(*key)
        validate_call(x, topk.ids, topk.weights, weights, config, scheme, expert_map)
        return call_moe_forward(name, x, topk, weights, expert_map)
    kernel = cached_kernel(*key)
    # after the oracle: a configuration no backend runs is refused before its inputs are looked at
    validate_call(x, topk.ids, topk.weights, weights, config, scheme, expert_map)
    return kernel.forward_eager(x, topk, weights, expert_map=expert_map)


def cached_kernel(
    config: MoEConfig,
    scheme: QuantScheme,
    backend: str = "auto",
    dispatcher: str = "local",
    chunk_size: int | None = None,
    platform: Platform | None = None,
    has_expert_map: bool = False,
) -> MoEKernel:
    """The ``MoEKernel`` ``fused_moe`` runs for these arguments (the oracle's choice, then the cache)."""
    disp_cls = get_dispatcher(dispatcher)
    choice = select_experts(
        config, scheme, platform=platform, layout=disp_cls.layout, backend=backend, expert_map=has_expert_map
    )
    # the backend may compute with another activation precision than asked (e.g. mxfp8 for mxfp4)
    scheme = choice.effective_scheme or scheme
    knobs = (env.chunk_size(), env.deterministic())
    key = (config, scheme, choice.backend, dispatcher, chunk_size, knobs)
    kernel = _KERNELS.get(key)
    if kernel is None:
        experts = get_experts(choice.backend)(config, scheme)
        kernel = MoEKernel(disp_cls(config, scheme), experts, chunk_size=chunk_size)
        _KERNELS[key] = kernel
        while len(_KERNELS) > KERNEL_CACHE_SIZE:
            _KERNELS.popitem(last=False)
    else:
        _KERNELS.move_to_end(key)
    return kernel


@torch.compiler.assume_constant_result
def _kernel_name(*key) -> str:
    """``cached_kernel(*key).name``, run by Dynamo while tracing and recorded as a constant."""
    return cached_kernel(*key).name


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


__all__ = ["KERNEL_CACHE_SIZE", "cached_kernel", "fused_moe", "TokenLayout"]
