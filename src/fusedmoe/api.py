"""The public functional entry point: ``fused_moe``.

Each call needs a ``MoEKernel`` (dispatcher x experts backend). Building one per call would
cost the oracle's walk over every backend (~4 ms on an H100 host, measured 2026-11-25: 75% of
an eager call) and, under ``torch.compile``, could not be traced at all (a kernel built while
tracing would be gone when the graph runs). So kernels are built once per *key*: the
arguments that decide the choice (config, scheme, backend, dispatcher, chunk size, platform,
whether an expert map is passed) and the environment variables that change it
(``env.choice_key``), at most ``KERNEL_CACHE_SIZE`` of them, least recently used dropped
first. A call with a known key costs one dictionary lookup on top of the kernel's own run.
Under ``torch.compile`` the kernel is taken once, while tracing, and the graph holds its name
in ``fusedmoe::moe_forward`` (``fusedmoe.modular.ops``). A graph outlives its kernel only if
more than ``KERNEL_CACHE_SIZE`` other configurations were used since it was compiled; it then
raises, naming the kernel.
"""

from __future__ import annotations

import functools
from collections import OrderedDict

import torch

from . import env
from .config import MoEConfig
from .errors import UnsupportedError, expect
from .metadata import TopK
from .modular.kernel import MoEKernel
from .modular.ops import call_moe_forward
from .modular.validation import validate_call
from .oracle.build import build_kernel
from .platform import Platform
from .quant import QuantScheme
from .routing import RouterConfig
from .weights import ExpertWeights

KERNEL_CACHE_SIZE = 64
_KERNELS: OrderedDict[tuple, MoEKernel] = OrderedDict()
# id-keyed front of ``_KERNELS``: (config, scheme, platform, environment key, kernel)
_BY_IDENTITY: dict[tuple, tuple] = {}
_UNQUANTIZED = QuantScheme.unquantized()


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
    correction_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    chunk_size: int | None = None,
    platform: Platform | None = None,
) -> torch.Tensor:
    """One MoE layer: x [T, H] -> [T, H].

    routing: router logits [T, E] (routed with ``router``, a
    ``routing.RouterConfig`` with this config's E and K; default softmax top-k with
    renormalization, ``RouterConfig``'s own default), or a ``TopK`` / ``(topk_ids [T, K] int,
    topk_weights [T, K] float)`` pair. A pair whose id is outside [0, E) (-1 included)
    contributes nothing (``metadata.TopK``).
    correction_bias: [E], with logits only: added to the scores to choose the experts, not to
    weigh them (DeepSeek-V3's ``e_score_correction_bias``; ``RouterConfig.route``).
    backend: an Experts backend name or "auto" (the oracle's choice).

    Compiles with ``torch.compile(fullgraph=True)``: the configuration arguments are
    constants of the graph (a new value recompiles).
    """
    scheme = _UNQUANTIZED if scheme is None else scheme
    if not (isinstance(config, MoEConfig) and isinstance(scheme, QuantScheme)):  # before they key a kernel
        expect(isinstance(config, MoEConfig), "config", "a MoEConfig", type(config))
        expect(False, "scheme", "a QuantScheme (or None: unquantized)", type(scheme))
    if isinstance(routing, torch.Tensor) and not torch.compiler.is_compiling():
        if router is None or isinstance(router, RouterConfig):  # (any other router is refused by the checks)
            kernel = _kernel_of(config, scheme, backend, dispatcher, chunk_size, platform, expert_map)
            weights = kernel.prepared(weights)
            rtr = router or _default_router(config.num_experts + config.identity_experts, config.top_k)

            def plain() -> torch.Tensor:
                topk = _as_topk(routing, x, config, router, correction_bias)
                return _run(kernel, x, topk, weights, config, scheme, expert_map)

            # the routing launch and the experts' launches as one launch plan (``MoEKernel.route_and_run``)
            return kernel.route_and_run(x, routing, rtr, correction_bias, weights, plain, expert_map=expert_map)
    topk = _as_topk(routing, x, config, router, correction_bias)
    if torch.compiler.is_compiling():
        # the kernel is chosen and built while tracing; the graph records its name
        name = _kernel_name(config, scheme, backend, dispatcher, chunk_size, platform, expert_map is not None)
        validate_call(x, topk.ids, topk.weights, weights, config, scheme, expert_map)
        return call_moe_forward(name, x, topk, weights, expert_map)
    kernel = _kernel_of(config, scheme, backend, dispatcher, chunk_size, platform, expert_map)
    return _run(kernel, x, topk, kernel.prepared(weights), config, scheme, expert_map)


