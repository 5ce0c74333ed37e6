"""``build_kernel``: the oracle's choice turned into a ``MoEKernel``, in one place.

    select_experts(config, scheme, layout of the dispatcher)  ->  Choice
    padded_config(config, choice.align)                       ->  the sizes the backend runs
    Experts(padded config, effective scheme), Dispatcher(...)  ->  MoEKernel

``fused_moe`` (``api``), the ``FusedMoE`` layer and the tools (bench, EP bench, EP check)
all build their kernels here, so a rule about choosing or composing lives once. It sits in
the oracle package because it needs the registry and the choice; ``modular`` only composes
what it is given.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import env
from ..config import MoEConfig, ParallelConfig
from ..errors import UnsupportedError
from ..modular.kernel import MoEKernel
from ..platform import Platform, current_platform
from ..quant import QuantScheme
from . import select_experts
from .padding import padded_config
from .registry import get_dispatcher, get_experts


def build_kernel(
    config: MoEConfig,
    scheme: QuantScheme,
    *,
    backend: str = "auto",
    dispatcher: str = "local",
    parallel: ParallelConfig | None = None,
    platform: Platform | None = None,
    expert_map: bool = False,
    num_tokens: int | None = None,
    chunk_size: int | None = None,
    shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
    dispatcher_options: dict | None = None,
) -> MoEKernel:
    """The ``MoEKernel`` the oracle picks for ``config`` x ``scheme`` behind ``dispatcher``.

    backend: an Experts backend name, or "auto" (the oracle walks the platform's list; an
    explicit name is honoured or refused with the reason). expert_map: the calls pass an
    expert map (expert parallelism). num_tokens: the tokens per call the caller expects,
    for the oracle's shape rule. dispatcher_options: keyword arguments of the dispatcher
    (an EP group, a capacity). The kernel's ``choice`` says what was chosen and why; its
    ``config`` is ``config`` padded to the backend's alignment (the weights must be padded
    the same way: ``oracle.padding.pad_weights``) and its ``scheme`` the effective one.
    """
    env.check_all()
    platform = platform or current_platform()
    disp_cls = get_dispatcher(dispatcher)
    why = disp_cls.why_not(platform)
    if why is not None:
        raise UnsupportedError(f"dispatcher '{disp_cls.name}' cannot run: {why}")
    choice = select_experts(
        config,
        scheme,
        platform=platform,
        layout=disp_cls.layout,
        backend=backend,
        expert_map=expert_map,
        num_tokens=num_tokens,
    )
    # the backend may compute with another activation precision than asked (MXFP4 x MXFP8)
    # and need H, I rounded up: it is built for both
    effective = choice.effective_scheme or scheme
    padded = padded_config(config, choice.align)
    experts = get_experts(choice.backend)(padded, effective)
    disp = disp_cls(padded, effective, parallel, **(dispatcher_options or {}))
    kernel = MoEKernel(disp, experts, chunk_size=chunk_size, shared_experts=shared_experts)
    kernel.choice = choice
    return kernel
