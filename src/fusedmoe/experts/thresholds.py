"""The shape rule between ``triton`` and ``grouped_mm``: a table measured per GPU.

The seeds' "deep gemm + triton" idea: one kernel for few tokens per expert
(decode, bound by reading the weights, where triton's fused align/epilogues
save launches) and a CUTLASS grouped GEMM for many (prefill, bound by
tensor-core throughput). Where they cross depends on the GPU, the scheme
family and the shape, so it is data that ``fusedmoe bench`` fills on the GPU,
not a constant in code.

A rule has two keys: tokens per expert, T*K/E (the rows of each GEMM group,
which decide whether a weight tile is reused), and the intermediate size I
(the width of each expert's GEMMs). Both matter. Measured with CUDA graphs on
an H200 (``fusedmoe bench``, whole layer from router logits, 2026-11-21,
benchmarks/results/layer_h200_graphs_2026-11-21.md), grouped_mm's time over
triton's:

- bf16: Mixtral (E=8, I=14336) 1.03 at 256 tokens per expert, 0.89 at 1024
  and 4096; DeepSeek-V3 (I=2048), gpt-oss (I=2880) and Qwen3 (I=768) 1.1-2.0
  at every size up to 512-2048 tokens per expert;
- fp8 (row-wise against triton's per-tensor): Mixtral 1.13 at 16, 0.92 at 64
  and 256, 0.72-0.67 at 1024-4096; the others 0.90-1.8 with no steady
  crossover (DeepSeek-V3 0.90 at 32 and 1.09 at 128 tokens per expert).

That rule (grouped_mm first for I >= 8192 from 1024 (bf16) or 64 (fp8) tokens per
expert) held until triton's prefill GEMMs became the persistent TMA-fed kernel with
tables tuned for it. Measured again on an H100 (2026-11-25, the same bench with both
backends as providers, benchmarks/results/layer_h100_crossover_2026-11-25.md), grouped_mm's
time over triton's at T = 1-16384 (up to 4096 tokens per expert) on the four presets:
bf16 1.01-1.88, fp8 per-tensor 1.02-1.86 except DeepSeek-V3 at 8 and 32 tokens per expert
(0.92, 0.97). Triton is now first at every size on the H100 (its own row,
``Crossover(None, ...)``).

The H200, re-tuned with the persistent kernel (2026-11-28) and measured the same way
(benchmarks/results/layer_h200_crossover_2026-11-28.md, T = 16-16384): grouped_mm's time over
triton's bf16 1.03-1.75, fp8 per-tensor 1.03-1.76, no cell below 1. The old sm90 rule had kept
Mixtral fp8 at T >= 256 and bf16 at T >= 4096 on grouped_mm there: Mixtral fp8 T = 1024 ran
1.33 ms where triton takes 0.93. Both sm90 GPUs measured say triton first, so the sm90 row says
so too (an sm90 GPU with a different compute / bandwidth balance, e.g. an H20, is not measured:
give it its own row when it is). A GPU's own row wins over its architecture's; sm100 is not
measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import env
from ..config import MoEConfig
from ..platform import Platform
from ..quant import QuantScheme


@dataclass(frozen=True)
class Crossover:
    """grouped_mm goes before triton from ``tokens_per_expert`` (T*K/E) on, for I >= ``min_intermediate_size``;
    ``tokens_per_expert`` None: measured, and triton was first at every size up to ``measured_up_to``."""

    tokens_per_expert: int | None
    min_intermediate_size: int = 0
    measured_up_to: int = 0


# (GPU name or platform arch, scheme family) -> Crossover, or None: triton first at every size
# (not measured yet); the GPU's row wins over its arch's. Fill from `fusedmoe bench --providers
# fusedmoe,triton,grouped_mm` on that GPU, with the run that measured it next to the number.
GROUPED_MM_CROSSOVER: dict[tuple[str, str], Crossover | None] = {
    # H100, 2026-11-25, tables tuned with the persistent kernel (layer_h100_crossover_2026-11-25)
    ("NVIDIA H100 80GB HBM3", "unquantized"): Crossover(tokens_per_expert=None, measured_up_to=4096),
    ("NVIDIA H100 80GB HBM3", "fp8"): Crossover(tokens_per_expert=None, measured_up_to=4096),
    # H200, 2026-11-28, tables tuned with the persistent kernel (layer_h200_crossover_2026-11-28)
    ("NVIDIA H200", "unquantized"): Crossover(tokens_per_expert=None, measured_up_to=4096),
    ("NVIDIA H200", "fp8"): Crossover(tokens_per_expert=None, measured_up_to=4096),
    # other sm90 GPUs: what both measured sm90 GPUs say (the 2026-11-21 rule, grouped_mm from 64
    # (fp8) / 1024 (bf16) tokens per expert at I >= 8192, was measured before the persistent kernel)
    ("sm90", "unquantized"): Crossover(tokens_per_expert=None, measured_up_to=4096),
    ("sm90", "fp8"): Crossover(tokens_per_expert=None, measured_up_to=4096),
    ("sm100", "unquantized"): None,
    ("sm100", "fp8"): None,
}


def tokens_per_expert(config: MoEConfig, num_tokens: int) -> float:
    """T*K/E: the rows of each expert's GEMMs, the key of a crossover."""
    return num_tokens * config.top_k / config.num_experts


