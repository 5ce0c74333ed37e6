"""``triton_or_grouped_mm``: ``triton`` or ``grouped_mm``, chosen per call by the token count.

The seeds' "DeepGEMM + Triton" experts, with PyTorch's CUTLASS grouped GEMM in
DeepGEMM's place: few tokens per expert (decode) go to triton, whose kernels
are bound by reading the weights and need fewer launches; many tokens per
expert (prefill) go to grouped_mm where it outruns triton on large expert
matrices. Where the two cross is measured per GPU and scheme family
(``oracle/thresholds.py``); without a measured crossover this backend refuses,
and the oracle takes triton.

Both parts read the same reference-layout weights (grouped_mm transposes views
of them), write the reduced [T, H] output, and share one workspace: triton's.
"""

from __future__ import annotations

from dataclasses import replace

from ..contract import TokenLayout
from ..platform import current_platform
from .base import Experts
from .grouped_mm import GroupedMMExperts
from .thresholds import crossover_for, no_crossover, tokens_per_expert
from .triton import TritonExperts


class TritonOrGroupedMMExperts(Experts):
    name = "triton_or_grouped_mm"
    layout = TokenLayout.STANDARD
    capabilities = replace(
        GroupedMMExperts.capabilities,
        platforms=frozenset({"cuda"}),
        note="per call: triton below the measured crossover (tokens per expert), grouped_mm from it on",
        seed_names=(),
    )
    parts = (TritonExperts, GroupedMMExperts)

    @classmethod
    def why_not(cls, config, scheme, platform, **kw) -> str | None:
        own = super().why_not(config, scheme, platform, **kw)
        if own:
            return own
        for part in cls.parts:
            reason = part.why_not(config, scheme, platform, **kw)
            if reason:
                return f"{part.name}: {reason}"
        if crossover_for(platform, scheme, config) is None:
            return (
                f"no triton/grouped_mm crossover for {platform.arch} {scheme.family} at I={config.intermediate_size} "
                f"({no_crossover(platform, scheme, config)}; experts/thresholds.py): triton serves every size"
            )
        return None

    def __init__(self, config, scheme, *, platform=None) -> None:
        super().__init__(config, scheme)
        self.platform = platform or current_platform()
        # the rule is fixed for the layer: looked up once, compared per call (host time only)
        self.crossover = crossover_for(self.platform, scheme, config)
        self.triton = TritonExperts(config, scheme)
        self.grouped_mm = GroupedMMExperts(config, scheme)

    # MoEKernel sets ``deterministic`` on its experts: triton's launch configs follow it,
    # and grouped_mm is only taken when not deterministic (its CUTLASS tiles depend on T).
    @property
    def deterministic(self) -> bool:
        return self.triton.deterministic

    @deterministic.setter
    def deterministic(self, value: bool) -> None:
        self.triton.deterministic = value

    def part_for(self, num_tokens: int) -> Experts:
        """The backend a call of ``num_tokens`` tokens runs on."""
        rule = self.crossover
        if self.deterministic or rule is None:
            return self.triton
        first = tokens_per_expert(self.config, num_tokens) >= rule.tokens_per_expert
        return self.grouped_mm if first else self.triton

    def workspace(self, num_tokens: int, num_local_experts: int):
        return self.triton.workspace(num_tokens, num_local_experts)

    def apply(self, a, topk, weights, out, *, expert_map=None, workspace=None):
        part = self.part_for(topk.ids.shape[0])
        part.apply(a, topk, weights, out, expert_map=expert_map, workspace=workspace)
