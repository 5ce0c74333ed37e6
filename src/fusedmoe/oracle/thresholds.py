"""The shape rule between ``triton`` and ``grouped_mm``: a table measured per GPU.

The seeds' "deep gemm + triton" idea: one kernel for few tokens per expert
(decode, bound by reading the weights, where triton's fused align/epilogues
save launches) and a CUTLASS grouped GEMM for many (prefill, bound by
tensor-core throughput). Where they cross depends on the GPU, the scheme
family and the shape, so it is data that ``fusedmoe bench`` fills on the GPU,
not a constant in code.

A rule has two keys: tokens per expert, T*K/E (the rows of each GEMM group,
which decide whether a weight tile is reused), and the intermediate size I
(the width of each expert's GEMMs). Both matter: a first eager (no CUDA
graph) run on an H100 (experts only, bf16 / fp8 per channel) had grouped_mm at
0.84x / 0.67x of triton's time for Mixtral (E=8, I=14336) at 4096 tokens per
expert, but at 2.1x / 1.9x for Qwen3-30B-A3B (E=128, I=768) at 1024 tokens
per expert. Until a row is measured with CUDA graphs, triton stays first at
every size.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import MoEConfig
from ..platform import Platform
from ..quant import QuantScheme


@dataclass(frozen=True)
class Crossover:
    """grouped_mm goes before triton from ``tokens_per_expert`` (T*K/E) on, for I >= ``min_intermediate_size``."""

    tokens_per_expert: int
    min_intermediate_size: int = 0


# (platform arch, scheme family) -> Crossover, or None: triton first at every size (not measured
# yet). Fill from `fusedmoe bench` on that GPU, with the run that measured it next to the number.
GROUPED_MM_CROSSOVER: dict[tuple[str, str], Crossover | None] = {
    ("sm90", "unquantized"): None,
    ("sm90", "fp8"): None,
    ("sm100", "unquantized"): None,
    ("sm100", "fp8"): None,
}


def grouped_mm_first(
    platform: Platform, scheme: QuantScheme, config: MoEConfig, num_tokens: int | None
) -> tuple[bool, str]:
    """(whether to try grouped_mm before triton, the rule in words for the explanation)."""
    key = (platform.arch, scheme.family)
    rule = GROUPED_MM_CROSSOVER.get(key)
    if rule is None:
        return False, f"shape rule: triton before grouped_mm (no measured crossover for {key[0]} {key[1]})"
    if config.intermediate_size < rule.min_intermediate_size:
        return False, (
            f"shape rule: triton before grouped_mm (I={config.intermediate_size} "
            f"< {rule.min_intermediate_size} on {key[0]})"
        )
    if num_tokens is None:
        return False, (
            f"shape rule: triton before grouped_mm (no token count given; crossover "
            f"{rule.tokens_per_expert} tokens per expert on {key[0]})"
        )
    per_expert = num_tokens * config.top_k / config.num_experts
    first = per_expert >= rule.tokens_per_expert
    order = "grouped_mm before triton" if first else "triton before grouped_mm"
    return first, (
        f"shape rule: {order} ({per_expert:g} tokens per expert, crossover {rule.tokens_per_expert} on {key[0]})"
    )