def _row(platform: Platform, scheme: QuantScheme) -> tuple[str, Crossover | None]:
    """(whose row, the rule): the GPU's own row, else its architecture's."""
    if (platform.name, scheme.family) in GROUPED_MM_CROSSOVER:
        return platform.name, GROUPED_MM_CROSSOVER[(platform.name, scheme.family)]
    return platform.arch, GROUPED_MM_CROSSOVER.get((platform.arch, scheme.family))


def crossover_for(platform: Platform, scheme: QuantScheme, config: MoEConfig) -> Crossover | None:
    """The measured crossover that applies to this platform, scheme family and I, or None."""
    rule = _row(platform, scheme)[1]
    if rule is None or rule.tokens_per_expert is None or config.intermediate_size < rule.min_intermediate_size:
        return None
    return rule


def no_crossover(platform: Platform, scheme: QuantScheme, config: MoEConfig) -> str:
    """Why no crossover applies (``crossover_for`` gave None), in words."""
    who, rule = _row(platform, scheme)
    key = (who, scheme.family)
    if rule is not None and rule.tokens_per_expert is None:
        up_to = rule.measured_up_to
        return f"triton was faster at every size measured on {key[0]} {key[1]}, up to {up_to} tokens per expert"
    if rule is not None:
        return f"I={config.intermediate_size} < {rule.min_intermediate_size} on {key[0]}"
    return f"no measured crossover for {key[0]} {key[1]}"


def grouped_mm_first(
    platform: Platform, scheme: QuantScheme, config: MoEConfig, num_tokens: int | None
) -> tuple[bool, str]:
    """(whether to try grouped_mm before triton, the rule in words for the explanation)."""
    key = (_row(platform, scheme)[0], scheme.family)
    rule = crossover_for(platform, scheme, config)
    if rule is None:
        return False, f"shape rule: triton before grouped_mm ({no_crossover(platform, scheme, config)})"
    if num_tokens is None:
        return False, (
            f"shape rule: triton before grouped_mm (no token count given; crossover "
            f"{rule.tokens_per_expert} tokens per expert on {key[0]})"
        )
    per_expert = tokens_per_expert(config, num_tokens)
    first = per_expert >= rule.tokens_per_expert
    order = "grouped_mm before triton" if first else "triton before grouped_mm"
    return first, (
        f"shape rule: {order} ({per_expert:g} tokens per expert, crossover {rule.tokens_per_expert} on {key[0]})"
    )