def _kernel_of(config, scheme, backend, dispatcher, chunk_size, platform, expert_map) -> MoEKernel:
    """``cached_kernel`` of a call's arguments. The same config and scheme objects call after call
    (a model's layer): found by identity, without hashing the dataclasses (~10 us for a quantized
    scheme); the environment still counts."""
    ident = (id(config), id(scheme), backend, dispatcher, chunk_size, id(platform), expert_map is not None)
    hit = _BY_IDENTITY.get(ident)
    knobs = env.choice_key()
    if hit is not None and hit[0] is config and hit[1] is scheme and hit[2] is platform and hit[3] == knobs:
        return hit[4]
    kernel = cached_kernel(config, scheme, backend, dispatcher, chunk_size, platform, expert_map is not None)
    if len(_BY_IDENTITY) >= KERNEL_CACHE_SIZE:
        _BY_IDENTITY.clear()
    _BY_IDENTITY[ident] = (config, scheme, platform, knobs, kernel)
    return kernel


def _run(kernel: MoEKernel, x, topk: TopK, weights: ExpertWeights, config, scheme, expert_map) -> torch.Tensor:
    """The routed call (``weights`` prepared): the kernel's launch plan, or checked and run."""
    out = kernel.replay(x, topk, weights, expert_map=expert_map)  # a plan: these inputs' kind was checked
    if out is not None:
        return out
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
    """The ``MoEKernel`` ``fused_moe`` runs for these arguments: built by the oracle once per key
    (see the module docstring), then taken from the cache."""
    key = (config, scheme, backend, dispatcher, chunk_size, platform, has_expert_map, env.choice_key())
    kernel = _KERNELS.get(key)
    if kernel is not None:
        _KERNELS.move_to_end(key)
        return kernel
    kernel = build_kernel(
        config, scheme, backend=backend, dispatcher=dispatcher, platform=platform, expert_map=has_expert_map,
        chunk_size=chunk_size,
    )  # fmt: skip
    if kernel.config != config:
        raise UnsupportedError(
            f"backend '{kernel.experts.name}' needs H and I padded to multiples of {kernel.choice.align}: "
            "fused_moe takes the weights as given; the FusedMoE layer pads them once after loading"
        )
    _KERNELS[key] = kernel
    while len(_KERNELS) > KERNEL_CACHE_SIZE:
        _KERNELS.popitem(last=False)
    return kernel


@torch.compiler.assume_constant_result
def _kernel_name(*key) -> str:
    """The cached kernel's name, run by Dynamo while tracing and recorded as a constant."""
    return cached_kernel(*key).name


def _as_topk(routing, x, config: MoEConfig, router, correction_bias) -> TopK:
    if isinstance(routing, (TopK, tuple, list)):
        expect(correction_bias is None, "correction_bias", "None where routing is already chosen (a TopK or "
               "(ids, weights))", "a tensor")  # fmt: skip
    if isinstance(routing, TopK):
        return routing
    if isinstance(routing, (tuple, list)):
        expect(len(routing) == 2, "routing", "(topk_ids, topk_weights)", len(routing))
        return TopK(routing[0], routing[1])
    e = config.num_experts + config.identity_experts  # logits cover the identity experts too
    if not isinstance(routing, torch.Tensor):
        expect(False, "routing", "router logits [T, E], a TopK or (ids, weights)", type(routing))
    t = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() >= 1 else None
    if routing.dim() != 2 or routing.shape[1] != e or (t is not None and routing.shape[0] != t):
        want = f"router logits [T, E] = [{t}, {e}] (T from x, E = num_experts)"
        expect(False, "routing", want, tuple(routing.shape))
    if router is None:
        return _default_router(e, config.top_k).route(routing, correction_bias)
    if not isinstance(router, RouterConfig):
        expect(False, "router", "a RouterConfig (or None: softmax top-k, renormalized)", type(router))
    if (router.num_experts, router.top_k) != (e, config.top_k):
        want = f"num_experts={e}, top_k={config.top_k} as in the MoEConfig"
        expect(False, "router", want, f"RouterConfig(num_experts={router.num_experts}, top_k={router.top_k})")
    return router.route(routing, correction_bias)


@functools.lru_cache(maxsize=64)
def _default_router(num_experts: int, top_k: int) -> RouterConfig:
    """Softmax top-k with renormalization, built once per (E, K), not per call."""
    return RouterConfig(num_experts=num_experts, top_k=top_k, renormalize=True)


__all__ = ["KERNEL_CACHE_SIZE", "cached_kernel", "fused_moe"]
