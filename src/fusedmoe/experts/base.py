"""The ``Experts`` interface: the grouped expert computation for one token layout.

An Experts class declares what it supports in ``Capabilities``; everything
that lists or chooses backends (``fusedmoe features``, the oracle, the
capability test) reads those declarations, so no table is kept by hand.
``why_not`` answers "can you run this, and if not, why" from the declaration
plus any class-specific rule (``extra_checks``).

Data flow, standard layout::

    apply(a: QTensor [T, H] (quantized as scheme.a1, or model dtype),
          topk: TopK, weights, expert_map, out)
      out [T, H]     when reduce is WeightedReduce.NONE (weighted + summed inside)
      out [T, K, H]  otherwise (the dispatcher's combine weights/sums)

Batched layout::

    apply(a: QTensor [E_l, M, H], counts [E_l], weights, out [E_l, M, H])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..config import Activation, MoEConfig
from ..contract import TokenLayout, WeightedReduce, Workspace
from ..metadata import TopK
from ..platform import Platform
from ..quant import QTensor, QuantScheme, all_schemes
from ..quant.scheme import shape_supported
from ..weights import ExpertWeights

ALL_ACTIVATIONS = frozenset(Activation)
ALL_SCHEMES = frozenset(s.name for s in all_schemes())


@dataclass(frozen=True)
class Capabilities:
    """What an Experts backend supports, declared once, read everywhere."""

    layouts: frozenset[TokenLayout]
    schemes: frozenset[str]  # QuantScheme names (see quant.scheme.all_schemes)
    activations: frozenset[Activation] = ALL_ACTIVATIONS
    dtypes: frozenset[torch.dtype] = frozenset({torch.bfloat16, torch.float16, torch.float32})
    expert_map: bool = True
    chunking: bool = True
    router_weight_on_input: bool = True
    bias: bool = True
    platforms: frozenset[str] = frozenset({"cpu", "cuda"})  # Platform.kind values
    min_capability: tuple[int, int] | None = None  # cuda compute capability
    packages: tuple[str, ...] = ()  # optional packages it needs
    implemented: bool = True  # False: declared so the oracle can say why not
    note: str = ""
    seed_names: tuple[str, ...] = ()  # rows of the reference feature tables this backend covers
    # (H multiple, I multiple) the kernel needs; the layer pads the weights once to these
    # (``fusedmoe.oracle.padding``). (1, 1): any size. ``Experts.alignment`` may refine it per scheme.
    align: tuple[int, int] = (1, 1)

    @property
    def scheme_kinds(self) -> frozenset:
        return frozenset(s.kind for s in all_schemes() if s.name in self.schemes)

    def supports_scheme(self, scheme: QuantScheme) -> bool:
        return scheme.kind in self.scheme_kinds

    @property
    def quant_types(self) -> list[str]:
        seen = []
        for s in all_schemes():
            if s.name in self.schemes and s.quant_types not in seen:
                seen.append(s.quant_types)
        return seen

    @property
    def granularities(self) -> list[str]:
        """Weight granularity symbols of the supported quantized schemes."""
        seen = []
        for s in all_schemes():
            if s.name in self.schemes and s.w1 is not None and s.w1.granularity.short not in seen:
                seen.append(s.w1.granularity.short)
        return seen


class Experts:
    """Base class: subclasses set ``name``, ``layout``, ``capabilities`` and implement ``apply``."""

    name: ClassVar[str]
    layout: ClassVar[TokenLayout]
    capabilities: ClassVar[Capabilities]
    reduce: ClassVar[WeightedReduce] = WeightedReduce.NONE
    # A standard backend's batched twin (the oracle maps one to the other).
    batched_twin: ClassVar[str | None] = None
    # The activation precision this backend runs a weight format with, by scheme name:
    # e.g. {"mxfp4": "mxfp4_mxfp8"} = MXFP4 weights computed with MXFP8 activations. Both
    # schemes must have the same w1/w2 (the weights do not change, only a1/a2). Empty: as given.
    implied_activations: ClassVar[dict[str, str]] = {}

    def __init__(self, config: MoEConfig, scheme: QuantScheme) -> None:
        self.config = config
        self.scheme = scheme

    # ---- capability checks ---------------------------------------------
    @classmethod
    def why_not(
        cls,
        config: MoEConfig,
        scheme: QuantScheme,
        platform: Platform,
        *,
        layout: TokenLayout | None = None,
        expert_map: bool = False,
        chunking: bool = False,
    ) -> str | None:
        """None if this backend can run the request; otherwise the reason, in words."""
        c = cls.capabilities
        if layout is not None and layout not in c.layouts:
            return f"token layout {layout.value} not supported (has {sorted(x.value for x in c.layouts)})"
        why = platform.why_not_run(c.platforms, c.packages, c.min_capability)
        if why is not None:
            return why
        if not c.implemented:
            return f"declared only: {c.note or 'adapter not implemented yet'}"
        if not c.supports_scheme(scheme):
            return f"quantization scheme {scheme.name} not supported"
        if config.activation not in c.activations:
            return f"activation {config.activation.value} not supported"
        if config.dtype not in c.dtypes:
            return f"dtype {config.dtype} not supported"
        if expert_map and not c.expert_map:
            return "expert map (expert parallelism) not supported"
        if chunking and not c.chunking:
            return "chunking not supported"
        if config.apply_router_weight_on_input and not c.router_weight_on_input:
            return "router weight on input not supported"
        if config.has_bias and not c.bias:
            return "biases not supported"
        shape = shape_supported(scheme, config.hidden_size, config.intermediate_size)
        if shape:
            return shape
        return cls.extra_checks(config, scheme, platform)

    @classmethod
    def extra_checks(cls, config: MoEConfig, scheme: QuantScheme, platform: Platform) -> str | None:
        """Backend-specific rules beyond the declaration (sizes, combinations)."""
        return None

    @classmethod
    def activation_scheme(cls, scheme: QuantScheme, platform: Platform) -> QuantScheme:
        """The scheme this backend computes for ``scheme``'s weights on ``platform``.

        Same w1/w2; a1/a2 may differ (``implied_activations``). The oracle checks
        ``why_not`` against it and the layer quantizes activations as it says.
        """
        name = cls.implied_activations.get(scheme.name)
        return scheme if name is None else QuantScheme.by_name(name)

    @classmethod
    def alignment(cls, scheme: QuantScheme, platform: Platform) -> tuple[int, int]:
        """(H multiple, I multiple) this backend needs for ``scheme`` on ``platform``."""
        return cls.capabilities.align

    # ---- running ---------------------------------------------------------
    def workspace(self, num_tokens: int, num_local_experts: int) -> Workspace:
        """Buffers ``apply`` needs for ``num_tokens`` tokens (all allocated before the run)."""
        return Workspace()

    def prepare_weights(self, weights: ExpertWeights) -> ExpertWeights:
        """Convert reference-layout weights to this backend's layout (once, after loading)."""
        return weights

    def restore_weights(self, weights: ExpertWeights) -> ExpertWeights:
        """The inverse of ``prepare_weights``: back to the reference layout, exactly (tested)."""
        return weights

    def apply(
        self,
        a: QTensor,
        topk: TopK,
        weights: ExpertWeights,
        out: torch.Tensor,
        *,
        expert_map: torch.Tensor | None = None,
        workspace: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Standard layout: write the experts' output into ``out`` (see the module docstring)."""
        raise NotImplementedError

    def apply_batched(
        self,
        a: QTensor,
        counts: torch.Tensor,
        weights: ExpertWeights,
        out: torch.Tensor,
        *,
        workspace: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Batched layout: rows [e, :counts[e]] of ``out`` [E_l, M, H] get expert e's output."""
        raise NotImplementedError