# 4-bit weights (int4, MXFP4, NVFP4 as w4a16) from many rows per expert: the Triton experts write the
# weights out in the model dtype once per call (``kernels.w4_dequant``) and run the bf16 GEMMs, whose
# persistent TMA-fed tiles outrun the 4-bit GEMM's once the FLOPs outweigh one pass over the weights.
# (GPU name or arch, 4-bit format) -> rows per expert (pairs / local experts) from which it pays; None
# or absent: never (not measured). Fill from `fusedmoe bench` with FUSEDMOE_W4_DEQUANT=1 against 0
# (`scripts/w4_threshold.py` reads the runs and prints the row; its docstring has the commands).
#
# H200, 2026-11-29 (benchmarks/results/layer_h200_w4_dequant_2026-11-29.md), the layer's time with
# the weights written out over the 4-bit GEMM's, at 128 / 256 / 512 / 1024 rows per expert:
#   mxfp4  Mixtral - / 1.06 / 0.82 / 0.70; gpt-oss 1.28 / 1.01 / 0.85 / -; Qwen3 - / 1.10 / 0.91 / 0.76
#   nvfp4  Mixtral - / 0.92 / 0.73 / 0.65; gpt-oss 1.09 / 0.88 / 0.77 / -; Qwen3 - / 0.91 / 0.76 / 0.67
#   int4   Mixtral 1.47 / 1.25 / 0.92 / 0.89; Qwen3 - / 1.24 / 1.00 / 0.84
# The H100 is not measured: its ~1.4x lower copy bandwidth makes the pass ~1.4x longer against GEMMs
# of about the same speed, so the H200's thresholds are not carried over to the sm90 row.
W4_DEQUANT_FROM: dict[tuple[str, str], int | None] = {
    ("NVIDIA H200", "mxfp4"): 512,
    ("NVIDIA H200", "nvfp4"): 256,
    ("NVIDIA H200", "int4"): 512,
}
# The weights written out take a buffer of E_l x max(2I x H, H x I) values in the workspace: above
# this the 4-bit GEMM serves every size (Mixtral-8x7B in bf16: 1.9 GB; DeepSeek-V3's 256 experts
# would take 15 GB).
W4_DEQUANT_MAX_BYTES = 4 << 30


def w4_dequant_from(platform: Platform, w_fmt: str, forced: int | None = None) -> int | None:
    """The rows per expert from which 4-bit weights in ``w_fmt`` are written out in the model dtype:
    ``forced`` where given (``FUSEDMOE_W4_DEQUANT`` / ``experts.w4_dequant``; 0: never), else the
    measured one of this platform (its GPU's row, else its architecture's), or None."""
    if forced is not None:
        return forced
    if (platform.name, w_fmt) in W4_DEQUANT_FROM:
        return W4_DEQUANT_FROM[(platform.name, w_fmt)]
    return W4_DEQUANT_FROM.get((platform.arch, w_fmt))


def w4_dequant_note(platform: Platform, w_fmt: str, config: MoEConfig, num_tokens: int | None) -> str:
    """The per-call rule of 4-bit weights on the Triton experts, in words (the oracle's explanation):
    from which rows per expert they are written out for the bf16 GEMMs on this platform, and which
    path ``num_tokens`` takes (``experts.triton._dequant_w4`` decides each call; the buffer bound and
    deterministic mode are checked there)."""
    forced = env.w4_dequant()
    start = w4_dequant_from(platform, w_fmt, forced)
    gpu = platform.name or platform.arch
    if not start:
        why = f"{env.W4_DEQUANT}=0" if forced is not None else f"no threshold measured for {w_fmt} on {gpu}"
        return f"4-bit rule: the 4-bit GEMM at every size ({why})"
    where = env.W4_DEQUANT if forced is not None else f"measured on {gpu}"
    rule = f"4-bit rule: {w_fmt} weights written out for the bf16 GEMMs from {start} rows per expert ({where})"
    if num_tokens is None:
        return rule
    per_expert = tokens_per_expert(config, num_tokens)
    path = "written out" if per_expert >= start else "the 4-bit GEMM"
    return f"{rule}; {per_expert:g} rows per expert at T = {num_tokens}: {path}"
